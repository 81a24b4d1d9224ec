# llmserve CUDA worker image (model + paged KV cache on an NVIDIA GPU). Build from the repository root:
#   docker build -f deploy/docker/worker.Dockerfile -t llmserve/worker:0.1.0 .
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CUDA_HOME=/usr/local/cuda \
    PATH=/opt/venv/bin:$PATH

# The Numba-CUDA kernels compile through NVVM and libdevice, which come with cuda-nvcc and are
# not part of the runtime image.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv cuda-nvcc-12-8 \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# The CUDA build of torch, the same version pyproject.toml pins (the CPU image gets the CPU build).
RUN pip install --index-url https://download.pytorch.org/whl/cu128 torch==2.13.0

COPY pyproject.toml README.md /src/
COPY llmserve /src/llmserve
COPY protos /src/protos
COPY scheduler_service /src/scheduler_service
COPY worker_service /src/worker_service
COPY kernels /src/kernels
COPY shared /src/shared
COPY openai_api /src/openai_api
COPY benchmarks /src/benchmarks
# The cuda extra: numba-cuda, which compiles the kernels (pyproject.toml).
RUN pip install /src[cuda] && rm -rf /src

# Non-root, read-only-root friendly: writable paths are /cache (an emptyDir) and /tmp; models come
# read-only from a volume at /models; nothing is downloaded at run time.
RUN groupadd --system --gid 10001 llmserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /cache --no-create-home llmserve \
    && mkdir -p /cache /models \
    && chown 10001:10001 /cache
ENV HOME=/cache \
    LLMSERVE_CACHE=/cache/llmserve \
    HF_HOME=/cache/huggingface \
    NUMBA_CACHE_DIR=/cache/numba \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
USER 10001:10001
WORKDIR /cache

# 50061: Worker gRPC API, 9090: Prometheus metrics.
EXPOSE 50061 9090
CMD ["llmserve", "worker"]
