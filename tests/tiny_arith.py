"""The tests' tiny arithmetic champion (the demo's tag protocol) and rewards files written by
hand for it: shared by the train, cost and reward/train/gate tests, each of which builds the
champion once in a module-scoped fixture.
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages import config as cfg
from stages import reward, rollout, tinylm
from stages.envs import arith
from stages.training import grpo, warmstart
from stages.training.batches import encode_completion
from stages.training.warmstart import demonstrations

GOOD = "<calc>2*3</calc><result>6</result>answer:6"
BAD = "answer:5"


def build_champion(folder: Path) -> Path:
    """A one-layer model, warm-started for 10 steps on tool demonstrations, saved to `folder`."""
    tokenizer = tinylm.build_tokenizer(arith)
    model = tinylm.build_model(tokenizer, n_layer=1, n_embd=32, n_head=2, n_positions=64, seed=0)
    warmstart.train(model, demonstrations(tokenizer, arith, random.Random(0), 0.5, 16), steps=10,
                    lr=1e-2, tokenizer=tokenizer, seed=0)
    tinylm.save(model, tokenizer, folder)
    return folder


def scored(tmp_path: Path, champion: Path, groups) -> Path:
    """A rewards file: one task per group of completions, log-probs from the champion itself."""
    model, tokenizer = tinylm.load(champion)
    rows = []
    for t, (question, completions) in enumerate(groups):
        for s, completion in enumerate(completions):
            ids, mask = encode_completion(tokenizer, arith, arith.prompt(question), completion)
            rows.append({"task_id": f"t{t}", "trace_id": f"t{t}", "sample": s,
                         "question": question, "answer": str(arith.gold_answer(question)),
                         "prompt": arith.prompt(question), "completion": completion,
                         "token_ids": ids, "model_mask": mask, "logprobs": None,
                         "finish": "eos", "tool_calls": completion.count("<calc>")})
    grpo.reference_logprobs(model, rows, tokenizer.bos_token_id, tokenizer.pad_token_id, 16)
    for row in rows:  # as the rollout records them: the policy's log-prob where the model chose
        row["logprobs"] = [lp if m else 0.0 for lp, m in zip(row.pop("ref_logprobs"),
                                                             row["model_mask"])]
    path = tmp_path / "rollouts.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=rollout.SCHEMA), path)
    reward.run(cfg.Base(), cfg.Reward(), path, tmp_path / "rewards.parquet")
    return tmp_path / "rewards.parquet"
