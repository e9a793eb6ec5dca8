# hetpar: two set-up commands, `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# Workers for the demo; the demo plans a small GPT for this many local CPU ranks.
DEMO_NPROC ?= 2
DEMO_DIR ?= out/demo

.PHONY: install demo test test-quick clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	PY=$(PY) TORCH_VERSION=$(TORCH_VERSION) sh scripts/install_torch.sh
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: install
	PATH=$(abspath $(VENV))/bin:$$PATH sh scripts/demo.sh $(DEMO_DIR) $(DEMO_NPROC)

# Test processes for the single-process tests (pytest-xdist). The multi-process torchrun
# tests run one at a time after them: each already keeps every core busy.
TEST_WORKERS ?= 2

# The whole suite, multi-process torchrun tests included.
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m 'not slow' --durations=15
	$(PY) -m pytest -q -m slow --durations=15

# The fast subset for local iteration: no multi-process runs.
test-quick: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m 'not slow'

clean:
	rm -rf $(VENV) out build *.egg-info
