# `make demo` and `make test` each set up what they need on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# Reuse a torch that is already importable (GPU clusters ship their own); else the local CPU wheel.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/parashift demo --out demo-out

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --durations=20

clean:
	rm -rf $(VENV) demo-out
