# `make demo` and `make test` each set up what they need on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest-xdist workers: the suite waits on worker processes and timeouts about half of its wall time,
# so two workers on two cores cut it by a quarter or more (override with `make test JOBS=1`).
JOBS ?= $(shell $(PYTHON) -c "import os; print(min(4, max(2, len(os.sched_getaffinity(0)))))" 2>/dev/null || echo 2)

.PHONY: demo test install clean etcd

$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# Reuse a torch that is already importable (GPU clusters ship their own); else the local CPU wheel.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	@$(MAKE) --no-print-directory etcd
	touch $(STAMP)

# The etcd tests (the job's store on etcd) need /usr/bin/etcd from Debian's etcd-server package: installed here
# when missing and apt-get runs as root; else those tests skip, naming the package.
etcd:
	@if command -v etcd >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null \
		|| (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null) \
		|| echo "note: could not install etcd-server; the etcd tests will be skipped"; \
	else echo "note: etcd is not installed and apt-get cannot run as root here; the etcd tests will be skipped" \
		"(install Debian's etcd-server package, or put an etcd 3.4+ binary on PATH)"; fi

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/parashift demo --out demo-out

test: $(STAMP) etcd
	$(PY) -m pytest -q -p no:cacheprovider -n $(JOBS) --dist worksteal --durations=20

clean:
	rm -rf $(VENV) demo-out
