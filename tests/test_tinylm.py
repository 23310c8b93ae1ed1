import random

import pytest
import torch

from stages import tinylm
from stages.envs import arith
from stages.generation import transformers_backend
from stages.training import batches, warmstart
from stages.training.batches import encode_completion
from stages.training.warmstart import demonstrations

# one xdist worker runs this module: its module-scoped fixture is built once
pytestmark = pytest.mark.xdist_group("tinylm")


@pytest.fixture(scope="module")
def trained():
    """A very small model that has seen tool demonstrations, so it calls the tool."""
    tokenizer = tinylm.build_tokenizer(arith)
    model = tinylm.build_model(tokenizer, n_layer=1, n_embd=32, n_head=2, n_positions=64, seed=0)
    warmstart.train(model, demonstrations(tokenizer, arith, random.Random(0), 1.0, 32), steps=60,
              lr=1e-2, tokenizer=tokenizer, seed=0)
    return model, tokenizer


def test_tokenizer_tags_are_single_tokens():
    tokenizer = tinylm.build_tokenizer(arith)
    text = "Q:47*38<calc>47*38</calc><result>1786</result>answer:1786"
    tokens = tokenizer.tokenize(text)
    assert "<calc>" in tokens and "answer:" in tokens and len(tokens) == 24
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_saved_folder_is_standard_hf(tmp_path, trained):
    model, tokenizer = trained
    tinylm.save(model, tokenizer, tmp_path / "m")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "m" / name).exists()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert loaded.config.model_type == "gpt2"
    assert AutoTokenizer.from_pretrained(tmp_path / "m").encode("Q:1+2") == \
        tokenizer.encode("Q:1+2")
    assert sum(p.numel() for p in loaded.parameters()) < 5_000_000


def test_load_names_a_broken_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        tinylm.load(tmp_path)


def test_encode_completion_masks_tool_results():
    tokenizer = tinylm.build_tokenizer(arith)
    ids, mask = encode_completion(tokenizer, arith, "Q:2*3",
                                  "<calc>2*3</calc><result>6</result>answer:6")
    tokens = tokenizer.convert_ids_to_tokens(ids)
    chosen = [t for t, m in zip(tokens, mask) if m]
    assert chosen == ["<calc>", "2", "*", "3", "</calc>", "answer:", "6"]


def test_generation_injects_tool_results_and_is_seeded(trained):
    model, tokenizer = trained
    prompts = [arith.prompt(q) for q in ["12*34", "5+6", "300-7", "8*9"]] * 8
    run = lambda seed: transformers_backend.generate(model, tokenizer, arith, prompts, temperature=1.0,  # noqa
                                         max_new_tokens=40, seed=seed, batch_size=16,
                                         progress=False)
    episodes = run(3)
    assert [e.completion for e in episodes] == [e.completion for e in run(3)]
    assert [e.completion for e in episodes] != [e.completion for e in run(4)]
    with_tool = [e for e in episodes if e.tool_calls]
    assert with_tool, "a model trained only on tool demonstrations should call the tool"
    close = tokenizer.convert_tokens_to_ids("</calc>")
    result_open = tokenizer.convert_tokens_to_ids("<result>")
    for episode in episodes:
        assert len(episode.token_ids) == len(episode.model_mask) == len(episode.logprobs)
        assert all(lp <= 0 for lp, m in zip(episode.logprobs, episode.model_mask) if m)
        for i, token in enumerate(episode.token_ids[:-1]):
            if token == close and episode.model_mask[i]:
                # the environment's reply follows, forced (mask 0), with the calculator's value
                assert episode.token_ids[i + 1] == result_open
                assert episode.model_mask[i + 1] == 0
    checked = 0
    for episode in with_tool:  # each forced run after the prompt is the environment's answer
        ids, mask = episode.token_ids, episode.model_mask
        start = mask.index(1)
        for i in range(start, len(ids)):
            if mask[i] == 0 and mask[i - 1] == 1:
                end = next((j for j in range(i, len(ids)) if mask[j]), len(ids))
                before = tokenizer.decode(ids[start:i])
                assert tokenizer.decode(ids[i:end]) == arith.on_tool_close(before)
                checked += 1
    assert checked


def test_greedy_is_deterministic(trained):
    model, tokenizer = trained
    prompts = [arith.prompt("12*34")] * 3
    episodes = transformers_backend.generate(model, tokenizer, arith, prompts, temperature=0.0,
                                 max_new_tokens=40, seed=0, batch_size=8, progress=False)
    assert len({e.completion for e in episodes}) == 1


def test_sft_loss_goes_down():
    tokenizer = tinylm.build_tokenizer(arith)
    model = tinylm.build_model(tokenizer, n_layer=1, n_embd=32, n_head=2, n_positions=64, seed=0)
    examples = [dict(zip(("token_ids", "model_mask"),
                         encode_completion(tokenizer, arith, arith.prompt(q), arith.demonstration(q, True))))
                for q in ["1+2", "3*4", "10-5", "7*8"]]
    batch = batches.collate(examples[:2], tokenizer.bos_token_id, tokenizer.eos_token_id,
                        tokenizer.pad_token_id)
    inputs, attention, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    with torch.no_grad():
        before = float(model(input_ids=inputs, attention_mask=attention, labels=labels).loss)
    warmstart.train(model, warmstart.epoch_batches(examples, 4, 0), steps=30, lr=1e-2, tokenizer=tokenizer,
              seed=0)
    with torch.no_grad():
        after = float(model(input_ids=inputs, attention_mask=attention, labels=labels).loss)
    assert after < before * 0.7


def test_the_demo_chat_tokenizer_renders_hermes_calls_in_single_tokens(tmp_path):
    from stages.envs import contract
    from stages.generation import chat, tool_parsers

    tokenizer = tinylm.build_tokenizer(arith, chat=True)
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


def test_chat_warm_start_rows_are_chat_conversations():
    from stages.generation import chat

    tokenizer = tinylm.build_tokenizer(arith, chat=True)
    template = chat.Template.of(tokenizer, list(arith.TOOLS), (tokenizer.eos_token_id,))
    batch = next(warmstart.chat_demonstrations(template, arith, random.Random(0), 0.5, 64))
    assert all(row["chat"] for row in batch)
    tool = [row for row in batch if tinylm.CHAT_TAGS.index("<tool_call>") + 4 in row["token_ids"]]
    assert 10 < len(tool) < 54  # about half call the calculator
    for row in batch:  # the loss only on the model's own tokens, each turn ending at <eos>
        own = [t for t, m in zip(row["token_ids"], row["model_mask"]) if m]
        assert own[-1] == tokenizer.eos_token_id
        assert tokenizer.convert_tokens_to_ids("<tool_response>") not in own


def test_chat_episodes_at_the_context_limit_fit_every_collator():
    """A chat episode as long as the model's positions (one cut off at the limit) is trained on
    by SFT and GRPO: no padding column past the position embeddings (found by GRPO on the demo).
    """
    from stages.training import grpo

    tokenizer = tinylm.build_tokenizer(arith, chat=True)
    model = tinylm.build_model(tokenizer, n_layer=1, n_embd=32, n_head=2, n_positions=24, seed=0)
    digits = tokenizer.convert_tokens_to_ids(list("123456789"))
    full = {"token_ids": [digits[i % 9] for i in range(24)], "model_mask": [0] * 4 + [1] * 20,
            "logprobs": [0.0] * 24, "chat": True, "advantage": 1.0}
    short = {**full, "token_ids": full["token_ids"][:10], "model_mask": full["model_mask"][:10],
             "logprobs": [0.0] * 10}
    batch = batches.collate([full, short], tokenizer.bos_token_id, tokenizer.eos_token_id,
                        tokenizer.pad_token_id)
    assert batch["input_ids"].shape == (2, 24)
    assert model(**batch).loss.isfinite()
    batch = grpo.collate(tokenizer.bos_token_id, tokenizer.pad_token_id)([full, short])
    assert batch["input_ids"].shape == (2, 24)
    assert grpo.token_logprobs(model, batch["input_ids"], batch["attention_mask"]).shape == (2, 23)
