"""Broken model folders, an empty benchmark, a retired params key: through the real CLI, each
fails with exit code 2 (or a stage failure) whose message names the file or key to fix.
"""

import json
import shutil
import subprocess

import pytest
from conftest import BIN, make_project, offseason, write_params

from stages import tinylm
from stages.envs import arith


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A small, valid Hugging Face chat model folder, as `offseason init --base-model` takes it."""
    folder = tmp_path_factory.mktemp("models") / "good"
    tokenizer = tinylm.build_tokenizer(arith)
    model = tinylm.build_model(tokenizer, n_layer=1, n_embd=32, n_head=2, n_positions=64, seed=0)
    tinylm.save(model, tokenizer, folder)
    return folder


def broken_copy(model_folder, tmp_path, how):
    folder = tmp_path / f"broken-{how}"
    shutil.copytree(model_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    if how == "no-weights":
        (folder / "model.safetensors").unlink()
    elif how == "no-tokenizer":
        (folder / "tokenizer.json").unlink()
    elif how == "more-layers":  # transformers would fill the missing layer with random weights
        config["n_layer"] = 2
    elif how == "wider":
        config["n_embd"] = 64
    elif how == "small-vocab":
        config["vocab_size"] = 8
    elif how == "corrupt-weights":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("how, names", [
    ("no-weights", ["model.safetensors", "weights are missing"]),
    ("no-tokenizer", ["missing tokenizer.json"]),
    ("more-layers", ["model.safetensors does not match", "config.json", "missing keys"]),
    ("wider", ["model.safetensors", "config.json"]),
    ("small-vocab", ["model.safetensors", "config.json"]),
    ("corrupt-weights", ["model.safetensors"]),
])
def test_init_from_a_broken_model_folder_names_the_file(tmp_path, model_folder, how, names):
    root = make_project(tmp_path / "p")
    folder = broken_copy(model_folder, tmp_path, how)
    result = offseason(root, "init", "--base-model", str(folder), check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("offseason init: error: ") and str(folder) in error, error
    for name in names:
        assert name in error, error
    assert not (root / "models" / "champion.dvc").exists()


def test_a_good_model_folder_loads(model_folder):
    model, tokenizer = tinylm.load(model_folder)
    assert len(tokenizer) <= model.get_input_embeddings().num_embeddings


CHAT_TASK = '{"task_id": "a", "messages": [{"role": "user", "content": "1+1"}], "answer": 2}'


@pytest.mark.parametrize("content, says", [
    ("", "arith.jsonl: the benchmark of environment 'arith' is empty"),
    ("\n\n", "arith.jsonl: the benchmark of environment 'arith' is empty"),
    (CHAT_TASK + '\n{"task_id": \n', "arith.jsonl:2: not valid JSON"),
    ('["1+1"]\n', "arith.jsonl:1: a task is a JSON object"),
    ('{"id": "a", "question": "1+1"}\n', "arith.jsonl:1: missing 'task_id'"),
])
def test_a_bad_benchmark_fails_init_and_run_naming_the_file(tmp_path, content, says):
    root = make_project(tmp_path / "p")
    (root / "data/benchmarks/arith.jsonl").write_text(content)
    for command in ("init", "run"):
        result = offseason(root, command, check=False)
        assert result.returncode == 2, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        assert "data/benchmarks/arith.jsonl" in result.stderr and says in result.stderr
    assert not (root / "models" / "champion").exists()


def test_the_retired_base_environment_is_refused_saying_what_to_write(tmp_path):
    root = make_project(tmp_path / "p")
    write_params(root, {"base": {"environment": "chess"}})
    for command in ("init", "simulate", "run", "check"):
        result = offseason(root, command, check=False)
        assert result.returncode == 2, (command, result.stderr[-3000:])
        assert "base.environment is retired with the tag protocol" in result.stderr
        assert "write `environments: {chess: {module: my_envs.chess}}`" in result.stderr


@pytest.mark.slow
def test_a_champion_broken_after_init_fails_the_cycle_naming_the_file(simulated):
    root = simulated
    config = json.loads((root / "models/champion/config.json").read_text())
    config["n_layer"] += 1
    (root / "models/champion/config.json").write_text(json.dumps(config))
    # recorded and committed as the champion (else the cycle's pre-flight check stops at the
    # changed file, and tests/cycle/test_faults.py's corrupted cache test covers that)
    subprocess.run([str(BIN / "dvc"), "add", "-q", "models/champion"], cwd=root, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm",
                    "a broken champion", "models/champion.dvc"], cwd=root, check=True)
    result = offseason(root, "run", check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "models/champion/model.safetensors does not match" in result.stderr
    assert "rollout" in result.stderr  # the stage that found it
    # said once, without Prefect's tracebacks of the flow and the task above it
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    tags = subprocess.run(["git", "tag"], cwd=root, capture_output=True, text=True).stdout
    assert tags.split() == ["gen-0"]
