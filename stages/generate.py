"""The transformers generation backend: batched, seeded, multi-turn episodes with a tool.

Every row of a batch advances exactly one token per step, so one KV cache serves the whole batch
with no padding: prompt tokens and the environment's injected tool results are fed as *forced*
tokens, one per step, while the other rows sample. For each episode we keep the token ids, a mask of
which tokens the model chose itself (training loss and GRPO use only those), and the log-probability
of each chosen token under the policy (temperature 1).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache


@dataclass
class Episode:
    prompt: str
    completion: str = ""
    token_ids: list[int] = field(default_factory=list)  # prompt + completion, without <bos>/<eos>
    model_mask: list[int] = field(default_factory=list)  # 1 where the model chose the token
    logprobs: list[float] = field(default_factory=list)  # policy log-prob; 0.0 where forced
    finish: str = "length"  # "eos" or "length"
    tool_calls: int = 0


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


@torch.inference_mode()
def generate(model, tokenizer, env, prompts: list[str], *, temperature: float, max_new_tokens: int,
             seed: int, batch_size: int, progress: bool = True) -> list[Episode]:
    """One episode per prompt; deterministic for the same prompts, seed and batch size."""
    generator = torch.Generator().manual_seed(seed)
    tool_close = tokenizer.convert_tokens_to_ids(env.TOOL_CLOSE)
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    limit = model.config.n_positions
    episodes, started, done_count = [], time.time(), 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        batch = [Episode(prompt=p) for p in chunk]
        queues = [deque(tokenizer.encode(p, add_special_tokens=False)) for p in chunk]
        prompt_len = [len(q) for q in queues]
        finished = [False] * len(chunk)
        cache = DynamicCache()
        current = torch.full((len(chunk), 1), bos, dtype=torch.long)
        for position in range(1, limit):
            logits = model(input_ids=current, cache=cache, use_cache=True).logits[:, -1, :].float()
            logp = torch.log_softmax(logits, dim=-1)
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            else:
                sampled = logits.argmax(dim=-1)
            chosen_logp = logp.gather(1, sampled[:, None]).squeeze(1).tolist()
            sampled = sampled.tolist()
            nxt = []
            for i, episode in enumerate(batch):
                if finished[i]:
                    nxt.append(pad)
                    continue
                if queues[i]:
                    token = queues[i].popleft()
                    episode.token_ids.append(token)
                    episode.model_mask.append(0)
                    episode.logprobs.append(0.0)
                    nxt.append(token)
                    continue
                token = sampled[i]
                if token == eos or len(episode.token_ids) - prompt_len[i] >= max_new_tokens:
                    finished[i] = True
                    episode.finish = "eos" if token == eos else "length"
                    nxt.append(pad)
                    continue
                episode.token_ids.append(token)
                episode.model_mask.append(1)
                episode.logprobs.append(chosen_logp[i])
                nxt.append(token)
                if token == tool_close:
                    episode.tool_calls += 1
                    text = _text(tokenizer, episode.token_ids[prompt_len[i]:])
                    queues[i].extend(tokenizer.encode(env.on_tool_close(text),
                                                      add_special_tokens=False))
            if all(finished):
                break
            current = torch.tensor(nxt, dtype=torch.long)[:, None]
        for i, episode in enumerate(batch):
            episode.completion = _text(tokenizer, episode.token_ids[prompt_len[i]:])
        episodes.extend(batch)
        done_count += len(chunk)
        if progress:
            rate = done_count / max(time.time() - started, 1e-9)
            print(f"generate: {done_count}/{len(prompts)} episodes ({rate:.0f}/s)",
                  file=sys.stderr, flush=True)
    return episodes
