"""The real chat templates of the families offseason serves (tests/fixtures/templates/, verbatim:
Qwen3, Qwen2.5, Llama 3.1 and 3.2, Mistral v0.3 and Nemo, Hermes 3) on tiny models built offline
(tests/chat_model.py): the probe tells the templates that rewrite earlier turns; a conversation
with tools, with and without thinking, encodes to exactly the ids and mask a rollout of the same
turns gives; and 200 tasks roll out under each through the rollout stage, the tasks a template
refuses ending their own episodes, every episode counted by how it ended.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_model import TEMPLATES, build
from transformers import AutoModelForCausalLM, AutoTokenizer

from stages.envs import contract
from stages.generation import chat, tool_parsers

REPO = Path(__file__).resolve().parents[3]

REAL = {  # name: (the tiny family whose tokens its template uses, the template's file)
    "qwen3": ("qwen3", "Qwen-Qwen3-0.6B.jinja"),
    "qwen2.5": ("qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja"),
    "llama3.1": ("llama", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
    "llama3.2": ("llama", "meta-llama-Llama-3.2-3B-Instruct.jinja"),
    "mistral-v0.3": ("mistral", "mistral_official.jinja"),
    "mistral-nemo": ("mistral", "mistralai-Mistral-Nemo-Instruct-2407.jinja"),
    "hermes3": ("hermes3", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"),
}
# the ones that only append: Qwen3's drops a turn's empty thinking once another message follows,
# Hermes 3's closes the last tool result differently, Mistral's move the system prompt
APPENDING = {"qwen2.5", "llama3.1", "llama3.2"}


@pytest.fixture(scope="module", params=list(REAL))
def real(request, tmp_path_factory):
    """(name, folder, tokenizer, model) of a tiny model with a real template; built once each."""
    family, file = REAL[request.param]
    folder = build(tmp_path_factory.mktemp(request.param.replace(".", "")), family,
                   (TEMPLATES / file).read_text())
    return (request.param, folder, AutoTokenizer.from_pretrained(folder),
            AutoModelForCausalLM.from_pretrained(folder))


@pytest.fixture(scope="module")
def support():
    return contract.load("support", "examples.support.support_env", REPO)


def lookup(order_id: str) -> dict:
    return {"id": "call_0", "type": "function",
            "function": {"name": "lookup_order", "arguments": json.dumps({"order_id": order_id})}}


def conversation(support, task: dict, thinking: bool) -> list[dict]:
    """The task's messages, two tool rounds (one call a turn, as every family takes) and the
    answer; each turn after a think block with `thinking`. Tool results as call_tool gives them,
    call ids as the parsers number them: what a rollout of these turns would hold.
    """
    def think(text: str) -> str:
        return f"<think>\n{text}\n</think>\n\n" if thinking else ""

    messages = list(task["messages"])
    for order_id, thought in (("A1001", "Look the first order up."), ("A1002", "Now the second.")):
        messages.append({"role": "assistant", "content": think(thought) or None,
                         "tool_calls": [lookup(order_id)]})
        result, _ = contract.call(support, task, "lookup_order", json.dumps({"order_id": order_id}))
        messages.append({"role": "tool", "tool_call_id": "call_0", "content": result})
    messages.append({"role": "assistant",
                     "content": think("Both found.") + "A1001 is delivered and A1002 has shipped."})
    return messages


def spans(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    out = []
    for token, bit in zip(ids, mask):
        if not out or out[-1][0] != bit:
            out.append((bit, []))
        out[-1][1].append(token)
    return out


def test_the_probe_finds_the_templates_that_rewrite_earlier_turns(real, support):
    """Init's probe and the rollout's: Qwen3's template was called prefix-preserving (the probe's
    one turn had a think block), so a turn without one broke every episode and every encode.
    """
    name, _, tok, model = real
    template = chat.Template.of(tok, list(support.tools), chat.end_ids(model, tok))
    assert template.prefix_preserving == (name in APPENDING), name
    assert template.short_ids == name.startswith("mistral")


@pytest.mark.parametrize("thinking", [False, True], ids=["no-thinking", "thinking"])
def test_a_conversation_encodes_to_the_ids_a_rollout_of_its_turns_gives(real, support, thinking):
    """Training ids: `chat.encode` of a written conversation (a trace, a gold answer) gives the ids
    and mask that playing its assistant turns through the rollout's own loop gives, token for
    token: the prompt, each turn up to its end token (trained on), the template's text after it
    with the tool result and the next generation prompt (not trained on); the parser reads each
    turn's calls back; the last turn answers.
    """
    name, _, tok, model = real
    ends = chat.end_ids(model, tok)
    template = chat.Template.of(tok, list(support.tools), ends)
    task = {"task_id": "t", "order_id": "A1001", "expected_status": "delivered",
            "messages": [{"role": "system", "content": "You are the support agent of a shop."},
                         {"role": "user", "content": "Where are my orders A1001 and A1002?"}]}
    messages = conversation(support, task, thinking)
    ids, mask = chat.encode(template, messages)
    pieces = spans(ids, mask)
    assert [bit for bit, _ in pieces] == [0, 1, 0, 1, 0, 1], name
    for bit, part in pieces[1:]:
        text = tok.decode(part)
        if bit:  # the model's own turns: each ends with its end token, no tool result in it
            assert part[-1] in ends and "status" not in text, (name, text)
        else:  # a tool result and the next generation prompt, no call in it
            assert "status" in text and "lookup_order" not in text, (name, text)
    assert "delivered" in tok.decode(pieces[2][1]) and "shipped" in tok.decode(pieces[4][1])

    parser = tool_parsers.detect(tok.chat_template)
    play = chat._Play(template, support, [task], parser, max_turns=3)
    (prompt,) = play.prompts()
    replayed, replayed_mask = list(prompt), [0] * len(prompt)
    for turn in (pieces[1][1], pieces[3][1], pieces[5][1]):
        replayed += turn
        replayed_mask += [1] * len(turn)
        answer = play.on_turn_end(0, turn)
        if answer is None:
            break
        assert isinstance(answer, list), (name, answer, play.episodes[0].error)
        replayed += answer
        replayed_mask += [0] * len(answer)
    assert (replayed, replayed_mask) == (ids, mask), name
    episode = play.episodes[0]
    assert episode.tool_calls == 2 and episode.tool_errors == 0 and episode.error is None
    said = [m for m in episode.messages if m["role"] == "assistant"]
    assert [json.loads(m["tool_calls"][0]["function"]["arguments"]) for m in said[:2]] == [
        {"order_id": "A1001"}, {"order_id": "A1002"}]
    assert "A1002 has shipped" in said[2]["content"] and "tool_calls" not in said[2]


ENV = '''"""Order lookups, for 200 tasks under every real template."""
import json

TOOLS = [{"type": "function", "function": {
    "name": "lookup_order", "description": "The status of an order.",
    "parameters": {"type": "object", "properties": {
        "order_id": {"type": "string", "description": "e.g. A1002"}}, "required": ["order_id"]}}}]
MAX_TURNS = 2


def call_tool(task, name, arguments):
    return json.dumps({"order_id": arguments.get("order_id"), "status": "delivered"})


def reward(task, messages):
    return float(any("delivered" in (m.get("content") or "") for m in messages
                     if m["role"] == "assistant"))
'''


def two_hundred_tasks() -> list[dict]:
    """200 tasks: most a question; some after a finished tool round; and the ones templates
    refuse or cannot fit: a logged empty `tool_calls` (read as no call), two calls in one logged
    message (Llama 3's templates refuse it), a tool without a description (Hermes 3's refuses
    it), a question longer than the model's 2048 positions.
    """
    system = {"role": "system", "content": "You are the support agent of a shop."}
    tasks = []
    for i in range(200):
        order = f"A{1000 + i}"
        messages = [system, {"role": "user", "content": f"Where is my order {order}?"}]
        task = {"task_id": f"t{i:03d}", "messages": messages}
        if i % 10 == 0:  # after a finished tool round, a new question
            messages[1:] = [{"role": "user", "content": "Where is A0001?"},
                            {"role": "assistant", "content": None, "tool_calls": [lookup("A0001")]},
                            {"role": "tool", "tool_call_id": "call_0", "content": "delivered"},
                            {"role": "assistant", "content": "It is delivered."},
                            {"role": "user", "content": f"And {order}?"}]
        elif i in (1, 11):  # an SDK's log: no call written as an empty list
            messages[1:] = [{"role": "user", "content": "Hello?"},
                            {"role": "assistant", "content": "Hello! How can I help?",
                             "tool_calls": []},
                            {"role": "user", "content": f"Where is {order}?"}]
        elif i in (2, 12):  # two calls in one logged turn
            messages[1:] = [{"role": "user", "content": "Where are A0001 and A0002?"},
                            {"role": "assistant", "content": None, "tool_calls": [
                                lookup("A0001"), {**lookup("A0002"), "id": "call_1"}]},
                            {"role": "tool", "tool_call_id": "call_0", "content": "delivered"},
                            {"role": "tool", "tool_call_id": "call_1", "content": "shipped"},
                            {"role": "assistant", "content": "Delivered and shipped."},
                            {"role": "user", "content": f"And {order}?"}]
        elif i in (3, 13):  # the task's own tools: one without a description
            task["tools"] = [{"type": "function", "function": {
                "name": "lookup_order", "parameters": {"type": "object", "properties": {
                    "order_id": {"type": "string"}}}}}]
        elif i == 4:  # no room to answer
            messages[1] = {"role": "user", "content": "Where is it? " * 1500}
        tasks.append(task)
    return tasks


def test_200_tasks_roll_out_under_each_template_every_episode_counted_by_how_it_ended(real,
                                                                                    tmp_path):
    """The rollout stage over 200 tasks completes under every real template: a task the template
    refuses, or one that fills the context, ends its own episode with its cause (and an `error`,
    so it is never scored zero), the others are played, and `episodes_ended` adds up.
    """
    import pyarrow.parquet as pq

    from stages import config as cfg
    from stages import rollout

    name, folder, _, _ = real
    module = "orders_" + name.replace(".", "").replace("-", "_")
    (tmp_path / f"{module}.py").write_text(ENV)
    with open(tmp_path / "tasks.jsonl", "w") as out:
        out.writelines(json.dumps(task) + "\n" for task in two_hundred_tasks())
    specs = {"orders": cfg.EnvironmentSpec(module=module, tasks="tasks.jsonl")}
    config = cfg.Rollout(samples_per_task=1, max_new_tokens=4, max_turns=1)
    metrics = rollout.run(cfg.Base(seed=0), config, specs, folder, tmp_path / "rollouts.parquet",
                          root=tmp_path)
    ended = metrics["episodes_ended"]
    assert metrics["episodes"] == 200 and sum(ended.values()) == 200, ended
    assert set(ended) == set(chat.ENDINGS)
    refused = {"llama3.1": {"task_messages": 2}, "llama3.2": {"task_messages": 2},
               "hermes3": {"tool_schema": 2}}.get(name, {})
    assert {k: n for k, n in ended.items() if k in ("task_messages", "tool_schema") and n} == \
        refused, (name, ended)
    assert ended["prompt_too_long"] == 1 and ended["template_unusable"] == 0
    assert ended["tool_failed"] == 0 and metrics["bad_arguments"] == 0
    rows = {r["task_id"]: r for r in pq.read_table(tmp_path / "rollouts.parquet").to_pylist()}
    assert len(rows) == 200
    unplayed = {task_id for task_id, r in rows.items() if r["error"]}
    assert len(unplayed) == 1 + sum(refused.values()) == metrics["errors"]
    assert "leaves no room to answer" in rows["orders:t004"]["error"]
    for task_id in unplayed:
        assert rows[task_id]["finish"] == "error" and rows[task_id]["token_ids"] == []
    if refused:
        which = "orders:t002" if name.startswith("llama") else "orders:t003"
        assert "the chat template refuses task" in rows[which]["error"]
    for task_id, row in rows.items():  # the others are played from their own prompts
        if task_id not in unplayed:
            assert row["token_ids"] and sum(row["model_mask"]) > 0, task_id
            assert len(row["token_ids"]) == len(row["model_mask"]) == len(row["logprobs"])
