# Two commands do all the set-up on a fresh machine with Python 3.11+ and make:
#   make demo   a server and simulated nodes on loopback (Ctrl-C to stop)
#   make test   the whole suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: all demo test wheels installed tools lint unit e2e coverage mutants bench-fleet bench-gateway bench-sim-engine bench-reconcile bench-fetch bench-fabric bench-doctor bench-admin docs clean

all: test

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "llmgw needs Python 3.11 or newer (found " + sys.version.split()[0] + "); set PYTHON=python3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $(STAMP)

# The demo needs llmgw alone, not the test tools (playwright, mypy, ruff).
DEMO_STAMP := $(VENV)/.demo-stamp
$(DEMO_STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "llmgw needs Python 3.11 or newer (found " + sys.version.split()[0] + "); set PYTHON=python3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e .
	@touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/llmgw demo $(DEMO_ARGS)

# The suite runs on what a user installs (issue 36): the sdist, and from it the wheels pip
# builds (each in an isolated build environment, as `pip install .` does), installed into
# fresh venvs of their own. build/venv-test holds the compiled wheel and runs the whole suite;
# build/venv-pure holds the LLMGW_PURE=1 wheel (a compiler-less install) and runs the hot
# path's own tests and the install's start-up test. LLMGW_EXPECT_INSTALLED makes the suite
# refuse to run on anything else (tests/conftest.py). `make unit` and `make e2e` run the
# sources as edited, in the editable .venv.
# The steps before the tests run side by side (lint, the Debian programs, the wheels and venvs).
test:
	@$(MAKE) --no-print-directory -j3 lint tools installed
	LLMGW_EXPECT_INSTALLED=pure $(PUREENV)/bin/python -m pytest -p no:cacheprovider $(PURE_TESTS) $(PYTEST_ARGS)
	LLMGW_EXPECT_INSTALLED=compiled $(TESTENV)/bin/python -m pytest $(TEST_JOBS) $(PYTEST_ARGS)

WHEELS  := build/wheels
TESTENV := build/venv-test
PUREENV := build/venv-pure
SOURCES := pyproject.toml setup.py README.md $(shell find src -type f -not -path '*/__pycache__/*' -not -path '*.egg-info*')
PURE_TESTS := tests/unit/test_hotpath.py tests/unit/test_http1.py tests/unit/test_web_server.py \
	tests/unit/test_web_fastlane.py tests/unit/test_web_reactor.py tests/unit/test_web_client.py \
	tests/unit/test_gateway_fastlane.py tests/unit/test_gateway_admission.py \
	tests/unit/test_gateway_balance.py tests/unit/test_gateway_breaker.py tests/unit/test_gateway_retry.py \
	tests/unit/test_gateway_metrics_format.py tests/e2e/test_installed.py
# e2e tests spend most of their time waiting on processes: three at a time on 2 cores
TEST_JOBS ?= -n 3 --dist loadfile

# The sdist, then both wheels built from it by pip (no cache: a wheel built from the same file
# name must never be reused for the other kind); a compiled wheel that came out pure fails here.
wheels: $(WHEELS)/.stamp
$(WHEELS)/.stamp: $(STAMP) $(SOURCES)
	rm -rf $(WHEELS)
	$(BIN)/python -m build --sdist --outdir $(WHEELS) . >/dev/null
	$(BIN)/python -m pip wheel --quiet --no-deps --no-cache-dir --wheel-dir $(WHEELS)/compiled $(WHEELS)/llmgw-*.tar.gz
	@ls $(WHEELS)/compiled/*-linux_*.whl >/dev/null 2>&1 || { echo "the wheel was built pure (mypyc or the compiler failed: pip wheel -v $(WHEELS)/llmgw-*.tar.gz shows why)"; exit 1; }
	LLMGW_PURE=1 $(BIN)/python -m pip wheel --quiet --no-deps --no-cache-dir --wheel-dir $(WHEELS)/pure $(WHEELS)/llmgw-*.tar.gz
	@touch $@

# A fresh venv for each new wheel, with the wheel and its test extras only.
installed: $(TESTENV)/.stamp $(PUREENV)/.stamp
$(TESTENV)/.stamp: $(WHEELS)/.stamp
	rm -rf $(TESTENV) && $(PYTHON) -m venv $(TESTENV)
	$(TESTENV)/bin/python -m pip install --quiet --disable-pip-version-check "$$(ls $(WHEELS)/compiled/*.whl)[test]"
	@touch $@
$(PUREENV)/.stamp: $(WHEELS)/.stamp
	rm -rf $(PUREENV) && $(PYTHON) -m venv $(PUREENV)
	$(PUREENV)/bin/python -m pip install --quiet --disable-pip-version-check "$$(ls $(WHEELS)/pure/*.whl)[test]"
	@touch $@

# Programs from Debian's packages that tests drive, installed here when missing (CI starts on
# fresh machines): chromium for the admin pages' browser tests, openssl for the certificate
# checks, zsh and fish for the completion tests in those shells. tests/e2e/needs.py fails, never
# skips, where apt-get exists and chromium or openssl is missing.
tools:
	@missing=""; command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v openssl >/dev/null 2>&1 || missing="$$missing openssl"; \
	command -v zsh >/dev/null 2>&1 || missing="$$missing zsh"; \
	command -v fish >/dev/null 2>&1 || missing="$$missing fish"; \
	if [ -n "$$missing" ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's$$missing for the tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check src tests bench tools setup.py
	$(BIN)/mypy src

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

e2e: $(STAMP) tools
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

# The gateway's benches measure the installed compiled wheel, what a user runs.
bench-fleet: $(TESTENV)/.stamp
	$(TESTENV)/bin/python bench/bench_fleet.py $(BENCH_ARGS)

bench-gateway: $(TESTENV)/.stamp
	$(TESTENV)/bin/python bench/bench_gateway.py $(BENCH_ARGS)

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

bench-admin: $(STAMP) tools
	$(BIN)/python bench/bench_admin.py $(BENCH_ARGS)

docs: $(STAMP)
	$(BIN)/python tools/gendocs.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache .hypothesis .coverage .coverage.*
