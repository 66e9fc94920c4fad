# `make setup` creates .venv and installs astraflow with the test tools, the CPU inference stack and the
# benchmarks' contenders (TRL).
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= dev,cpu,bench,agents
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: setup run test lint bench check test-oldest-torch

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@# The registry's torchvision/torchaudio/torchcodec/triton are CUDA builds that break `import vllm` on CPU.
	case ",$(EXTRAS)," in *,cpu,*) $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton ;; esac
	touch $@

run: setup
	$(VENV)/bin/astraflow run --overwrite

# The whole suite in two passes: the tests that are not `e2e` in TEST_WORKERS processes at once
# (pytest-xdist), then the `e2e` ones one at a time: they start whole runs that use every core, and several
# judge learning within a wall-clock budget. pytest exits 5 when it collected no test: a failure here.
TEST_WORKERS ?= 2
SERIAL := e2e
NOT_COLLECTED = if [ $$rc -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi; exit $$rc

test: setup
	$(VENV)/bin/pytest -n $(TEST_WORKERS) -m "not ($(SERIAL))"; rc=$$?; $(NOT_COLLECTED)
	$(VENV)/bin/pytest -m "$(SERIAL)"; rc=$$?; $(NOT_COLLECTED)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(PY) tests/bench/bus_throughput.py

# The developer's loop (CONTRIBUTING.md): lint, the fitness tests, then the unit tests but the `slow` ones
# and a warm-start run (with the dataflow property test, 2.7 of the unit suite's 6 minutes on 2 busy
# cores), which `make test` runs.
FITNESS := tests/unit/test_service_boundaries.py tests/unit/test_imports.py tests/unit/test_docs.py \
	tests/unit/test_settings_doc.py
CHECK_SKIP := tests/unit/test_tiny.py::test_warm_start_lowers_the_loss

check: lint
	$(VENV)/bin/pytest -q $(FITNESS)
	$(VENV)/bin/pytest -q tests/unit -m "not slow" $(addprefix --deselect ,$(FITNESS) $(CHECK_SKIP))

# The FSDP2 gloo tests on the oldest supported torch (astraflow/trainer/torch_range.py), in a venv of their
# own beside the pinned stack's. The registry has only CUDA builds of it: about 3.3 GB of CUDA libraries
# that import on a CPU-only machine too. From scratch on 2 busy cores: 6m40s, of which the install 4m50s
# (once per venv: the stamp keeps it) and the tests 1m48s.
OLDEST_TORCH := 2.7.1
OLD_VENV ?= .venv-torch-$(OLDEST_TORCH)
OLD_STAMP := $(OLD_VENV)/.installed

$(OLD_STAMP): pyproject.toml
	test -x $(OLD_VENV)/bin/python || python3 -m venv $(OLD_VENV)
	$(OLD_VENV)/bin/pip install -q -e . "torch==$(OLDEST_TORCH)" "transformers>=5.16.1,<5.20" "peft>=0.17" \
		"pytest>=8" "pytest-timeout>=2.3" "pytest-asyncio>=0.24" "fakeredis[lua]>=2.26"
	touch $@

test-oldest-torch: $(OLD_STAMP)
	$(OLD_VENV)/bin/pytest -q tests/integration/test_fsdp.py tests/integration/test_trainer_ranks.py \
		-k "not under_torchrun" -p no:cacheprovider
