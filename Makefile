# Everything runs inside .venv, created from the system python3 (3.10+).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_CKPT   := checkpoints/demo
DEMO_ENGINE := engines/demo
PYTEST_ARGS ?=

.PHONY: venv install demo test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

install: venv

$(DEMO_ENGINE)/engine.json: $(STAMP)
	$(BIN)/triton-disagg demo-checkpoint --output $(DEMO_CKPT)
	$(BIN)/triton-disagg build --checkpoint $(DEMO_CKPT) --output $(DEMO_ENGINE)

# Build the demo engine, generate once offline, then serve it disaggregated on Triton
# (context on core 0, generation on core 1) until Ctrl-C.
demo: $(DEMO_ENGINE)/engine.json
	$(BIN)/triton-disagg run --engine $(DEMO_ENGINE) --text "The quick brown fox" --max-tokens 16
	$(BIN)/triton-disagg serve all -c disagg_config.yaml

test: venv
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Both benchmarks print their tables and keep them in docs/benchmarks.md (plots in docs/img/).
bench: venv
	$(BIN)/triton-disagg bench engine --output docs/benchmarks.md
	$(BIN)/triton-disagg bench serve --output docs/benchmarks.md
	$(BIN)/triton-disagg bench serve --stream-interval 4 --rates 4,8,12,16,20 --output docs/benchmarks.md

clean:
	rm -rf $(VENV) engines checkpoints work
