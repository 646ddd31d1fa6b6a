# Two commands do all the set-up on a fresh machine with Python 3.11+ and make:
#   make demo   a server and simulated nodes on loopback (Ctrl-C to stop)
#   make test   the whole suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: all demo test compiled browser lint unit e2e coverage mutants bench-fleet bench-gateway bench-sim-engine bench-reconcile bench-fetch bench-fabric bench-doctor bench-admin docs clean

all: test

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "llmgw needs Python 3.11 or newer (found " + sys.version.split()[0] + "); set PYTHON=python3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/llmgw demo $(DEMO_ARGS)

# The suite runs on what a regular install runs: the package with its hot path compiled
# (tools/compile.py builds that copy in $(COMPILED); a check fails if it is not what was
# imported). The tests of the compiled modules run first on the pure sources too, what an
# editable or compiler-less install runs. `make unit` and `make e2e` run the sources as edited.
test: lint browser compiled
	$(BIN)/python -m pytest $(PURE_TESTS) $(PYTEST_ARGS)
	PYTHONPATH=$(COMPILED) LLMGW_EXPECT_COMPILED=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

COMPILED   := build/compiled
PURE_TESTS := tests/unit/test_hotpath.py tests/unit/test_http1.py tests/unit/test_web_server.py \
	tests/unit/test_web_fastlane.py tests/unit/test_web_reactor.py tests/unit/test_web_client.py \
	tests/unit/test_gateway_fastlane.py tests/unit/test_gateway_admission.py \
	tests/unit/test_gateway_balance.py tests/unit/test_gateway_breaker.py tests/unit/test_gateway_retry.py \
	tests/unit/test_gateway_metrics_format.py

compiled: $(COMPILED)/.stamp
$(COMPILED)/.stamp: $(STAMP) $(shell find src/llmgw -name '*.py')
	$(BIN)/python tools/compile.py $(COMPILED)
	@touch $@

# The admin pages' browser tests run in Debian's chromium, installed here when it is missing
# (CI starts on fresh machines); tests/e2e/browser.py finds it and fails, never skips, where
# apt-get exists but chromium does not.
browser:
	@if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's chromium for the admin pages' browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check src tests bench tools setup.py
	$(BIN)/mypy src

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

e2e: $(STAMP) browser
	$(BIN)/python -m pytest tests/e2e $(PYTEST_ARGS)

# Unit and e2e tests with every process they start measured (not part of `make test`): a
# start-up hook in the venv begins coverage in each interpreter when COVERAGE_PROCESS_START is
# set; the absolute COVERAGE_FILE gathers the data of processes running in other directories.
coverage: $(STAMP)
	rm -f .coverage .coverage.*
	$(BIN)/python tools/covreport.py hook
	COVERAGE_PROCESS_START=$(CURDIR)/pyproject.toml COVERAGE_FILE=$(CURDIR)/.coverage \
		$(BIN)/python -m pytest $(PYTEST_ARGS); status=$$?; \
		$(BIN)/python tools/covreport.py report || status=1; exit $$status

# Plant known bugs one at a time in a temporary copy and check the tests catch each (a few minutes).
mutants: $(STAMP)
	$(BIN)/python tools/mutants.py $(MUTANTS)

bench-fleet: compiled
	PYTHONPATH=$(COMPILED) $(BIN)/python bench/bench_fleet.py $(BENCH_ARGS)

bench-gateway: compiled
	PYTHONPATH=$(COMPILED) $(BIN)/python bench/bench_gateway.py $(BENCH_ARGS)

bench-sim-engine: $(STAMP)
	$(BIN)/python bench/bench_sim_engine.py $(BENCH_ARGS)

bench-reconcile: $(STAMP)
	$(BIN)/python bench/bench_reconcile.py $(BENCH_ARGS)

bench-fetch: $(STAMP)
	$(BIN)/python bench/bench_fetch.py $(BENCH_ARGS)

bench-fabric: $(STAMP)
	$(BIN)/python bench/bench_fabric.py $(BENCH_ARGS)

bench-doctor: $(STAMP)
	$(BIN)/python bench/bench_doctor.py $(BENCH_ARGS)

bench-admin: $(STAMP) browser
	$(BIN)/python bench/bench_admin.py $(BENCH_ARGS)

docs: $(STAMP)
	$(BIN)/python tools/gendocs.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache .hypothesis .coverage .coverage.*
