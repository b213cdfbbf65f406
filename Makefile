# omniwire: `make run` sets everything up and runs the demo; `make test` sets
# everything up and runs the whole suite. Only python3 and make are needed.
# `make setup` is what one host needs (the project with its test and bench extras);
# `make setup ENGINES=1` adds the cross-host engines (the mooncake and nixl extras,
# and as root the Debian libraries they load). `make test` always adds them.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch (pip finds it on this kind of machine; elsewhere it is
# downloaded). uv/poetry would fetch a 3 GB CUDA build: setup uses pip only.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.omniwire-setup
ENGINE_STAMP := $(VENV)/.omniwire-engines
ENGINES ?=
EXTRAS := test,bench
ENGINE_EXTRAS := mooncake,nixl
EXAMPLE := examples/omniwire-backend-example
# tests/test_sglang_omni.py: sglang-omni 0.1.9 without its GPU tree (--no-deps) plus the light packages
# its comm/relay/pipeline/scheduling modules import, beside the venv (pip check would miss its GPU tree)
SGLANG_OMNI := --target $(VENV)/sglang-omni pydantic PyYAML pybase64 starlette huggingface_hub
# Debian libraries `import mooncake.engine` needs. No ibverbs-providers: its
# libefa makes NIXL processes segfault at exit (see shared/BACKENDS.md).
# iproute2 (ip, tc): the namespace "hosts" of tests/test_cluster.py
DEB_LIBS := libibverbs1 libnl-3-200 libnl-route-3-200 iproute2

.PHONY: setup engines run test lint typecheck package bench demo-remote clean

setup: $(STAMP) $(if $(filter-out 0,$(ENGINES)),$(ENGINE_STAMP))

# The engines: `make setup ENGINES=1`, `make engines`, or `pip install omniwire[mooncake,nixl]`.
engines: $(ENGINE_STAMP)

$(STAMP): pyproject.toml Makefile $(wildcard $(EXAMPLE)/pyproject.toml)
	@[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	@if [ -d $(EXAMPLE) ]; then $(BIN)/python -m pip install -q -e $(EXAMPLE); fi
	$(BIN)/python -m pip install -q --no-deps --target $(VENV)/sglang-omni sglang-omni==0.1.9 && $(BIN)/python -m pip install -q $(SGLANG_OMNI)
	@touch $(STAMP)

$(ENGINE_STAMP): $(STAMP)
	@if [ "$$(id -u)" = 0 ] && ! dpkg -s $(DEB_LIBS) >/dev/null 2>&1; then \
		echo "== installing $(DEB_LIBS)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q --no-install-recommends $(DEB_LIBS) >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $(DEB_LIBS); }; \
	fi
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS),$(ENGINE_EXTRAS)]"
	@touch $(ENGINE_STAMP)

run: setup
	OMP_NUM_THREADS=1 $(BIN)/omniwire demo

demo-remote: engines
	OMP_NUM_THREADS=1 $(BIN)/omniwire demo --remote

lint: setup
	$(BIN)/ruff check src tests scripts examples conftest.py
	$(BIN)/ruff format --check src tests scripts examples conftest.py

typecheck: setup
	$(BIN)/mypy

# In `make test` (and so in CI) every engine that can run on a CPU must load:
# OMNIWIRE_REQUIRE_ENGINES turns "skipped: engine missing" into a failure.
# --durations: the slowest tests in every CI log (the suite has a 10-minute budget on
# 2 cores, busy or not). TEST_JOBS test files run at once (pytest-xdist, --dist
# loadfile: a file's tests and its module fixtures stay in one worker): most tests
# wait on processes and sockets, not on the CPU. TEST_JOBS=0 runs them one by one.
# lint, typecheck and package run beside the suite (their log is printed after it):
# they take about two minutes, mostly waiting on pip and the disk, and so does the suite.
TEST_JOBS ?= 2
test: engines
	@mkdir -p build && rm -rf build/evidence
	@echo "== test: lint, typecheck and package beside the suite (log: build/checks.log)"
	@start=$$(date +%s); \
	{ $(MAKE) --no-print-directory lint typecheck package >build/checks.log 2>&1; \
	  echo $$? >build/checks.rc; } & \
	OMNIWIRE_REQUIRE_ENGINES=1 HYPOTHESIS_PROFILE=ci OMP_NUM_THREADS=1 \
		$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile --durations=25; suite=$$?; \
	echo "== test: the suite took $$(( $$(date +%s) - start )) s (exit $$suite)"; \
	for f in build/evidence/*; do [ -f "$$f" ] && { echo "== evidence: $$f"; cat "$$f"; }; done; \
	wait; checks=$$(cat build/checks.rc); grep -v "is ignored: it is neither" build/checks.log; \
	echo "== test: lint, typecheck, package: exit $$checks; $$(( $$(date +%s) - start )) s in all"; \
	[ $$suite = 0 ] && [ $$checks = 0 ]

# The package as users install it: build the sdist and the wheel and check them, then
# 1. the wheel with NO extras, with pip's default resolver, into a fresh venv
#    ($(BARE_ENV)): `pip check`, `omniwire demo` and scripts/installed_smoke.py (every
#    module that needs no extra imports; two processes send and receive) from it.
#    torch is named beside the wheel only to get the CPU build from this machine's
#    disk, as pip does by default here (its find-links): left to itself the resolver
#    takes the newest CUDA build from PyPI (5.5 GB, minutes). --no-compile skips
#    writing torch's .pyc files (28 s instead of 50 s on 2 cores, busy).
# 2. the wheel with its extras ($(PKG_ENV)), reusing $(VENV)'s packages (torch, the
#    engines) through a .pth line after its own site-packages, so nothing is
#    downloaded twice; `pip check` and the extras' resolution run against them, and
#    tests/test_installed.py and tests/test_uvloop.py run from it.
DIST     := build/dist
PKG_ENV  := build/pkg-venv
BARE_ENV := build/bare-venv
package: engines
	@echo "== package: build sdist and wheel"
	rm -rf $(DIST) $(PKG_ENV) $(BARE_ENV)
	mkdir -p build
	$(BIN)/python -m build --outdir $(DIST) . >build/package-build.log 2>&1 || \
		{ cat build/package-build.log; exit 1; }
	@ls $(DIST)
	@echo "== package: twine check"
	$(BIN)/python -m twine check --strict $(DIST)/*
	@echo "== package: the wheel with no extras into a fresh venv, $(BARE_ENV)"
	$(PYTHON) -m venv --without-pip $(BARE_ENV)
	$(BIN)/python -m pip --python $(BARE_ENV)/bin/python install -q --no-compile \
		"$(TORCH)" $(DIST)/omniwire-*.whl
	$(BIN)/python -m pip --python $(BARE_ENV)/bin/python check
	$(BIN)/python -m pip --python $(BARE_ENV)/bin/python list --format=freeze | tr '\n' ' '; echo
	@echo "== package: omniwire demo and two processes, from the wheel with no extras"
	cd build && OMP_NUM_THREADS=1 bare-venv/bin/omniwire demo >package-demo.log 2>&1 || \
		{ cat package-demo.log; exit 1; }
	@tail -1 build/package-demo.log
	cd build && OMP_NUM_THREADS=1 bare-venv/bin/python ../scripts/installed_smoke.py
	@echo "== package: the wheel with its extras into $(PKG_ENV)"
	$(BIN)/python -m venv --without-pip $(PKG_ENV)
	$(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
		>"$$($(PKG_ENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_omniwire_base.pth"
	$(BIN)/python -m pip --python $(PKG_ENV)/bin/python install -q --no-deps --force-reinstall \
		$(DIST)/omniwire-*.whl
	$(BIN)/python -m pip --python $(PKG_ENV)/bin/python install -q \
		"$$(ls $(DIST)/omniwire-*.whl)[$(EXTRAS),$(ENGINE_EXTRAS),metrics,tracing]"
	$(BIN)/python -m pip --python $(PKG_ENV)/bin/python check
	$(PKG_ENV)/bin/python -c 'import omniwire, sys; f = omniwire.__file__; \
		print("omniwire", omniwire.__version__, "from", f); sys.exit("$(PKG_ENV)" not in f)'
	OMP_NUM_THREADS=1 $(PKG_ENV)/bin/python -m pytest -v -p no:cacheprovider \
		tests/test_installed.py tests/test_uvloop.py

# `make bench BENCH_ARGS="--quick --busy --json bench.json --plot bench.png"`
BENCH_ARGS ?=
bench: engines
	OMP_NUM_THREADS=1 $(BIN)/omniwire bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
