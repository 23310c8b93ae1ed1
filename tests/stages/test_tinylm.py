import json
import random

import pytest
import torch

from stages import config as cfg
from stages import tinylm
from stages.envs import arith, contract
from stages.generation import chat
from stages.training import batches, warmstart

# one xdist worker runs this module: its module-scoped fixture is built once
pytestmark = pytest.mark.xdist_group("tinylm")


def template_of(model, tokenizer):
    return chat.Template.of(tokenizer, list(arith.TOOLS), chat.end_ids(model, tokenizer))


@pytest.fixture(scope="module")
def trained():
    """A very small chat model that has seen tool demonstrations, so it calls the tool."""
    tokenizer = tinylm.build_tokenizer(arith)
    model = tinylm.build_model(tokenizer, n_layer=1, n_embd=32, n_head=2, n_positions=64, seed=0)
    warmstart.train(model, warmstart.demonstrations(template_of(model, tokenizer), arith,
                                                    random.Random(0), 1.0, 32),
                    steps=60, lr=1e-2, tokenizer=tokenizer, seed=0)
    return model, tokenizer


def test_tokenizer_tags_are_single_tokens():
    tokenizer = tinylm.build_tokenizer(arith)
    text = "<|user|>47*38<|assistant|>answer:1786<eos>"
    tokens = tokenizer.tokenize(text)
    assert "<|user|>" in tokens and "answer:" in tokens and len(tokens) == 13
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_saved_folder_is_standard_hf(tmp_path, trained):
    model, tokenizer = trained
    tinylm.save(model, tokenizer, tmp_path / "m")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "m" / name).exists()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert loaded.config.model_type == "gpt2"
    assert AutoTokenizer.from_pretrained(tmp_path / "m").encode("<|user|>1+2") == \
        tokenizer.encode("<|user|>1+2")
    assert sum(p.numel() for p in loaded.parameters()) < 5_000_000


def test_load_names_a_broken_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        tinylm.load(tmp_path)


def test_rollouts_answer_tool_calls_and_are_seeded(trained):
    model, tokenizer = trained
    env = contract.load("arith", "stages.envs.arith")
    tasks = [{"task_id": f"t{i}", **arith.chat_task(q)}
             for i, q in enumerate(["12*34", "5+6", "300-7", "8*9"] * 8)]

    def run(seed):
        return chat.rollout(model, tokenizer, env, tasks, parser="hermes", temperature=1.0,
                            max_new_tokens=40, max_turns=arith.MAX_TURNS,
                            generator=[torch.Generator().manual_seed(seed * 1000 + i)
                                       for i in range(len(tasks))],
                            template=template_of(model, tokenizer))

    episodes = run(3)
    assert [e.token_ids for e in episodes] == [e.token_ids for e in run(3)]
    assert [e.token_ids for e in episodes] != [e.token_ids for e in run(4)]
    with_tool = [e for e in episodes if e.tool_calls]
    assert with_tool, "a model trained only on tool demonstrations should call the tool"
    for episode in episodes:
        assert len(episode.token_ids) == len(episode.model_mask) == len(episode.logprobs)
        assert all(lp <= 0 for lp, m in zip(episode.logprobs, episode.model_mask) if m)
        assert all(lp == 0.0 for lp, m in zip(episode.logprobs, episode.model_mask) if not m)
    for episode in with_tool:  # each call answered by the calculator, forced (not the model's)
        for call, reply in zip(episode.messages, episode.messages[1:]):
            if call.get("tool_calls") and reply["role"] == "tool":
                expression = json.loads(call["tool_calls"][0]["function"]["arguments"])
                assert reply["content"] == arith.call_tool({}, "calculator", expression)
                shown = tokenizer.decode([t for t, m in zip(episode.token_ids,
                                                            episode.model_mask) if not m])
                assert f"<tool_response>{reply['content']}</tool_response>" in shown


def test_greedy_is_deterministic(trained):
    model, tokenizer = trained
    env = contract.load("arith", "stages.envs.arith")
    tasks = [{"task_id": f"t{i}", **arith.chat_task("12*34")} for i in range(3)]
    episodes = chat.greedy(model, tokenizer, env, tasks, cfg.Rollout(max_new_tokens=40), seed=0)
    assert len({json.dumps(e.messages) for e in episodes}) == 1


def test_sft_loss_goes_down():
    tokenizer = tinylm.build_tokenizer(arith)
    model = tinylm.build_model(tokenizer, n_layer=1, n_embd=32, n_head=2, n_positions=64, seed=0)
    template = template_of(model, tokenizer)
    examples = []
    for q in ["1+2", "3*4", "10-5", "7*8"]:
        task = arith.chat_task(q)
        ids, mask = chat.encode(template.for_task(task),
                                task["messages"] + arith.chat_demonstration(q, True))
        examples.append({"token_ids": ids, "model_mask": mask})
    batch = batches.collate(examples[:2], tokenizer.pad_token_id)
    inputs, attention, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    with torch.no_grad():
        before = float(model(input_ids=inputs, attention_mask=attention, labels=labels).loss)
    warmstart.train(model, warmstart.epoch_batches(examples, 4, 0), steps=30, lr=1e-2, tokenizer=tokenizer,
                    seed=0)
    with torch.no_grad():
        after = float(model(input_ids=inputs, attention_mask=attention, labels=labels).loss)
    assert after < before * 0.7


def test_the_demo_chat_tokenizer_renders_hermes_calls_in_single_tokens(tmp_path):
    from stages.generation import tool_parsers

    tokenizer = tinylm.build_tokenizer(arith)
    assert tool_parsers.detect(tokenizer.chat_template) == "hermes"  # auto picks it, as for Qwen
    env = contract.load("arith", "stages.envs.arith")
    template = chat.Template.of(tokenizer, list(env.tools), (tokenizer.eos_token_id,))
    assert template.prefix_preserving
    task = {"task_id": "t", **arith.chat_task("47*38")}
    talk = task["messages"] + arith.gold(task)
    text = template.render(talk, False)
    assert text == ('<|user|>47*38<|assistant|><tool_call>{"name": "calculator", "arguments": '
                    '{"expression": "47*38"}}</tool_call><eos><tool_response>1786'
                    '</tool_response><|assistant|>answer:1786<eos>')
    ids, mask = chat.encode(template, talk)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert "<unk>" not in tokens and len(ids) == 30  # fits the demo's 80 positions
    chosen = "".join(t for t, m in zip(tokens, mask) if m)  # the model's own tokens, only
    assert chosen == ('<tool_call>{"name": "calculator", "arguments": {"expression": "47*38"}}'
                      '</tool_call><eos>answer:1786<eos>')
    # the model's turn parses back into the call the template rendered
    first = tokenizer.decode(ids[mask.index(1):tokens.index("<eos>") + 1])
    parsed = tool_parsers.parse("hermes", template.strip_end(first))
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["calculator"]
    # saved and loaded as any Hugging Face folder, the template comes along
    model = tinylm.build_model(tokenizer, n_layer=1, n_embd=32, n_head=2, n_positions=64, seed=0)
    tinylm.save(model, tokenizer, tmp_path / "m")
    _, loaded = tinylm.load(tmp_path / "m")
    assert loaded.chat_template == tinylm.CHAT_TEMPLATE


def test_warm_start_rows_are_chat_conversations():
    tokenizer = tinylm.build_tokenizer(arith)
    template = chat.Template.of(tokenizer, list(arith.TOOLS), (tokenizer.eos_token_id,))
    batch = next(warmstart.demonstrations(template, arith, random.Random(0), 0.5, 64))
    assert all(tokenizer.decode(row["token_ids"]).startswith("<|user|>") for row in batch)
    tool = [row for row in batch if tinylm.CHAT_TAGS.index("<tool_call>") + 4 in row["token_ids"]]
    assert 10 < len(tool) < 54  # about half call the calculator
    for row in batch:  # the loss only on the model's own tokens, each turn ending at <eos>
        own = [t for t, m in zip(row["token_ids"], row["model_mask"]) if m]
        assert own[-1] == tokenizer.eos_token_id
        assert tokenizer.convert_tokens_to_ids("<tool_response>") not in own


def test_episodes_at_the_context_limit_fit_every_collator():
    """An episode as long as the model's positions (one cut off at the limit) is trained on by
    SFT and GRPO: no padding column past the position embeddings (found by GRPO on the demo).
    """
    from stages.training import grpo

    tokenizer = tinylm.build_tokenizer(arith)
    model = tinylm.build_model(tokenizer, n_layer=1, n_embd=32, n_head=2, n_positions=24, seed=0)
    digits = tokenizer.convert_tokens_to_ids(list("123456789"))
    full = {"token_ids": [digits[i % 9] for i in range(24)], "model_mask": [0] * 4 + [1] * 20,
            "logprobs": [0.0] * 24, "advantage": 1.0}
    short = {**full, "token_ids": full["token_ids"][:10], "model_mask": full["model_mask"][:10],
             "logprobs": [0.0] * 10}
    batch = batches.collate([full, short], tokenizer.pad_token_id)
    assert batch["input_ids"].shape == (2, 24)
    assert batch["labels"][1].tolist() == [-100] * 4 + full["token_ids"][4:10] + [-100] * 14
    assert model(**batch).loss.isfinite()
    batch = grpo.collate(tokenizer.pad_token_id)([full, short])
    assert batch["input_ids"].shape == (2, 24)
    assert grpo.token_logprobs(model, batch["input_ids"], batch["attention_mask"]).shape == (2, 23)
