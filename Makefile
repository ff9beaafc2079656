# Both targets install into .venv first (idempotent: reinstalls only when
# pyproject.toml or requirements.lock changed).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OUT ?= build

.PHONY: demo test clean

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -c requirements.lock -e '.[export,hf,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/attn-export build --out $(OUT)
	$(BIN)/attn-export verify $(OUT)

test: $(STAMP)
	$(BIN)/ruff check attn_export tests benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

clean:
	rm -rf $(OUT) $(VENV)
