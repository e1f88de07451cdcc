# Everything installs from nothing: `make test` and `make plan` create .venv themselves.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup deps test lab lab-down plan check catalogs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# Debian packages the lab and its mirror need (debootstrap, systemd-nspawn, dpkg-dev, gnupg, ...);
# installed when running as root, which the lab needs anyway.
deps:
	@if [ "$$(id -u)" = 0 ]; then bash scripts/install-lab-deps.sh && bash scripts/install-mirror-deps.sh; \
	else echo "not root: lab packages not installed (the lab tests will say why they cannot run)"; fi

test: $(STAMP) deps
	$(BIN)/pytest -q

# The main job on the embedded default fleet: a 3-node lab on this machine (booted unless one is up),
# then the full stack deployed to it. Needs root (the lab's containers and network).
lab: $(STAMP) deps
	@if $(BIN)/gpufleet lab status | grep -q "no lab is up"; then $(BIN)/gpufleet lab up --nodes 3; fi
	$(BIN)/gpufleet lab status
	$(BIN)/pyinfra -y inventories/lab.py deploys/vllm.py

lab-down: $(STAMP)
	$(BIN)/gpufleet lab down

plan: $(STAMP)
	$(BIN)/gpufleet plan inventories/prod.py

check: $(STAMP)
	$(BIN)/gpufleet check inventories/prod.py

# Maintainers: regenerate the committed vLLM flag catalogs from the vLLM wheels.
catalogs: $(STAMP)
	$(BIN)/python scripts/gen_vllm_catalog.py 0.33.0 0.32.0

clean:
	rm -rf $(VENV) build *.egg-info
