# ddtree-jax: `make test` and `make demo` do all set-up on a fresh machine.
PYENV_PY := $(shell pyenv root 2>/dev/null)/versions/$(shell cat .python-version)/bin/python
PY312 := $(or $(wildcard $(PYENV_PY)),$(shell command -v python3.12 2>/dev/null))
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo lint
setup: $(STAMP)

$(STAMP): pyproject.toml
	@if [ -z "$(PY312)" ]; then echo "error: Python 3.12 not found (install it with 'pyenv install $$(cat .python-version)')" >&2; exit 2; fi
	$(PY312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest -n 2 --dist=loadgroup tests

demo: setup
	$(PY) -m experiments.demo

lint: setup
	$(VENV)/bin/ruff check ddtree_jax pallas_kernels checkpoints experiments tests
	$(VENV)/bin/ruff format --check ddtree_jax pallas_kernels checkpoints experiments tests
