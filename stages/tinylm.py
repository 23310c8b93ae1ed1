"""The demo's tiny causal LM and its tokenizer, both built in code, saved in Hugging Face format.

No model hub is reachable, so generation 0 of the demo is a GPT-2 built from a config (a Llama-style
model of the same size never learned to copy into and out of the tool; see DEMO-NOTES) with a
character-level tokenizer whose chat tags are single tokens and a chat template of the Hermes shape.
`save()` writes config.json, model.safetensors and the tokenizer files, so transformers or vLLM load
the folder unchanged.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
)

from stages import modelfiles
from stages.modelfiles import ModelFolderError

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]

# The demo's chat protocol (`build_tokenizer`): the roles and Hermes/Qwen2.5's
# tool-call tags, each one token. The template has the Hermes shape (`<tool_call>{"name": ...,
# "arguments": {...}}</tool_call>`, results in `<tool_response>`), so `rollout.tool_parser: auto`
# reads it as `hermes`, as it would a Qwen2.5 model's; it leaves out what a 80-position model has
# no room for (the tool schemas, a system preamble). Every assistant turn ends with <eos>.
CHAT_TAGS = ["<|system|>", "<|user|>", "<|assistant|>", "<tool_call>", "</tool_call>",
             "<tool_response>", "</tool_response>"]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}<|system|>{{ message.content }}"
    "{%- elif message.role == 'user' -%}<|user|>{{ message.content }}"
    "{%- elif message.role == 'assistant' -%}<|assistant|>{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] -%}"
    "<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}</tool_call>"
    "{%- endfor -%}<eos>"
    "{%- elif message.role == 'tool' -%}<tool_response>{{ message.content }}</tool_response>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def build_tokenizer(env) -> PreTrainedTokenizerFast:
    """A character tokenizer over the environment's alphabet (`CHARS`) with the chat protocol:
    `CHAT_TAGS` and the environment's `CHAT_TOKENS` (the fixed parts of its tool calls' JSON, as a
    BPE vocabulary would merge them) each one token, and `CHAT_TEMPLATE`, so the model runs the
    chat path (`stages/generation/chat.py`) as a Hugging Face chat model does.
    """
    tags = CHAT_TAGS + list(env.CHAT_TOKENS)
    vocab = {tok: i for i, tok in enumerate(SPECIALS + tags + list(env.CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_tokens(tags)  # matched before the character split
    core.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        unk_token="<unk>", model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer, n_layer: int, n_embd: int, n_head: int, n_positions: int, seed: int):
    """A freshly initialized GPT-2 of the given shape for the tokenizer."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM",
    )
    return GPT2LMHeadModel(config)


def load_tokenizer(path: str | Path):
    """The tokenizer of a Hugging Face model folder, after checking the folder has its files
    (config.json, tokenizer.json, the weights); ModelFolderError names the file to fix.
    """
    path = Path(path)
    modelfiles.check(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise ModelFolderError(f"{path / 'tokenizer.json'}: the tokenizer cannot be loaded "
                               f"({type(err).__name__}: {err})") from None
    return tokenizer


def load(path: str | Path):
    """Model and tokenizer from a Hugging Face folder; names the file to fix when it is not one.

    Also checks that the weights fit the config (transformers would otherwise fill missing or
    misshapen weights with random values and only warn) and the tokenizer fits the model.
    """
    path = Path(path)
    tokenizer = load_tokenizer(path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           output_loading_info=True)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError, SafetensorError) as err:
        raise ModelFolderError(f"{path}: config.json and model.safetensors cannot be loaded "
                               f"together ({type(err).__name__}: {str(err)[:500]})") from None
    wrong = {kind: sorted(map(str, info[kind]))[:5] for kind in
             ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(kind)}
    if wrong:
        raise ModelFolderError(
            f"{path / 'model.safetensors'} does not match {path / 'config.json'}: "
            + "; ".join(f"{kind.replace('_', ' ')}: {', '.join(keys)}"
                        for kind, keys in wrong.items())
            + ". Restore the folder (`dvc checkout`) or rebuild it with `offseason init --force`")
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise ModelFolderError(
            f"{path / 'tokenizer.json'}: {len(tokenizer)} tokens, more than the "
            f"{model.get_input_embeddings().num_embeddings} embeddings of the model in "
            f"{path / 'model.safetensors'}; the tokenizer belongs to another model")
    model.eval()
    return model, tokenizer


def weights_digest(folder: str | Path) -> str:
    """The SHA-256 of a model folder's weights: of `model.safetensors`, or, for a sharded
    folder (a hub model of billions of parameters), of each shard's name and bytes in order.
    """
    folder = Path(folder)
    single = folder / "model.safetensors"
    if single.exists():
        return hashlib.sha256(single.read_bytes()).hexdigest()
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights; save the model with "
                                f"save_pretrained (safetensors)")
    digest = hashlib.sha256()
    for shard in shards:
        digest.update(shard.name.encode())
        digest.update(shard.read_bytes())
    return digest.hexdigest()


def save(model, tokenizer, path: str | Path, card: dict | None = None) -> None:
    """Save a model and tokenizer to a folder, with an optional model card."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    if card is not None:
        (path / "offseason.json").write_text(json.dumps(card, indent=2, sort_keys=True) + "\n")


def quiet() -> None:
    """Our stages print their own progress; transformers' bars and padding hints are noise there
    (generation feeds no padding into attention: every row advances in lockstep).
    """
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def set_threads(threads: int) -> None:
    """Quiet the libraries and use `threads` torch threads (0: leave the default)."""
    quiet()
    if threads:
        torch.set_num_threads(threads)
