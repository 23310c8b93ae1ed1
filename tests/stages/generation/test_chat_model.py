"""The offline chat models of tests/chat_model.py: a Qwen2 folder that loads, renders tools and tool
turns as Qwen2.5 does, renders conversations prefix-preservingly, generates, and whose rendered tool
calls the hermes parser reads back; and the same, more briefly, for the Llama 3.1 family.
"""

import json

import pytest
import torch
from chat_model import (
    ADD_TOOL,
    LLAMA31_TEMPLATE,
    QWEN25_TEMPLATE,
    WEATHER_TOOL,
    build,
    train_tokenizer,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from stages.generation.tool_parsers import detect, parse


def call(name: str, arguments: dict, i: int = 0) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


# A multi-turn conversation with two tool calls, one per assistant turn. Arguments are dicts: what
# Qwen2.5's template expects (see test_string_arguments_are_double_encoded).
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather like in Paris today?"},
    {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": "Paris"})]},
    {"role": "tool", "tool_call_id": "call_0", "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    {"role": "assistant", "content": "Let me check that for you.",
     "tool_calls": [call("add", {"a": 21, "b": 1.5})]},
    {"role": "tool", "tool_call_id": "call_0", "content": "22.5"},
    {"role": "assistant", "content": "It is sunny and 22.5 degrees in Paris."},
    {"role": "user", "content": "Thank you!"},
    {"role": "assistant", "content": "Sure, I can help with that."},
]
TOOLS = [WEATHER_TOOL, ADD_TOOL]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build(tmp_path_factory.mktemp("chat_model"))


@pytest.fixture(scope="module")
def tok(folder):
    return AutoTokenizer.from_pretrained(folder)


def render(tok, messages, **kwargs) -> str:
    return tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, **kwargs)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_folder_loads_as_a_qwen2_chat_model(folder, tok):
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert model.config.model_type == "qwen2"
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.num_attention_heads,
            model.config.num_key_value_heads, model.config.intermediate_size) == (2, 64, 4, 2, 128)
    assert model.config.vocab_size == len(tok)
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert model.generation_config.eos_token_id == tok.eos_token_id
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"):
        assert len(ids(tok, token)) == 1, token
    assert "<tool_call>" not in tok.all_special_tokens  # as in Qwen2.5: kept by skip_special_tokens
    assert tok.chat_template == QWEN25_TEMPLATE
    assert detect(tok.chat_template) == "hermes"
    # what loads (transformers' Qwen2Tokenizer) tokenizes as what was trained
    text = 'Hello world 1234 {"name": "get_weather", "arguments": {"city": "Paris"}}\n  x\n\n y café'
    assert ids(tok, text) == train_tokenizer().encode(text).ids
    assert tok.decode(ids(tok, text)) == text


def test_build_is_deterministic(folder, tmp_path):
    again = build(tmp_path / "again")
    for name in ("tokenizer.json", "config.json", "chat_template.jinja"):
        assert (again / name).read_text() == (folder / name).read_text(), name
    assert (again / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


def test_template_renders_tools_calls_and_responses(tok):
    messages = CONVERSATION[1:4]  # user, assistant tool call, tool response (no system: the default)
    text = render(tok, messages, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n" + json.dumps(ADD_TOOL) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            "\n</tool_call><|im_end|>\n") in text
    assert ('<|im_start|>user\n<tool_response>\n{"temperature": 21, "sky": "sunny"}\n</tool_response>'
            "<|im_end|>\n") in text
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # with a system message, it heads the tool list instead of the default
    assert render(tok, CONVERSATION[:2]).startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")


def test_rendering_is_prefix_preserving(tok):
    for k in range(1, len(CONVERSATION)):
        shorter, longer = render(tok, CONVERSATION[:k]), render(tok, CONVERSATION[: k + 1])
        assert longer.startswith(shorter), k
        assert ids(tok, longer)[: len(ids(tok, shorter))] == ids(tok, shorter), k
        if CONVERSATION[k]["role"] == "assistant":  # the prompt a rollout generates from
            prompt = render(tok, CONVERSATION[:k], add_generation_prompt=True)
            assert longer.startswith(prompt), k
            assert ids(tok, longer)[: len(ids(tok, prompt))] == ids(tok, prompt), k
    # apply_chat_template's own tokenization is the same (in transformers 5 it returns a BatchEncoding)
    encoded = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True)
    assert list(encoded["input_ids"]) == ids(tok, render(tok, CONVERSATION))


def test_parallel_tool_responses_are_prefix_preserving_only_per_turn(tok):
    """Qwen2.5's quirk: consecutive tool messages share one user turn, closed after the last one."""
    messages = [CONVERSATION[1],
                {"role": "assistant", "content": None,
                 "tool_calls": [call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "Tokyo"}, 1)]},
                {"role": "tool", "tool_call_id": "call_0", "content": "21"},
                {"role": "tool", "tool_call_id": "call_1", "content": "12"}]
    one, both = render(tok, messages[:3]), render(tok, messages)
    assert not both.startswith(one)  # one response rendered alone is closed with <|im_end|>
    assert both.startswith(one.removesuffix("<|im_end|>\n"))
    assert both.endswith("<tool_response>\n21\n</tool_response>\n<tool_response>\n12\n</tool_response><|im_end|>\n")


def test_generate(folder, tok):
    model = AutoModelForCausalLM.from_pretrained(folder)
    prompt = tok(render(tok, CONVERSATION[:2], add_generation_prompt=True), return_tensors="pt",
                 add_special_tokens=False)
    torch.manual_seed(0)
    out = model.generate(**prompt, max_new_tokens=6, min_new_tokens=6, do_sample=True)
    assert out.shape == (1, prompt["input_ids"].shape[1] + 6)
    assert int(out.max()) < len(tok)
    assert isinstance(tok.decode(out[0, prompt["input_ids"].shape[1]:]), str)


@pytest.mark.parametrize("k", [2, 4])
def test_hermes_parses_what_the_template_renders(tok, k):
    """messages -> the template's text of the assistant turn -> parse -> the same calls."""
    assistant = CONVERSATION[k]
    prompt = render(tok, CONVERSATION[:k], add_generation_prompt=True)
    turn = render(tok, CONVERSATION[: k + 1]).removeprefix(prompt)
    assert turn.endswith("</tool_call><|im_end|>\n")
    # as the rollout will see it: the generated token ids, decoded keeping special tokens
    completion = tok.decode(ids(tok, turn))
    for text in (turn, completion, tok.decode(ids(tok, turn), skip_special_tokens=True)):
        parsed = parse("hermes", text)
        assert parsed.errors == []
        assert parsed.content == assistant["content"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in assistant["tool_calls"]]


def test_round_trip_of_several_calls_in_one_turn(tok):
    assistant = {"role": "assistant", "content": "Two lookups.",
                 "tool_calls": [call("get_weather", {"city": "Paris", "unit": "celsius"}),
                                call("add", {"a": -7, "b": 10}, 1)]}
    prompt = render(tok, CONVERSATION[:2], add_generation_prompt=True)
    turn = render(tok, CONVERSATION[:2] + [assistant]).removeprefix(prompt)
    parsed = parse("hermes", turn)
    assert parsed.content == "Two lookups." and parsed.errors == []
    assert [c["id"] for c in parsed.tool_calls] == ["call_0", "call_1"]
    # the parsed calls, arguments turned back into dicts, render the same turn again
    again = {"role": "assistant", "content": parsed.content,
             "tool_calls": [call(c["function"]["name"], json.loads(c["function"]["arguments"]), i)
                            for i, c in enumerate(parsed.tool_calls)]}
    assert render(tok, CONVERSATION[:2] + [again]) == prompt + turn


def test_string_arguments_are_double_encoded(tok):
    """OpenAI messages carry arguments as a JSON string; Qwen2.5's `| tojson` encodes it again.
    The wiring must json.loads them before rendering (vLLM does the same)."""
    as_string = {"role": "assistant", "content": None,
                 "tool_calls": [call("get_weather", json.dumps({"city": "Paris"}))]}
    text = render(tok, CONVERSATION[:2] + [as_string])
    assert '"arguments": "{\\"city\\": \\"Paris\\"}"}' in text
    parsed = parse("hermes", text.split("<|im_start|>assistant\n")[-1])  # still read back
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}


# --- the llama family -----------------------------------------------------------------------

LLAMA_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather like in Paris today?"},
    {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": "Paris"})]},
    {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21"},
    {"role": "assistant", "content": None, "tool_calls": [call("add", {"a": 21, "b": 1.5})]},
    {"role": "tool", "tool_call_id": "call_0", "content": "22.5"},
    {"role": "assistant", "content": "It is sunny and 22.5 degrees in Paris."},
]


def test_llama_family(tmp_path):
    folder = build(tmp_path / "llama", "llama")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tok)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>")
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids(["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"])
    for token in ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"):
        assert len(ids(tok, token)) == 1, token
    assert tok.chat_template == LLAMA31_TEMPLATE and detect(tok.chat_template) == "llama3_json"

    text = render(tok, LLAMA_CONVERSATION)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
    assert json.dumps(WEATHER_TOOL, indent=4) in text  # in the first user message
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
            "<|eot_id|>") in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "sunny, 21"}<|eot_id|>' in text
    # prefix-preserving from the first user message on (the tools live in it)
    for k in range(2, len(LLAMA_CONVERSATION)):
        shorter, longer = render(tok, LLAMA_CONVERSATION[:k]), render(tok, LLAMA_CONVERSATION[: k + 1])
        assert longer.startswith(shorter) and ids(tok, longer)[: len(ids(tok, shorter))] == ids(tok, shorter), k
        if LLAMA_CONVERSATION[k]["role"] == "assistant":
            prompt = render(tok, LLAMA_CONVERSATION[:k], add_generation_prompt=True)
            assert ids(tok, longer)[: len(ids(tok, prompt))] == ids(tok, prompt), k
            turn = longer.removeprefix(prompt)
            parsed = parse("llama3_json", turn)
            expected = LLAMA_CONVERSATION[k]
            assert parsed.errors == [] and parsed.content == expected["content"]
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in expected.get("tool_calls", [])]

    prompt = tok(render(tok, LLAMA_CONVERSATION[:2], add_generation_prompt=True), return_tensors="pt",
                 add_special_tokens=False)
    out = model.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, prompt["input_ids"].shape[1] + 4)


@pytest.mark.parametrize("family", ["qwen3", "hermes3"])
def test_qwen3_and_hermes3_families(tmp_path, family):
    """Qwen3 (its own config class, `<think>` and tool tags) and Hermes 3 (a Llama 3.1 with
    ChatML turns): their tokens, end ids and real templates, which render a tool call the hermes
    parser reads back.
    """
    from chat_model import HERMES3_TEMPLATE, QWEN3_TEMPLATE

    folder = build(tmp_path / family, family)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    qwen3 = family == "qwen3"
    assert model.config.model_type == ("qwen3" if qwen3 else "llama")
    assert model.config.vocab_size == len(tok) and tok.eos_token == "<|im_end|>"
    assert tok.bos_token == (None if qwen3 else "<|begin_of_text|>")
    stops = ["<|im_end|>", "<|endoftext|>" if qwen3 else "<|end_of_text|>"]
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids(stops)
    tags = ["<think>", "</think>"] if qwen3 else ["<tools>", "</tools>"]
    for token in ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", *tags]:
        assert len(ids(tok, token)) == 1, token
    assert tok.chat_template == (QWEN3_TEMPLATE if qwen3 else HERMES3_TEMPLATE)
    assert detect(tok.chat_template) == "hermes"
    talk = [{**m, "content": m["content"] or ""} for m in CONVERSATION]  # Qwen3's takes no None
    text = render(tok, talk[:3])
    turn = text[text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parse("hermes", turn).tool_calls] == [("get_weather", {"city": "Paris"})]
    prompt = tok(render(tok, talk[:2], add_generation_prompt=True), return_tensors="pt",
                 add_special_tokens=False)
    out = model.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, prompt["input_ids"].shape[1] + 4)
