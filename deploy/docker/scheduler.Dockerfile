# llmserve CPU image: the scheduler, the OpenAI-compatible HTTP front (`llmserve openai`), and the
# workers of the `cpu` Kubernetes overlay. Build from the repository root:
#   docker build -f deploy/docker/scheduler.Dockerfile -t llmserve/scheduler:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the CPU index and pinned to pyproject.toml's version: the package's own
# `torch==2.13.0` requirement is then already met and pip never fetches the multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

COPY pyproject.toml README.md /src/
COPY llmserve /src/llmserve
COPY protos /src/protos
COPY scheduler_service /src/scheduler_service
COPY worker_service /src/worker_service
COPY kernels /src/kernels
COPY shared /src/shared
COPY openai_api /src/openai_api
COPY benchmarks /src/benchmarks
RUN pip install /src && rm -rf /src

# Non-root, and nothing written under the image's own directories: every writable path is under
# /cache (an emptyDir in Kubernetes) or /tmp. Models come read-only from a volume at /models;
# nothing is downloaded at run time.
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

# 50051: public gRPC Generation API, 8000: OpenAI-compatible HTTP, 9090: Prometheus metrics.
EXPOSE 50051 8000 9090
CMD ["llmserve", "scheduler"]
