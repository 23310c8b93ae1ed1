"""The transformers generation backend: batched, seeded, multi-turn generation on token ids.

Every row of a batch advances exactly one token per step, so one KV cache serves the whole batch
with no padding: the first pass feeds the length of the shortest prefix at once, then the rest of
the prefixes and the tool results a turn's end is answered with are fed as *forced* tokens, one per
step, while the other rows sample. Rows that ended are dropped from the batch (and its KV cache)
once they are half of it, instead of being fed padding until the longest episode ends. For each
row we keep the token ids, a mask of which tokens the model chose itself (training loss and GRPO
use only those), the log-probability of each chosen token under the distribution sampled from and
the end of each answered turn.

The per-step work stays in tensors (a token buffer, a mask, a log-prob buffer, one row each);
Python runs per row only when a row ended a chat turn or may have hit a stop string (only rows
whose new token ends in a stop string's last character are decoded and checked).

`generate_ids` is used by the chat path (`stages.generation.chat.rollout`: a turn ends at the
model's end tokens and is answered with the environment's tool results) and by
`stages.generation.serve_tiny` (the CPU OpenAI-compatible server of the demo model: completions
end at <eos>, `max_tokens` or a stop string).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class Row:
    """One generated continuation of a prefix (the core's result, before any environment view)."""

    token_ids: list[int]  # the continuation only (forced and chosen), no <eos>
    model_mask: list[int]
    logprobs: list[float]
    finish: str
    tool_calls: int
    closes: list[int]  # index in token_ids of each answered turn's last token
    stop: str | None = None  # the stop string the text ended with, when finish == "stop"


def _filtered(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = probs.cumsum(dim=-1) - probs > top_p  # keeps the first token always
        ordered = ordered.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, ordered)
    return logits


@functools.lru_cache(maxsize=8)  # decoding a 50k vocabulary token by token takes a second
def _ending_mask(tokenizer, texts: tuple[str, ...], vocab: int) -> torch.Tensor:
    """Tokens whose decoded text ends with the last character of one of `texts`."""
    lasts = {t[-1] for t in texts if t}
    mask = torch.zeros(vocab, dtype=torch.bool)
    for token in range(vocab):
        piece = tokenizer.decode([token])
        if piece and piece[-1] in lasts:
            mask[token] = True
    return mask


@torch.inference_mode()
def generate_ids(model, tokenizer, prefixes: list[list[int]], *, temperature: float,
                 max_new_tokens: int | list[int], generator: torch.Generator | list[torch.Generator],
                 top_p: float = 1.0, top_k: int = 0, stop: tuple[str, ...] = (), on_step=None,
                 on_turn_end=None, end_ids: tuple[int, ...] = ()) -> list[Row]:
    """Continue each prefix (token ids, starting with <bos> or whatever the model expects).

    A row ends at <eos>, after `max_new_tokens`, or when its text ends with one of `stop`.
    `generator` is one for the batch or one per row (so a row's samples do not depend on its
    neighbours: the server's per-request seeds). `on_step(finished_rows)` is called after every
    step.

    Chat turns (`stages.generation.chat`): with `on_turn_end`, a row's turn ends when the model
    chooses one of `end_ids` (default: the tokenizer's eos), which is kept as a chosen token, and
    `on_turn_end(row, turn_ids)` (the original row index, the turn's ids, end token included)
    answers with the ids to feed as forced tokens before the model's next turn, or with None (the
    episode ends: "eos") or a string (the episode ends with that `finish`). `max_new_tokens` then
    counts each turn's own tokens.
    """
    rows = len(prefixes)
    if not rows:
        return []
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = eos if pad is None else pad
    chat = on_turn_end is not None
    limit = model.config.max_position_embeddings
    if any(not p or len(p) >= limit for p in prefixes):
        raise ValueError(f"every prompt must have between 1 and {limit - 1} tokens (the model's "
                         f"context is {limit})")
    vocab = model.config.vocab_size
    device = model.device  # CPU here; the same loop runs on a GPU (the tensors follow the model)
    buf = torch.full((rows, limit), pad, dtype=torch.long)
    for i, prefix in enumerate(prefixes):
        buf[i, :len(prefix)] = torch.tensor(prefix, dtype=torch.long)
    buf = buf.to(device)
    prefix_len = torch.tensor([len(p) for p in prefixes], device=device)
    forced_end = prefix_len.clone()  # positions below it are forced (prompt, injected results)
    turn_start = prefix_len.clone()  # where the row's current turn began (chat turns' budget)
    ends = torch.tensor(sorted(set(end_ids) or {eos}), device=device)
    budget = (torch.tensor(max_new_tokens, device=device) if isinstance(max_new_tokens, list)
              else torch.full((rows,), max_new_tokens, device=device))
    chosen_mask = torch.zeros((rows, limit), dtype=torch.bool, device=device)
    logp_buf = torch.zeros((rows, limit), dtype=torch.float32, device=device)
    active = torch.ones(rows, dtype=torch.bool, device=device)
    # the tensors hold the rows still in the batch; these lists are indexed by the original row
    orig = list(range(rows))  # batch position -> original row
    end = [limit] * rows  # one past the last recorded token, set when a row ends
    finish = ["length"] * rows
    calls, closes, stopped = [0] * rows, [[] for _ in range(rows)], [None] * rows
    results: list[Row | None] = [None] * rows

    def collect(positions: list[int]) -> None:
        for i in positions:
            o = orig[i]
            start, stop_at = int(prefix_len[i]), end[o]
            results[o] = Row(
                token_ids=buf[i, start:stop_at].tolist(),
                model_mask=chosen_mask[i, start:stop_at].to(torch.int8).tolist(),
                logprobs=logp_buf[i, start:stop_at].tolist(),
                finish=finish[o], tool_calls=calls[o], closes=closes[o], stop=stopped[o],
            )

    watch = [s for s in stop if s]
    may_end = _ending_mask(tokenizer, tuple(watch), vocab).to(device) if watch else None

    cache = DynamicCache()
    # the tokens every row has forced at the same positions (the shortest prompt) go in one pass
    common = min(len(p) for p in prefixes)
    current = buf[:, :common]
    for position in range(common - 1, limit - 1):
        logits = model(input_ids=current, cache=cache, use_cache=True).logits[:, -1, :]
        logits = logits.float()
        batch = len(orig)
        nxt = position + 1
        forced = forced_end > nxt
        model_turn = active & ~forced
        if temperature > 0:
            probs = torch.softmax(_filtered(logits / temperature, top_k, top_p), dim=-1)
            if isinstance(generator, list):
                # a row draws only for its own tokens, so its samples do not depend on the batch
                sampled = torch.full((batch,), pad, dtype=torch.long, device=device)
                for i in model_turn.nonzero().flatten().tolist():
                    sampled[i] = torch.multinomial(probs[i], 1, generator=generator[orig[i]])[0]
            else:
                sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            sampled = logits.argmax(dim=-1)
        if chat:  # an end token closes the turn (kept, handled below); the budget is per turn
            turn_ended = model_turn & torch.isin(sampled, ends)
            ended = model_turn & ~turn_ended & (nxt - turn_start >= budget)
        else:
            ended = model_turn & ((sampled == eos) | (nxt - prefix_len >= budget))
        if ended.any():
            for i in ended.nonzero().flatten().tolist():
                finish[orig[i]] = "eos" if int(sampled[i]) == eos else "length"
                end[orig[i]] = nxt
            active &= ~ended
            model_turn &= ~ended
        token = torch.where(forced, buf[:, nxt], sampled)
        token = torch.where(active, token, pad)
        buf[:, nxt] = token
        chosen_mask[:, nxt] = model_turn
        if model_turn.any():
            # the log-prob under the distribution sampled from (the logits over T; top-k/top-p
            # are not in it, as in TRL's GRPO loss), so the ratio's old policy is the sampler
            scaled = logits / temperature if temperature > 0 else logits
            logp = torch.log_softmax(scaled, dim=-1)[torch.arange(batch, device=device), token]
            logp_buf[:, nxt] = torch.where(model_turn, logp, 0.0)
        if chat and turn_ended.any():
            for i in turn_ended.nonzero().flatten().tolist():
                o = orig[i]
                answer = on_turn_end(o, buf[i, turn_start[i]:nxt + 1].tolist())
                if answer is None or isinstance(answer, str):
                    finish[o], end[o] = answer or "eos", nxt + 1
                    active[i] = False
                    continue
                if nxt + 1 + len(answer) >= limit:  # no room left for the next turn
                    finish[o], end[o] = "length", nxt + 1
                    active[i] = False
                    continue
                buf[i, nxt + 1:nxt + 1 + len(answer)] = torch.tensor(answer, dtype=torch.long,
                                                                      device=device)
                forced_end[i] = turn_start[i] = nxt + 1 + len(answer)
                calls[o] += 1
                closes[o].append(nxt - int(prefix_len[i]))
        if may_end is not None:  # a row whose new token may end a stop string: decoded
            for i in (model_turn & may_end[token]).nonzero().flatten().tolist():
                text = tokenizer.decode(buf[i, prefix_len[i]:nxt + 1].tolist(),
                                        skip_special_tokens=True)
                hit = next((s for s in watch if text.endswith(s)), None)
                if hit is not None:
                    o = orig[i]
                    finish[o], stopped[o], end[o] = "stop", hit, nxt + 1
                    active[i] = False
        alive = int(active.sum())
        if on_step is not None:
            on_step(rows - alive)
        if not alive:
            break
        if alive * 2 <= batch and batch >= 16:
            # half the batch has ended: drop those rows (and their KV cache) instead of feeding
            # them padding until the longest episode ends
            collect((~active).nonzero().flatten().tolist())
            keep = active.nonzero().flatten()
            cache.batch_select_indices(keep)
            buf, prefix_len, forced_end, budget = buf[keep], prefix_len[keep], forced_end[keep], \
                budget[keep]
            turn_start = turn_start[keep]
            chosen_mask, logp_buf, active = chosen_mask[keep], logp_buf[keep], active[keep]
            orig = [orig[k] for k in keep.tolist()]
        current = buf[:, nxt:nxt + 1]
    collect(list(range(len(orig))))
    return results
