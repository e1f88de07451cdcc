# Everything installs from nothing: `make test` and `make plan` create .venv themselves.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup test plan check catalogs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/pytest -q

plan: $(STAMP)
	$(BIN)/gpufleet plan inventories/prod.py

check: $(STAMP)
	$(BIN)/gpufleet check inventories/prod.py

# Maintainers: regenerate the committed vLLM flag catalogs from the vLLM wheels.
catalogs: $(STAMP)
	$(BIN)/python scripts/gen_vllm_catalog.py 0.33.0 0.32.0

clean:
	rm -rf $(VENV) build *.egg-info
