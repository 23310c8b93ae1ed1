"""Chat episodes (stages/generation/chat.py) on real chat-model families built offline: the mask
token by token, multi-turn rollouts with native tool calls, exact ids and log-probs, tool errors
shown to the model, and templates that rewrite earlier turns.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from chat_model import build
from transformers import AutoModelForCausalLM, AutoTokenizer

from stages.envs import contract
from stages.generation import chat

REPO = Path(__file__).resolve().parents[3]
SYSTEM = "You are the support agent of an online shop."


@pytest.fixture(scope="module")
def support():
    return contract.load("support", "examples.support.support_env", REPO)


@pytest.fixture(scope="module")
def tasks(support):
    return contract.load_tasks(REPO / "examples/support/tasks.jsonl", support)


@pytest.fixture(scope="module", params=["qwen2", "llama", "mistral"])
def family(request, tmp_path_factory):
    folder = build(tmp_path_factory.mktemp(request.param), request.param)
    return (request.param, AutoTokenizer.from_pretrained(folder),
            AutoModelForCausalLM.from_pretrained(folder))


def call(order_id: str, n: int) -> dict:
    return {"id": f"call_{n}", "type": "function",
            "function": {"name": "lookup_order", "arguments": json.dumps({"order_id": order_id})}}


def two_calls(support) -> list[dict]:
    """A conversation with two tool calls, each answered, then the final answer."""
    task = {"order_id": "A1001"}
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Where are my orders A1001 and A1002?"},
            {"role": "assistant", "content": None, "tool_calls": [call("A1001", 1)]},
            {"role": "tool", "tool_call_id": "call_1",
             "content": support.call_tool(task, "lookup_order", {"order_id": "A1001"})},
            {"role": "assistant", "content": None, "tool_calls": [call("A1002", 2)]},
            {"role": "tool", "tool_call_id": "call_2",
             "content": support.call_tool(task, "lookup_order", {"order_id": "A1002"})},
            {"role": "assistant", "content": "A1001 is delivered and A1002 has shipped."}]


def spans(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    out = []
    for token, bit in zip(ids, mask):
        if not out or out[-1][0] != bit:
            out.append((bit, []))
        out[-1][1].append(token)
    return out


def test_the_mask_token_by_token_on_two_tool_calls(family, support):
    name, tok, model = family
    template = chat.Template.of(tok, list(support.tools), chat.end_ids(model, tok))
    messages = two_calls(support)
    ids, mask = chat.encode(template, messages)
    pieces = [(bit, tok.decode(part)) for bit, part in spans(ids, mask)]
    if name == "qwen2":
        trained = ['<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "A1001"}}\n'
                   '</tool_call><|im_end|>',
                   '<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "A1002"}}\n'
                   '</tool_call><|im_end|>',
                   "A1001 is delivered and A1002 has shipped.<|im_end|>"]
    elif name == "llama":  # Llama 3.1's JSON format: "parameters", one call a message, <|eot_id|>
        trained = ['{"name": "lookup_order", "parameters": {"order_id": "A1001"}}<|eot_id|>',
                   '{"name": "lookup_order", "parameters": {"order_id": "A1002"}}<|eot_id|>',
                   "A1001 is delivered and A1002 has shipped.<|eot_id|>"]
    else:  # Mistral v0.3's: ids of nine letters and digits (`call_1` is refused), each turn as a
        # rollout plays it (its template moves the system prompt to the last user message)
        trained = ['[TOOL_CALLS] [{"name": "lookup_order", "arguments": {"order_id": "A1001"}, '
                   '"id": "call00000"}]</s>',
                   '[TOOL_CALLS] [{"name": "lookup_order", "arguments": {"order_id": "A1002"}, '
                   '"id": "call00000"}]</s>',
                   " A1001 is delivered and A1002 has shipped.</s>"]
        assert template.short_ids and not template.prefix_preserving
    assert [text for bit, text in pieces if bit] == trained
    masked = [text for bit, text in pieces if not bit]
    assert len(masked) == 3  # the prompt, then each tool result with the next generation prompt
    assert SYSTEM in masked[0] and "A1001 and A1002?" in masked[0] and "lookup_order" in masked[0]
    assert "delivered" in masked[1] and "shipped" in masked[2]
    for text in masked[1:]:  # no assistant text is ever masked out, no tool text trained on
        assert "lookup_order" not in text and "has shipped." not in text
    if name == "mistral":  # each tool result answers its call by the call's id
        assert [text.split('"call_id": ')[1][:11] for text in masked[1:]] == ['"call00000"'] * 2
        return
    # token by token, the ids are the template's own rendering of the whole conversation
    whole = tok.apply_chat_template(chat._for_template(messages), tools=list(support.tools),
                                    tokenize=False)
    assert whole.startswith(tok.decode(ids))
    assert whole[len(tok.decode(ids)):] in ("", "\n")  # Qwen's newline after the last <|im_end|>


@pytest.fixture(scope="module")
def trained(chat_champion_once, support):
    """The tiny Qwen2 after a few seconds of SFT on the support example's gold conversations,
    through `chat.encode` (conftest's `chat_champion_once`): enough that it calls lookup_order and
    answers.
    """
    tok = AutoTokenizer.from_pretrained(chat_champion_once)
    model = AutoModelForCausalLM.from_pretrained(chat_champion_once)
    template = chat.Template.of(tok, list(support.tools), chat.end_ids(model, tok))
    return tok, model.eval(), template


def test_a_trained_chat_model_calls_tools_over_turns_with_exact_ids(trained, support, tasks):
    tok, model, template = trained
    episodes = chat.rollout(model, tok, support, tasks[:6], parser="hermes", temperature=0.0,
                            max_new_tokens=64, max_turns=3, generator=torch.Generator(),
                            template=template)
    scores = [contract.score(support, t, e.messages) for t, e in zip(tasks, episodes)]
    assert sum(s["called_tool"] for s in scores) >= 4, scores
    for task, episode in zip(tasks, episodes):
        if not episode.tool_calls:
            continue
        roles = [m["role"] for m in episode.messages[len(task["messages"]):]]
        assert roles[:3] == ["assistant", "tool", "assistant"], roles
        assert episode.messages[len(task["messages"])]["tool_calls"][0]["function"]["name"] == \
            "lookup_order"
        # the model's own tokens end each turn with its end token; the tool result is injected
        chosen = [t for t, m in zip(episode.token_ids, episode.model_mask) if m]
        assert chosen.count(tok.convert_tokens_to_ids("<|im_end|>")) == episode.tool_calls + 1
        forced = tok.decode([t for t, m, k in zip(episode.token_ids, episode.model_mask,
                                                  episode.turns) if not m and k == 1])
        assert forced.startswith("\n<|im_start|>user\n<tool_response>\n")
        assert forced.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
        assert episode.messages[len(task["messages"]) + 1]["content"] in forced
    # the ids trained on are the ids generated: a forward pass over the stored ids gives the
    # stored log-probs at every chosen token (nothing re-tokenized)
    for episode in episodes:
        ids = torch.tensor([episode.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        recomputed = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(episode.model_mask[1:], dtype=torch.bool)
        stored = torch.tensor(episode.logprobs[1:])
        assert mask.sum() > 0
        assert torch.allclose(recomputed[mask], stored[mask], atol=1e-4)
        assert (stored[~mask] == 0).all()


def _turn(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def play(tok, model, env, task):
    template = chat.Template.of(tok, list(env.tools), chat.end_ids(model, tok))
    return chat._Play(template, env, [task], "hermes", max_turns=3)


def test_malformed_and_unknown_calls_are_shown_to_the_model_as_tool_errors(trained, support,
                                                                           tasks):
    tok, model, _ = trained
    game = play(tok, model, support, tasks[0])
    text = ('<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": A1001}\n</tool_call>'
            '<tool_call>\n{"name": "refund", "arguments": {}}\n</tool_call><|im_end|>')
    injected = tok.decode(game.on_turn_end(0, _turn(tok, text)))
    episode = game.episodes[0]
    tool = [m for m in episode.messages if m["role"] == "tool"]
    assert len(tool) == 2
    assert tool[0]["content"].startswith("Error: unknown tool 'refund'; the tools are: lookup_order")
    assert tool[1]["content"].startswith("Error: tool call 0: not valid JSON")
    assert episode.tool_calls == 2 and episode.tool_errors == 2 and episode.error is None
    assert "not valid JSON" in injected and injected.endswith("<|im_start|>assistant\n")
    # a ToolError from the environment is the agent's to see, too
    text = '<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "Z0000"}}\n</tool_call>'
    injected = tok.decode(game.on_turn_end(0, _turn(tok, text + "<|im_end|>")))
    assert "Error: no order 'Z0000'" in injected and episode.tool_errors == 3
    # one call more than max_turns ends the episode unanswered
    assert game.on_turn_end(0, _turn(tok, text + "<|im_end|>")) == "turns"


def test_a_broken_call_tool_is_an_error_with_its_cause_not_a_tool_message(trained, tmp_path):
    tok, model, _ = trained
    (tmp_path / "broken_env.py").write_text(
        "TOOLS = [{'type': 'function', 'function': {'name': 'lookup', 'parameters': "
        "{'type': 'object', 'properties': {}}}}]\n"
        "def call_tool(task, name, arguments):\n    raise ConnectionError('database down')\n"
        "def reward(task, messages):\n    return 1.0\n")
    env = contract.load("broken", "broken_env", tmp_path)
    game = play(tok, model, env, {"task_id": "t", "messages": [{"role": "user", "content": "?"}]})
    text = '<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call><|im_end|>'
    assert game.on_turn_end(0, _turn(tok, text)) == "error"
    assert game.episodes[0].error == ("environment 'broken' (module 'broken_env'): "
                                      "call_tool('lookup') raised ConnectionError: database down")


def test_qwen3s_own_template_is_rendered_incrementally_and_its_episodes_go_on(trained, support,
                                                                          tasks):
    """Qwen3's template as Qwen ships it (tests/fixtures/templates/) drops a turn's empty thinking
    once a tool result follows: init's probe (its one turn had a think block) called it
    prefix-preserving and the first tool call without thinking stopped the rollout. The trained
    agent (Qwen2's tokens; Qwen3's template renders tools, calls and results as Qwen2.5's does)
    plays its tool rounds under it, ids exact.
    """
    from chat_model import QWEN3_TEMPLATE

    tok, model, _ = trained
    original = tok.chat_template
    tok.chat_template = QWEN3_TEMPLATE
    try:
        template = chat.Template.of(tok, list(support.tools), chat.end_ids(model, tok))
        assert not template.prefix_preserving
        for content in (None, "<think>\n\n</think>\n\n", "<think>\nlook it up\n</think>\n\n"):
            history = [{"role": "user", "content": "A1001?"},
                       {"role": "assistant", "content": content, "tool_calls": [call("A1001", 1)]}]
            text = template.after_turn(history, [{"role": "tool", "tool_call_id": "call_1",
                                                  "content": "delivered"}])
            # only what follows the model's <|im_end|>: its own tokens stay as generated
            assert text == ("\n<|im_start|>user\n<tool_response>\ndelivered\n</tool_response>"
                            "<|im_end|>\n<|im_start|>assistant\n"), content
        episodes = chat.rollout(model, tok, support, tasks[:6], parser="hermes", temperature=0.0,
                                max_new_tokens=64, max_turns=3, generator=torch.Generator(),
                                template=template)
    finally:
        tok.chat_template = original
    assert sum(e.tool_calls > 0 for e in episodes) >= 4, [e.ended for e in episodes]
    for episode in episodes:
        assert episode.error is None and episode.ended in chat.ENDINGS
        assert episode.ended != "template_unusable"
        ids = torch.tensor([episode.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        recomputed = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(episode.model_mask[1:], dtype=torch.bool)
        assert torch.allclose(recomputed[mask], torch.tensor(episode.logprobs[1:])[mask], atol=1e-4)


def test_a_tokenizer_without_chat_template_is_refused_saying_what_to_do(trained):
    tok, model, _ = trained
    original = tok.chat_template
    tok.chat_template = None
    try:
        with pytest.raises(chat.TemplateError, match="has no chat template: add one"):
            chat.Template.of(tok, None)
    finally:
        tok.chat_template = original


def test_a_server_that_sends_no_token_ids_is_refused_on_the_chat_path(trained, support, tasks,
                                                                      tmp_path):
    import threading

    from stages.generation import openai_backend, serve_tiny

    tok, model, template = trained
    folder = tmp_path / "served"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)

    class NoIds(serve_tiny.Handler):  # a server without vLLM's return_tokens_as_token_ids
        def do_POST(self):  # noqa: N802
            body = json.loads(self.body())
            body.pop("return_tokens_as_token_ids", None)
            self.complete(json.dumps(body).encode())

    server = serve_tiny.make_server(folder, handler=NoIds, name="tiny")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    try:
        with pytest.raises(openai_backend.ServerError, match="return_tokens_as_token_ids"):
            openai_backend.chat_rollout(
                tok, support, tasks[:1], [0], urls=[f"http://{host}:{port}/v1"], parser="hermes",
                max_turns=2, context=model.config.max_position_embeddings,
                ends=chat.end_ids(model, tok), template=template, temperature=0.0,
                progress=False, retries=0)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("arguments, tool_errors", [
    ('{"order_id": "A1001"', 1),  # the model left its call unclosed: a tool error it sees
    ('{"order_id": "A10', 0),  # the server cut off a call the model closed: answered
])
def test_a_served_call_whose_arguments_are_not_json_does_not_stop_the_stage(
        trained, support, tasks, chat_champion_once, arguments, tool_errors):
    """vLLM's Mistral parser passes on the arguments of a call it could not close, cut off and
    not JSON; `json.loads` on them stopped the rollout stage. The server's reading of that turn is
    not compared but counted (`bad_arguments`): the calls are read from the turn's ids by
    rollout.tool_parser, as on the completions path, and the episode goes on to its answer.
    """
    import threading

    from stages.generation import openai_backend, serve_tiny

    tok, model, template = trained
    closed = "}" if tool_errors == 0 else ""
    turns = ['<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "A1001"}' + closed
             + '\n</tool_call><|im_end|>', "Order A1001 is delivered.<|im_end|>"]

    class CutOff(serve_tiny.Handler):  # a vLLM whose parser hands on arguments that are not JSON
        def do_POST(self):  # noqa: N802
            body = json.loads(self.body())
            prompt = self.engine.parse_chat(body)["ids"]  # rendered as the server renders it
            turn = sum(m["role"] == "assistant" for m in body["messages"])
            ids = tok(turns[turn], add_special_tokens=False)["input_ids"]
            message = {"role": "assistant", "content": "Order A1001 is delivered."}
            if turn == 0:
                message = {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "chatcmpl-tool-0", "type": "function",
                     "function": {"name": "lookup_order", "arguments": arguments}}]}
            self.reply(200, {"prompt_token_ids": prompt, "choices": [{
                "index": 0, "message": message, "token_ids": ids,
                "finish_reason": "tool_calls" if turn == 0 else "stop",
                "logprobs": {"content": [{"token": "", "logprob": -1.0} for _ in ids]}}]})

    server = serve_tiny.make_server(chat_champion_once, handler=CutOff, name="tiny",
                                    tool_parser="hermes")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    try:
        (episode,), stats = openai_backend.chat_rollout(
            tok, support, tasks[:1], [0], urls=[f"http://{host}:{port}/v1"], parser="hermes",
            max_turns=2, context=model.config.max_position_embeddings,
            ends=chat.end_ids(model, tok), template=template, temperature=0.0,
            progress=False, retries=0, api="chat")
    finally:
        server.shutdown()
        server.server_close()
    assert stats.requests == 2 and episode.bad_arguments == 1
    assert episode.ended == "answered" and episode.error is None
    assert episode.tool_calls == 1 and episode.tool_errors == tool_errors
    (answer,) = [m for m in episode.messages if m["role"] == "tool"]
    assert answer["content"].startswith("Error: tool call 0: not valid JSON") == bool(tool_errors)
    assert ("delivered" in answer["content"]) != bool(tool_errors)


def test_each_task_is_rendered_and_played_with_its_own_tools(family):
    """toolcall's tasks each offer their own tools (TOOLS is empty): a task's prompt shows its
    tools and no other task's, and its episode starts from exactly that prompt.
    """
    from stages.generation import tool_parsers

    name, tok, model = family
    env = contract.load("toolcall", "stages.envs.toolcall", REPO)
    by_tools = {}
    for task in contract.load_tasks(REPO / "data/tasks/toolcall.jsonl", env):
        by_tools.setdefault(json.dumps(task["tools"], sort_keys=True), task)
    tasks = list(by_tools.values())[:4]
    assert len(tasks) == 4
    template = chat.Template.of(tok, list(env.tools), chat.end_ids(model, tok))
    everything = {t["function"]["name"] for task in tasks for t in task["tools"]}
    for task in tasks:
        text = tok.decode(template.for_task(task).prompt(task["messages"]))
        offered = {t["function"]["name"] for t in task["tools"]}
        assert all(f'"name": "{n}"' in text for n in offered), (name, text)
        assert not any(f'"name": "{n}"' in text for n in everything - offered), (name, text)
    # Llama 3.1's template writes each tool schema indented: with the test's small BPE vocabulary
    # some of those prompts outgrow the model's 2048 positions; the shorter ones are played
    tasks = [t for t in tasks if len(template.for_task(t).prompt(t["messages"])) < 1900]
    assert len(tasks) >= 2, name
    episodes = chat.rollout(model, tok, env, tasks, parser=tool_parsers.detect(tok.chat_template),
                            temperature=1.0, max_new_tokens=12, max_turns=1,
                            generator=torch.Generator().manual_seed(0), template=template)
    for task, episode in zip(tasks, episodes):
        prompt = template.for_task(task).prompt(task["messages"])
        assert episode.token_ids[:len(prompt)] == prompt
        assert episode.model_mask[:len(prompt)] == [0] * len(prompt) and any(episode.model_mask)


@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_a_mistral_turn_with_a_tool_call_is_answered_under_ids_its_template_takes(family, support,
                                                                                tasks):
    """Mistral's template refuses any tool-call id but nine letters and digits: offseason's own
    (`call_0`) and OpenAI's (`call_` + 24) crashed the rollout at the first call and made every
    logged trace unusable for training.
    """
    name, tok, model = family
    template = chat.Template.of(tok, list(support.tools), chat.end_ids(model, tok))
    game = chat._Play(template, support, [tasks[0]], "mistral", max_turns=3)
    turn = '[TOOL_CALLS] [{"name": "lookup_order", "arguments": {"order_id": "A1001"}}]</s>'
    injected = tok.decode(game.on_turn_end(0, _turn(tok, turn)))
    assert injected.startswith('[TOOL_RESULTS] {"content": ') and "delivered" in injected
    assert injected.endswith('"call_id": "call00000"}[/TOOL_RESULTS]')
    # a trace logged by the OpenAI SDK, ids and all, encodes
    messages = two_calls(support)
    for message in messages:
        for c in message.get("tool_calls") or []:
            c["id"] = "call_" + "aB3" * 8
        if message["role"] == "tool":
            message["tool_call_id"] = "call_" + "aB3" * 8
    ids, mask = chat.encode(template, messages)
    assert sum(mask) and '"call_id": "call00000"' in tok.decode(ids)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_a_turn_its_own_template_refuses_ends_the_episode_not_the_stage(family, support, tasks):
    """Llama 3.1's template takes one tool call a message; a policy that makes two in one turn
    (the llama3_json parser reads `;`-separated calls) crashed the rollout stage."""
    name, tok, model = family
    template = chat.Template.of(tok, list(support.tools), chat.end_ids(model, tok))
    game = chat._Play(template, support, [tasks[0]], "llama3_json", max_turns=3)
    turn = ('<|python_tag|>{"name": "lookup_order", "parameters": {"order_id": "A1001"}}; '
            '{"name": "lookup_order", "parameters": {"order_id": "A1002"}}<|eom_id|>')
    assert game.on_turn_end(0, _turn(tok, turn)) == "template"
    episode = game.episodes[0]
    assert "only supports single tool-calls" in episode.template_error
    assert episode.error is None and episode.tool_calls == 2
