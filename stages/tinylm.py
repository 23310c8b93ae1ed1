"""The demo's tiny causal LM and its tokenizer, both built in code, saved in Hugging Face format.

No model hub is reachable, so generation 0 of the demo is a GPT-2 built from a config (a Llama-style
model of the same size never learned to copy into and out of the tool; see DEMO-NOTES) with a
character-level tokenizer whose environment tags are single tokens. `save()` writes config.json,
model.safetensors and the tokenizer files, so transformers or vLLM load the folder unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
)

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def build_tokenizer(env) -> PreTrainedTokenizerFast:
    """A character tokenizer over the environment's alphabet, with each tag a single token."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(env.TAGS) + list(env.CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_tokens(list(env.TAGS))  # matched before the character split
    core.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        unk_token="<unk>", model_max_length=512,
    )
    return tokenizer


def build_model(tokenizer, n_layer: int, n_embd: int, n_head: int, n_positions: int, seed: int):
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM",
    )
    return GPT2LMHeadModel(config)


def load(path: str | Path):
    """Model and tokenizer from a Hugging Face folder; names the folder when it is not one."""
    path = Path(path)
    missing = [name for name in ("config.json", "tokenizer.json") if not (path / name).exists()]
    if missing:
        raise FileNotFoundError(
            f"{path} is not a Hugging Face model folder (missing {', '.join(missing)}); "
            f"run `offseason init` to create generation 0"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, tokenizer


def save(model, tokenizer, path: str | Path, card: dict | None = None) -> None:
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
    quiet()
    if threads:
        torch.set_num_threads(threads)
