# Every target installs into .venv first (idempotent: reinstalls only when
# pyproject.toml or requirements.lock changed).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OUT ?= build
# `make test` leaves out the exhaustive sweeps (marked slow; a sample of each still runs);
# `make test-all`, which CI runs, is the same command with every test.
MARK ?= not slow

.PHONY: demo test test-all typecheck docs-check docs clean

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -c requirements.lock -e '.[export,hf,test,docs]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/attn-export build --out $(OUT)
	$(BIN)/attn-export verify $(OUT)

# The type check and the strict docs build run side by side (one core each), before the tests.
test: $(STAMP)
	$(BIN)/ruff check attn_export tests benchmarks
	$(MAKE) --no-print-directory -j2 typecheck docs-check
	$(BIN)/python -m pytest -q -n 2 --dist loadfile $(if $(MARK),-m "$(MARK)")

typecheck: $(STAMP)
	$(BIN)/mypy

docs-check: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $(VENV)/site-check

test-all:
	$(MAKE) test MARK=

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(OUT) $(VENV) site
