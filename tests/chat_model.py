"""A real chat-model family, built offline in seconds: `build(folder)` writes a Hugging Face model
folder (random-initialised Qwen2 weights, a byte-level BPE tokenizer trained here, Qwen2.5's chat
template with tools) that `AutoModelForCausalLM` / `AutoTokenizer` load like any hub model;
`build(folder, "llama")` the same with Llama weights, Llama 3's special tokens and Llama 3.1's JSON
tool template; `build(folder, "mistral")` with Mistral weights, Mistral v0.3's control tokens and its
official tool template (tests/fixtures/templates/mistral_official.jinja: `[TOOL_CALLS]`, ids of nine
letters and digits); `build(folder, "qwen3")` with Qwen3 weights, its `<think>` and tool tags and
Qwen3-0.6B's template; `build(folder, "hermes3")` with Llama weights, Llama 3's and ChatML's special
tokens and Hermes 3's tool-use template; `build(folder, family, template)` with another template
(the real ones of tests/fixtures/templates/). `build_support_agent(folder)`: the Qwen2 one after a
few seconds of SFT on the support example's gold conversations (conftest's session-wide
`chat_champion_once`).

Not a test file: tests import it (`from chat_model import build`).
"""
# ruff: noqa: E501  (the chat template is verbatim)

from __future__ import annotations

import json
from pathlib import Path

# Qwen2.5-Instruct's chat template (tokenizer_config.json of Qwen/Qwen2.5-*-Instruct), verbatim.
# Its quirks are the real model's: `tool_call.arguments | tojson` expects a dict (an OpenAI JSON
# string comes out double-encoded), and consecutive `tool` messages share one user turn whose
# <|im_end|> is written only after the last of them.
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen2's pre-tokenizer split: words, single digits, punctuation runs, newlines, spaces
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen2.5's ids 151643-151645, in order
TOOL_TAGS = ["<tool_call>", "</tool_call>"]  # added, not special, as in Qwen2.5 (151657-151658)

# Llama 3.1's JSON tool-calling template (vLLM's examples/tool_chat_template_llama3.1_json.jinja,
# Meta's template with custom tools in the first user message), verbatim but for the date, fixed
# as in Meta's Llama 3.1 template. Its quirks: the tools go into the first user message (so a
# conversation renders from its first user message on), contents are trimmed, one tool call per
# assistant message, and a tool result is rendered as {"output": content} in an ipython turn.
LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {#- Llama 3.1 doesn't pass all tests if the tools are in the system prompt #}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- if messages[0]['content'] is string %}
        {%- set system_message = messages[0]['content']|trim %}
    {%- else %}
        {%- set system_message = messages[0]['content'][0]['text']|trim %}
    {%- endif %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- if tools is not none %}
        {%- set system_message = "You are a helpful assistant with tool calling capabilities. Only reply with a tool call if the function exists in the library provided by the user. If it doesn't exist, just reply directly in natural language. When you receive a tool call response, use the output to format an answer to the original user question." %}
    {%- else %}
        {%- set system_message = "" %}
    {%- endif %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call. " }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. ' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- if messages[0]['content'] is string %}
            {%- set first_user_message = messages[0]['content']|trim %}
        {%- else %}
            {%- set first_user_message = messages[0]['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | map('trim') | join('\\n') %}
        {%- endif %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. ' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {%- if message['content'] is string %}
            {{- message['content'] | trim}}
        {%- else %}
            {%- for content in message['content'] %}
                {%- if content['type'] == 'text' %}
                    {{- content['text'] | trim }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if message.tool_calls|length > 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- elif message.tool_calls|length == 0 %}
            {{- "No tool calls found." }}
        {%- else %}
            {%- set tool_call = message.tool_calls[0].function %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name|trim + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is string %}
            {{- { "output": message.content } | tojson }}
        {%- else %}
            {%- for content in message['content']  %}
                {%- if content['type']  == 'text' %}
                    {{- { "output": content['text']  } | tojson }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
# Mistral-7B-Instruct-v0.3's control tokens, ids 0-9 in this order
MISTRAL_SPECIAL = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                   "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
# its chat template (tokenizer_config.json of mistralai/Mistral-7B-Instruct-v0.3), as vLLM's
# examples/tool_chat_template_mistral_official.jinja publishes it (the fixture's README)
TEMPLATES = Path(__file__).parent / "fixtures" / "templates"  # real templates, verbatim (README there)
MISTRAL_TEMPLATE = (TEMPLATES / "mistral_official.jinja").read_text()
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]  # all special in Llama 3
# Qwen3's tags: added, not special (151657-151668), so they stay in decoded text
QWEN3_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# Qwen3-0.6B's chat template (llama.cpp's copy of its tokenizer_config.json's, the README there)
QWEN3_TEMPLATE = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
# Hermes 3 is Llama 3.1 with ChatML turns (<|im_start|>, <|im_end|>) and Hermes' tool tags
HERMES3_SPECIAL = LLAMA_SPECIAL + ["<|im_start|>", "<|im_end|>"]
HERMES3_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"]
HERMES3_TEMPLATE = (TEMPLATES / "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja").read_text()
FAMILIES = ("qwen2", "llama", "mistral", "qwen3", "hermes3")

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}


def corpus(family: str = "qwen2") -> list[str]:
    """A small training text: chat turns (in `family`'s format), JSON tool calls and responses,
    numbers, English."""
    english = [
        "You are a helpful assistant.", "What is the weather like in Paris today?",
        "It is sunny and 21 degrees in Paris.", "Please add these two numbers for me.",
        "The answer is 42.", "Let me check that for you.", "Thank you, that was helpful!",
        "The quick brown fox jumps over the lazy dog.", "I could not find that city.",
        "Here is the result of the calculation.", "Sure, I can help with that.",
    ]
    numbers = [" ".join(str(n) for n in range(start, start + 12)) for start in (0, 17, 100, 1234)]
    numbers += ["3.14 2.5 -7 1e3 0.001 98.6 1,000,000", "2 + 2 = 4, 12 * 12 = 144, 7 - 10 = -3"]
    calls = [{"name": "get_weather", "arguments": {"city": city, "unit": unit}}
             for city in ("Paris", "London", "Tokyo", "New York") for unit in ("celsius", "fahrenheit")]
    calls += [{"name": "add", "arguments": {"a": a, "b": b}} for a, b in ((1, 2), (3.5, 4), (40, 2), (-7, 10))]
    result = json.dumps({"temperature": 21, "sky": "sunny"})
    tools = json.dumps(WEATHER_TOOL) + "\n" + json.dumps(ADD_TOOL)
    chat = []
    if family == "mistral":
        for n, call in enumerate(calls):
            chat.append("[TOOL_CALLS] [" + json.dumps({**call, "id": f"a{n}b2c3d4e"}) + "]</s>")
            chat.append('[TOOL_RESULTS] {"content": ' + result + f', "call_id": "a{n}b2c3d4e"}}[/TOOL_RESULTS]')
        chat.append("[AVAILABLE_TOOLS] [" + tools.replace("\n", ", ") + "][/AVAILABLE_TOOLS]")
        chat += [f"[INST] {line}[/INST] {line}</s>" for line in english]
        return english + numbers + chat
    if family == "llama":
        def turn(role, text):
            return f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>"
        for call in calls:
            chat.append(turn("assistant", json.dumps({"name": call["name"], "parameters": call["arguments"]})))
            chat.append(turn("ipython", json.dumps({"output": result})))
        chat.append(turn("system", "Environment: ipython\nCutting Knowledge Date: December 2023\n"))
        chat.append(turn("user", 'Respond in the format {"name": function name, "parameters": dictionary of '
                                 "argument name and its value}. Do not use variables.\n\n" + tools))
    else:
        def turn(role, text):
            return f"<|im_start|>{role}\n{text}<|im_end|>\n"
        for call in calls:
            chat.append(turn("assistant", "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"))
            chat.append(turn("user", "<tool_response>\n" + result + "\n</tool_response>"))
        chat.append(turn("system", "# Tools\n\nYou may call one or more functions to assist with the user "
                                   "query.\n<tools>\n" + tools + "\n</tools>"))
    chat += [turn(role, line) for line in english for role in ("user", "assistant")]
    if family == "qwen3":
        chat += [turn("assistant", f"<think>\n{a}\n</think>\n\n{b}") for a, b in zip(english, english[1:])]
    return english + numbers + chat


def train_tokenizer(family: str = "qwen2", vocab_size: int = 1024):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `corpus(family)`, with the family's
    special tokens (and, for Qwen and Hermes, their tags as added tokens)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    # Qwen2's own pipeline: transformers' Qwen2Tokenizer (what AutoTokenizer gives for a qwen2
    # folder) rebuilds exactly this around the saved vocabulary, so what we train is what loads.
    # (Llama 3's split differs a little, digits in threes; a llama folder loads as saved.)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    special = {"llama": LLAMA_SPECIAL, "mistral": MISTRAL_SPECIAL, "hermes3": HERMES3_SPECIAL}.get(family, SPECIAL)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(family), trainer=trainer)
    tags = {"qwen2": TOOL_TAGS, "qwen3": QWEN3_TAGS, "hermes3": HERMES3_TAGS}.get(family, [])
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in tags])
    return tokenizer


def build(folder: Path, family: str = "qwen2", template: str | None = None, heads: int = 4
          ) -> Path:
    """Write a loadable chat-model folder for `family` into `folder`, and return it; `template`:
    another chat template than the family's (a real one of tests/fixtures/templates); `heads`:
    attention heads (2 gives a head size of 32, the least vLLM's CPU attention serves).

    Random weights (seeded: the same folder every time), 2 layers, hidden size 64, 4 attention
    heads over 2 key-value heads, MLP width 128, vocabulary the trained tokenizer's size.
    "qwen2": `Qwen2Config`, eos `<|im_end|>`, pad `<|endoftext|>`, Qwen2.5's chat template
    (`QWEN25_TEMPLATE`, tool calls in `<tool_call>` tags: the hermes parser).
    "llama": `LlamaConfig`, bos `<|begin_of_text|>`, eos `<|eot_id|>` (generation also stops at
    `<|eom_id|>` and `<|end_of_text|>`), pad `<|end_of_text|>`, Llama 3.1's JSON tool template
    (`LLAMA31_TEMPLATE`: the llama3_json parser).
    "mistral": `MistralConfig`, bos `<s>`, eos `</s>`, pad `<unk>`, Mistral v0.3's official template
    (`MISTRAL_TEMPLATE`: the mistral parser; it refuses tool-call ids other than nine letters and
    digits, as the real one does).
    "qwen3": `Qwen3Config`, Qwen's tokens and its `<think>` and tool tags (added, not special),
    eos `<|im_end|>` (generation also stops at `<|endoftext|>`), Qwen3-0.6B's template
    (`QWEN3_TEMPLATE`: the hermes parser; it drops earlier turns' empty thinking).
    "hermes3": `LlamaConfig` (Hermes 3 is a Llama 3.1), Llama 3's special tokens plus ChatML's,
    bos `<|begin_of_text|>`, eos `<|im_end|>` (generation also stops at `<|end_of_text|>`),
    Hermes 3's tool-use template (`HERMES3_TEMPLATE`: the hermes parser).
    """
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokens = {"llama": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                        "pad_token": "<|end_of_text|>"},
              "mistral": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>"},
              "hermes3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>",
                          "pad_token": "<|end_of_text|>"},
              }.get(family, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(family), model_max_length=2048,
                                        clean_up_tokenization_spaces=False, **tokens)
    tokenizer.chat_template = template or {
        "llama": LLAMA31_TEMPLATE, "mistral": MISTRAL_TEMPLATE, "qwen3": QWEN3_TEMPLATE,
        "hermes3": HERMES3_TEMPLATE}.get(family, QWEN25_TEMPLATE)
    tokenizer.save_pretrained(folder)
    bos, eos, pad = tokenizer.convert_tokens_to_ids(
        [tokens.get("bos_token", tokens["pad_token"]), tokens["eos_token"], tokens["pad_token"]])
    stops = tokenizer.convert_tokens_to_ids({
        "llama": ["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"], "qwen3": ["<|im_end|>", "<|endoftext|>"],
        "hermes3": ["<|im_end|>", "<|end_of_text|>"]}.get(family, [tokens["eos_token"]]))
    stops = stops if len(stops) > 1 else stops[0]
    Config, Model = {"llama": (LlamaConfig, LlamaForCausalLM), "hermes3": (LlamaConfig, LlamaForCausalLM),
                     "mistral": (MistralConfig, MistralForCausalLM),
                     "qwen3": (Qwen3Config, Qwen3ForCausalLM)}.get(family, (Qwen2Config, Qwen2ForCausalLM))
    config = Config(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                    num_attention_heads=heads, num_key_value_heads=min(2, heads),
                    intermediate_size=128,
                    max_position_embeddings=2048, tie_word_embeddings=True,
                    bos_token_id=bos, eos_token_id=stops, pad_token_id=pad,
                    **({"head_dim": 16} if family == "qwen3" else {}))  # Qwen3's default is 128
    torch.manual_seed(0)
    model = Model(config)
    # What save_pretrained writes, without its detour through accelerate, which imports DeepSpeed
    # (seconds): the config, the generation config, and the weights less the tied output layer.
    config.save_pretrained(folder)
    GenerationConfig(eos_token_id=stops, pad_token_id=pad, bos_token_id=bos).save_pretrained(folder)
    save_weights(model, folder)
    return folder


def save_weights(model, folder: Path) -> None:
    """The model's weights into `folder`/model.safetensors as save_pretrained writes them (less
    the tied output layer), without its detour through accelerate and DeepSpeed.
    """
    from safetensors.torch import save_file

    weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
               if name != "lm_head.weight"}
    save_file(weights, Path(folder) / "model.safetensors", metadata={"format": "pt"})


def changed(folder: Path, out: Path, seed: int):
    """A copy of the model folder `folder` in `out` with every weight moved a little (seeded):
    other weights than the server's, for pushes. Returns (out, the changed model).
    """
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    shutil.copytree(folder, out, dirs_exist_ok=True)
    save_weights(model, Path(out))
    return out, model


def build_support_agent(folder: Path) -> Path:
    """`build(folder)` (Qwen2), then a few seconds of SFT on the support example's gold
    conversations through `chat.encode`: enough that it calls lookup_order in some episodes and
    answers in some. Returns the folder.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.envs import contract
    from stages.generation import chat

    repo = Path(__file__).resolve().parents[1]
    torch.manual_seed(0)
    build(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    support = contract.load("support", "examples.support.support_env", repo)
    tasks = contract.load_tasks(repo / "examples/support/tasks.jsonl", support)
    template = chat.Template.of(tok, list(support.tools), chat.end_ids(model, tok))
    data = [chat.encode(template, t["messages"] + support.gold(t)) for t in tasks[:6]]
    width = max(len(ids) for ids, _ in data)
    inputs = torch.full((len(data), width), tok.pad_token_id)
    labels = torch.full((len(data), width), -100)
    attention = torch.zeros((len(data), width), dtype=torch.long)
    for row, (ids, mask) in enumerate(data):
        inputs[row, :len(ids)], attention[row, :len(ids)] = torch.tensor(ids), 1
        labels[row, :len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(90):
        model(input_ids=inputs, attention_mask=attention, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    save_weights(model, folder)
    return folder
