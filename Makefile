# `make demo` and `make test` each set up what they need on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest-xdist workers: the suite waits on worker processes and timeouts about half of its wall time,
# so two workers on two cores cut it by a quarter or more (override with `make test JOBS=1`).
JOBS ?= $(shell $(PYTHON) -c "import os; print(min(4, max(2, len(os.sched_getaffinity(0)))))" 2>/dev/null || echo 2)

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
	$(PY) -m pytest -q -p no:cacheprovider -n $(JOBS) --dist worksteal --durations=20

clean:
	rm -rf $(VENV) demo-out
