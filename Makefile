# kt-ft developer entry points. README's first two commands: `make install demo`, `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The pinned stack is ~8 GB: it is built once per requirements hash in a cache outside the
# clone and .venv links to it, so a fresh clone (or CI rerun) does not reinstall it.
VENV_CACHE ?= $(HOME)/.cache/kt-ft/venvs
STACK_HASH := $(shell cat requirements/stack.txt | sha256sum | cut -c1-16)
CACHED_VENV := $(VENV_CACHE)/py311-$(STACK_HASH)
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
export DISABLE_VERSION_CHECK := 0
DEMO_DIR ?= demo
DEMO_VL_DIR ?= demo_vl
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0: one process); every test is independent of the others'
PYTEST_WORKERS ?= 2

.PHONY: install demo demo-vl test test-fast lint format clean-demo

install: $(CACHED_VENV)/.stack-ok
	@if [ ! -e $(VENV) ] || [ "$$(readlink $(VENV))" != "$(CACHED_VENV)" ]; then rm -rf $(VENV); ln -s $(CACHED_VENV) $(VENV); fi
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	@$(BIN)/python -c "import kt_ft, sys; print('kt-ft', kt_ft.__version__, 'installed in', sys.prefix)"

# Built in place; the .stack-ok stamp is written last, so an interrupted build is redone.
$(CACHED_VENV)/.stack-ok:  # no prerequisite: the path holds the hash of requirements/stack.txt
	rm -rf $(CACHED_VENV)
	$(PYTHON) -m venv $(CACHED_VENV)
	$(CACHED_VENV)/bin/python -m pip install -q -r requirements/stack.txt
	touch $@

$(DEMO_DIR)/model/config.json:
	$(BIN)/kt-ft make-demo-model $(DEMO_DIR)

demo: install $(DEMO_DIR)/model/config.json
	$(BIN)/llamafactory-cli train recipes/demo_tiny_qwen3moe.yaml

$(DEMO_VL_DIR)/model/config.json:
	$(BIN)/kt-ft make-demo-vl-model $(DEMO_VL_DIR)

# The vision-language demo: tiny Qwen3-VL-MoE, generated pictures of shapes, vision + language LoRA.
demo-vl: install $(DEMO_VL_DIR)/model/config.json
	$(BIN)/llamafactory-cli train recipes/demo_tiny_qwen3vl_moe.yaml

# pytest exits 5 when it collected no tests: that is a failure here, not a pass.
test: install
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$rc

# The suite without the LLaMA-Factory training subprocesses (DDP, FSDP2, resume, CLI runs, e2e bench).
test-fast: install
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) -m "not lf_subprocess and not slow" $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$rc

lint: install
	$(BIN)/ruff check kt_ft tests scripts hatch_build.py
	$(BIN)/ruff format --check kt_ft tests scripts hatch_build.py

format: install
	$(BIN)/ruff format kt_ft tests scripts hatch_build.py
	$(BIN)/ruff check --fix kt_ft tests scripts hatch_build.py

clean-demo:
	rm -rf $(DEMO_DIR) saves/demo_tiny_qwen3moe $(DEMO_VL_DIR) saves/demo_tiny_qwen3vl_moe
