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

.PHONY: setup demo test lint clean-state

setup: $(VENV)/.installed

# torch first and pinned: this machine has the CPU build of 2.13.0 on disk; an unpinned torch
# would pull a multi-GB CUDA build. constraints.txt pins the rest to versions tested together.
# g++: DeepSpeed compiles its small CPU ops (shared-memory comm) on first use.
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	command -v g++ >/dev/null || (apt-get update -qq && apt-get install -y -qq g++)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $@

demo: setup
	$(BIN)/offseason demo

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check flows stages tests

# forget local MLflow, Prefect and DVC remote state (not the git history)
clean-state:
	rm -rf mlflow.db mlartifacts .prefect .dvcstore .offseason
