# Every target sets up what it needs, idempotently: a fresh machine runs `make demo` or `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: venv demo test test-slow bench clean

venv: $(STAMP)

# torch==2.13.0 first (the local CPU build), then the project with a torch range 2.13.0 satisfies,
# so pip never pulls a newer CUDA wheel.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Each demo run gets its own folder, so nothing from an earlier run is overwritten.
DEMO_OUT := runs/demo-$(shell date +%Y%m%d-%H%M%S)
demo: venv
	$(VENV)/bin/meshtrain train configs/shakespeare_char.toml --nproc 2 --out $(DEMO_OUT)
	$(VENV)/bin/meshtrain generate --checkpoint $(DEMO_OUT) --prompt "ROMEO:" --max-new-tokens 300

# Two pytest workers (pytest-xdist), each test file on one of them (--dist loadfile: a file's module fixtures,
# such as one torchrun launch of all its layouts, run once): a 2-core machine otherwise idles a core through the
# many single-process tests. TEST_WORKERS=0 runs them in this process. The tests marked serial measure time
# (calibration, convergence that depends on the ranks' timing) and run alone afterwards.
TEST_WORKERS ?= 2
test: venv
	$(VENV)/bin/ruff check src tests bench
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 -m "not slow and not serial"
	$(PY) -m pytest -q -m "serial and not slow"

test-slow: venv
	$(PY) -m pytest -q -m slow

# The contenders (Accelerate, Lightning Fabric) come with torch==2.13.0 named again, so pip keeps it.
bench: venv
	$(PY) -m pip install --quiet torch==2.13.0 -e '.[bench]'
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) runs out .pytest_cache
