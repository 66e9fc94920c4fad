# `make setup` creates .venv and installs astraflow with the test tools, the CPU inference stack and the
# benchmarks' contenders (TRL).
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= dev,cpu,bench,agents
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: setup run test lint bench check

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

# pytest exits 5 when it collected no test: that is a failure here.
test: setup
	$(VENV)/bin/pytest; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi; exit $$rc

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
