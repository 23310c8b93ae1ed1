import json
import random

import pytest
import torch

from stages import tinylm
from stages.envs import arith, toolcall
from stages.envs.errors import TaskFileError, VerifierError
from stages.envs.registry import ENVIRONMENTS, load_tasks
from stages.generation import transformers_backend
from stages.training import warmstart
from stages.training.batches import encode_completion

INTERFACE = ["NAME", "VERSION", "TAGS", "CHARS", "TOOL_CLOSE", "MAX_TURNS", "prompt",
             "on_tool_close", "verify", "score", "gold_completion", "task_from_messages",
             "messages_from_completion", "sample_question", "mix_for_day", "demonstration",
             "task_kind"]


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_every_environment_has_the_interface(name):
    env = ENVIRONMENTS[name]
    missing = [attr for attr in INTERFACE if attr not in vars(env)]
    assert not missing and env.NAME == name and env.TOOL_CLOSE in env.TAGS
    assert "@" in env.VERSION and env.MAX_TURNS >= 1
    assert issubclass(VerifierError, RuntimeError)


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and the cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def overfit(env, completions: list[tuple[str, str]], steps: int, **size):
    """A tiny model that has learned these (question, completion) pairs by heart."""
    tokenizer = tinylm.build_tokenizer(env)
    model = tinylm.build_model(tokenizer, seed=0, **size)
    examples = [dict(zip(("token_ids", "model_mask"), encode_completion(tokenizer, env, env.prompt(q), c)))
                for q, c in completions]
    warmstart.train(model, iter(lambda: examples, None), steps=steps, lr=1e-2, tokenizer=tokenizer,
              seed=0)
    model.eval()
    return model, tokenizer


def injected(tokenizer, episode) -> str:
    """The text of the completion tokens the model did not choose (the environment's)."""
    start = len(tokenizer.encode(episode.prompt, add_special_tokens=False))
    return tokenizer.decode([t for t, m in zip(episode.token_ids[start:],
                                               episode.model_mask[start:]) if m == 0])


def test_multi_turn_arith_episode_through_the_generate_loop(one_thread):
    # Two calculator calls: the second one's result only exists if the first was answered.
    completion = "<calc>12+30</calc><result>42</result><calc>42*2</calc><result>84</result>answer:84"
    model, tokenizer = overfit(arith, [("12+30*2", completion)], steps=60, n_layer=1, n_embd=48,
                               n_head=2, n_positions=64)
    [episode] = transformers_backend.generate(model, tokenizer, arith, [arith.prompt("12+30*2")],
                                  temperature=0.0, max_new_tokens=48, seed=0, batch_size=4,
                                  progress=False)
    assert episode.completion == completion and episode.finish == "eos"
    assert episode.tool_calls == 2 <= arith.MAX_TURNS
    # exactly the environment's tool results were injected, and none counts as the model's
    assert injected(tokenizer, episode) == "<result>42</result><result>84</result>"
    assert sum(episode.model_mask) == len(tokenizer.encode(
        completion.replace("<result>42</result>", "").replace("<result>84</result>", ""),
        add_special_tokens=False))
    assert all(lp == 0.0 for lp, m in zip(episode.logprobs, episode.model_mask) if m == 0)
    assert arith.score("12+30*2", "84", episode.completion) == \
        {"correct": 1.0, "format": 1.0, "tool_ok": 1.0}


def test_toolcall_episode_through_the_generate_loop(one_thread):
    call = '{"name": "set_timer", "arguments": {"minutes": 5}}'
    completion = f"<tool_call>{call}</tool_call>" + toolcall.on_tool_close(
        f"<tool_call>{call}</tool_call>")
    model, tokenizer = overfit(toolcall, [("5 min timer", completion)], steps=80, n_layer=1,
                               n_embd=64, n_head=2, n_positions=128)
    [episode] = transformers_backend.generate(model, tokenizer, toolcall, [toolcall.prompt("5 min timer")],
                                  temperature=0.0, max_new_tokens=80, seed=0, batch_size=1,
                                  progress=False)
    assert episode.completion == completion and episode.tool_calls == 1
    assert injected(tokenizer, episode) == '<tool_response>{"ok": true}</tool_response>'
    task = load_tasks("data/tasks/toolcall.jsonl")[3]  # "Set a timer for 25 minutes"
    components = toolcall.score(task["question"], task["answer"], episode.completion)
    assert components["format"] == components["tool_ok"] == components["right_tool"] == 1.0
    assert components["correct"] == 0.0  # 5 minutes, not the 25 asked for


def test_load_tasks_reads_suites(tmp_path):
    tasks = load_tasks("data/tasks/toolcall.jsonl")
    assert len(tasks) == 20 and len({t["task_id"] for t in tasks}) == 20
    assert all(json.loads(t["answer"])["tools"] for t in tasks)
    bench = load_tasks("data/benchmarks/arith.jsonl")  # `id` and integer answers
    assert bench[0] == {"task_id": "arith-0000", "question": "14*1", "answer": "14"}
    path = tmp_path / "suite.jsonl"
    path.write_text('{"task_id": "a", "question": "q", "answer": {"tools": []}}\n\n')
    assert load_tasks(path) == [{"task_id": "a", "question": "q", "answer": '{"tools": []}'}]


@pytest.mark.parametrize("text, message", [
    ('{"task_id": "a", "question": "q", "answer": "1"}\n{"task_id": "b", "question"\n',
     r"suite.jsonl:2: not valid JSON"),
    ('["a", "q", "1"]\n', r"suite.jsonl:1: expected a JSON object"),
    ('{"question": "q", "answer": "1"}\n', r"suite.jsonl:1: missing 'task_id'"),
    ('{"task_id": "a", "answer": "1"}\n', r"suite.jsonl:1: 'question' must be"),
    ('{"task_id": "a", "question": "q"}\n', r"suite.jsonl:1: missing 'answer'"),
    ('{"id": "a", "question": "q", "answer": "1"}\n\n{"id": "a", "question": "r", "answer": "2"}\n',
     r"suite.jsonl:3: task_id 'a' repeats line 1"),
])
def test_load_tasks_names_file_and_line(tmp_path, text, message):
    path = tmp_path / "suite.jsonl"
    path.write_text(text)
    with pytest.raises(TaskFileError, match=message):
        load_tasks(path)


def test_load_tasks_names_a_missing_file(tmp_path):
    with pytest.raises(TaskFileError, match="nope.jsonl: task suite not found"):
        load_tasks(tmp_path / "nope.jsonl")


def test_toolcall_demo_functions_say_they_are_not_there():
    with pytest.raises(NotImplementedError, match="data/tasks/toolcall.jsonl"):
        toolcall.sample_question(random.Random(0), None)
