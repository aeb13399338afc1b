# Everything runs inside .venv, created from the system python3 (3.10+; Debian/Ubuntu:
# apt-get install python3 python3-venv make). `doctor --install` adds the one system
# library Triton's Python backend needs (libpython3.X) when it is missing; `make test-tools`
# adds etcd, iproute2 and prometheus for the discovery, multi-host and Prometheus tests, as root.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# serving: triton-disagg and its dependencies; test: + torch (CPU), pytest and [bench]
# (transformers, matplotlib, locust: the bench commands and CI's soak)
STAMP      := $(VENV)/.installed
# [cpu]'s torch pin, from PyTorch's CPU index first: on public PyPI torch==2.13.0 is the CUDA
# build (about 4 GB of CUDA libraries; README, "What each install pulls"), as in the Dockerfile
TORCH_CPU       := torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TEST_STAMP := $(VENV)/.installed-test
DEMO_CKPT   := checkpoints/demo
DEMO_ENGINE := engines/demo
HTTP_PORT    ?= 8000
GRPC_PORT    ?= 8001
METRICS_PORT ?= 8002
FRONT_PORT   ?= 8080
PYTEST_ARGS ?=

.PHONY: venv install doctor test-tools demo test test-fast bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) with $(PYTHON) and installing triton-disagg (first time: a few minutes)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --progress-bar off --upgrade pip
	$(BIN)/pip install --progress-bar off --timeout 10 --retries 0 \
	    --index-url $(TORCH_CPU_INDEX) "$(TORCH_CPU)" || \
	    echo "==> $(TORCH_CPU_INDEX) unreachable: torch from pip's configured index"
	$(BIN)/pip install --progress-bar off -e ".[cpu]"   # CPU torch: no CUDA libraries (README)
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	@echo "==> installing the test extra: pytest, torch (CPU build), and [bench]: transformers, matplotlib, locust"
	$(BIN)/pip install --progress-bar off -e ".[test]"
	touch $(TEST_STAMP)

install: venv

# Can tritonserver's Python backend start with this Python? Installs libpython3.X where it can.
doctor: $(STAMP)
	$(BIN)/triton-disagg doctor --install

# Programs the tests run besides Python: etcd (the discovery tests start a real one), ip
# (iproute2: the multi-host tests make hosts out of network namespaces) and prometheus
# (tests/cluster/test_prometheus.py scrapes a server with docs/observability/prometheus.yml). As root with
# apt-get the missing ones are installed here; otherwise the tests that need them fail
# with the command to run (they are never skipped).
test-tools:
	@missing=""; \
	command -v etcd >/dev/null || missing="$$missing etcd-server"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	command -v prometheus >/dev/null || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "==> installing$$missing with apt-get (for the discovery, multi-host and Prometheus tests)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  else \
	    echo "missing:$$missing; the tests that run them will fail; run: sudo apt-get install$$missing"; \
	  fi; \
	fi

# builders/demo.py: a checkout whose demo checkpoint changed (e.g. gained its chat template)
# rebuilds the engine.
$(DEMO_ENGINE)/engine.json: $(STAMP) builders/demo.py
	$(BIN)/triton-disagg demo-checkpoint --output $(DEMO_CKPT)
	$(BIN)/triton-disagg build --checkpoint $(DEMO_CKPT) --output $(DEMO_ENGINE)

# Build the demo engine, generate once offline, then serve it disaggregated on Triton
# (context on core 0, generation on core 1) until Ctrl-C. Ports: make demo HTTP_PORT=9000 ...
# (all four: HTTP_PORT, GRPC_PORT, METRICS_PORT and FRONT_PORT, the OpenAI front's)
demo: doctor $(DEMO_ENGINE)/engine.json
	$(BIN)/triton-disagg run --engine $(DEMO_ENGINE) --text "The quick brown fox" --max-tokens 16
	$(BIN)/triton-disagg serve all -c disagg_config.yaml \
	    --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
	    --front-port $(FRONT_PORT)

# Everything: tests/unit, tests/server (real tritonservers) and tests/cluster (root, netns,
# etcd, Prometheus).
test: $(TEST_STAMP) doctor test-tools
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The fast lane: tests/unit only, which start no process (no tritonserver, so no doctor
# and no test-tools); 1 to 3 minutes on 2 cores (README, Testing).
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q tests/unit $(PYTEST_ARGS)

# The benchmarks print their tables and keep them in docs/benchmarks.md (plots in docs/img/).
bench: $(TEST_STAMP)
	$(BIN)/triton-disagg bench engine --output docs/benchmarks.md
	$(BIN)/triton-disagg bench serve --output docs/benchmarks.md
	$(BIN)/triton-disagg bench serve --stream-interval 4 --output docs/benchmarks.md
	$(BIN)/triton-disagg bench handoff --output docs/benchmarks.md
	$(BIN)/triton-disagg bench remote --output docs/benchmarks.md
	$(BIN)/triton-disagg bench front --output docs/benchmarks.md
	$(BIN)/triton-disagg bench stall --repeats 3 --output docs/benchmarks.md

clean:
	rm -rf $(VENV) engines checkpoints work
