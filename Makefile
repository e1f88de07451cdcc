# Everything installs from nothing: `make test` and `make plan` create .venv themselves. `plan` and `check`
# need the product only; the tests, the lab and the benchmarks also install the `test` and `lab` extras.
PYTHON    ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.installed
LAB_STAMP := $(VENV)/.installed-lab
NODES     ?= 1

.PHONY: setup setup-lab deps test test-fast lab lab-down bench bench-client bench-client-lock plan check \
	catalogs docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $(STAMP)

$(LAB_STAMP): $(STAMP) pyproject.toml lab/pyproject.toml
	$(BIN)/pip install -q -e ./lab -e '.[test,lab]'
	touch $(LAB_STAMP)

setup: $(STAMP)

setup-lab: $(LAB_STAMP)

# Debian packages the lab, its mirror and the tests need (debootstrap, systemd-nspawn, dpkg-dev, gnupg, haproxy, ...);
# installed when running as root, which the lab needs anyway.
deps:
	@if [ "$$(id -u)" = 0 ]; then bash scripts/install-lab-deps.sh && bash scripts/install-mirror-deps.sh; \
	else echo "not root: lab packages not installed (the lab tests will say why they cannot run)"; fi

# Every tier (tests/unit, tests/tools, tests/lab): lint, then the unit and tools tiers (2 workers) beside the lab
# tier, from its first test that waits on timers; the output ends with each tier's wall time and the 25 slowest tests.
test: $(LAB_STAMP) deps
	$(BIN)/python scripts/run_tiers.py --workers 2

# The inner loop, no root needed: lint, then the unit and tools tiers on every core (a missing tool skips, with why).
test-fast: $(LAB_STAMP)
	$(BIN)/python scripts/run_tiers.py --fast --workers auto

# The main job on the embedded default fleet: a 3-node lab on this machine (booted unless one is up),
# then the full stack deployed to it, and how to send it a first request. Needs root (the lab's containers and
# network).
lab: $(LAB_STAMP) deps
	@if $(BIN)/gpufleet lab status | grep -q "no lab is up"; then $(BIN)/gpufleet lab up --nodes 3; fi
	$(BIN)/gpufleet lab status
	$(BIN)/pyinfra -y inventories/lab/inventory.py deploys/vllm.py
	$(BIN)/gpufleet lab client

lab-down: $(LAB_STAMP)
	$(BIN)/gpufleet lab down

# Timings on private labs of $(NODES) nodes (needs root): lab boot, then a first and a second converge.
bench: $(LAB_STAMP) deps
	$(BIN)/python bench/lab_boot.py --nodes $(NODES)
	$(BIN)/python bench/converge.py --nodes $(NODES)

# gpufleet bench's client (guidellm) on this machine, from its hash lock in gpufleet/data/guidellm/ (gpufleet bench
# installs nothing). torch's CPU build is not on PyPI: pip's configuration, PIP_FIND_LINKS or PIP_EXTRA_INDEX_URL
# say where it is; GPUFLEET_BENCH_WHEELHOUSE=DIR installs offline, from that directory of wheels alone.
bench-client: $(STAMP)
	$(BIN)/gpufleet bench-client

plan: $(STAMP)
	$(BIN)/gpufleet plan inventories/prod.py

check: $(STAMP)
	$(BIN)/gpufleet check inventories/prod.py

# Maintainers: regenerate the committed vLLM flag catalogs from the vLLM wheels.
catalogs: $(STAMP)
	$(BIN)/python scripts/gen_vllm_catalog.py 0.33.0 0.32.0 0.31.0

# Maintainers: regenerate the bench client's lock from PyPI, torch's CPU build from TORCH_FROM (pip options).
TORCH_FROM ?= --extra-index-url https://download.pytorch.org/whl/cpu
bench-client-lock: $(LAB_STAMP)
	$(BIN)/python scripts/gen_bench_client_lock.py $(TORCH_FROM)

# The reference pages of docs/reference/ (variables, commands, roles) and every role's defaults.yml, written from
# the code; never edit them by hand: tests/unit/test_docs.py fails when one is stale.
docs: $(STAMP)
	$(BIN)/python scripts/gen_docs.py

clean:
	rm -rf $(VENV) build *.egg-info
