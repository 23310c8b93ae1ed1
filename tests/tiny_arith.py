"""The tests' tiny arithmetic champion (the demo's chat model, built as `offseason init` builds
it) and rollouts and rewards files written by hand for it: shared by the train, cost and
reward/train/gate tests, each of which builds the champion once in a module-scoped fixture.

A completion is the assistant's (and tools') messages after the task's user turn.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages import config as cfg
from stages import reward, rollout, tinylm
from stages.envs import arith
from stages.generation import chat
from stages.training import grpo, warmstart

SPECS = {"arith": cfg.EnvironmentSpec(module="stages.envs.arith")}


def said(text: str) -> list[dict]:
    """A completion that answers at once: one assistant message."""
    return [{"role": "assistant", "content": text}]


GOOD = arith.chat_demonstration("2*3", use_tool=True)  # the calculator, then answer:6
BAD = said("answer:5")


def template_of(model, tokenizer) -> chat.Template:
    return chat.Template.of(tokenizer, list(arith.TOOLS), chat.end_ids(model, tokenizer))


def build_champion(folder: Path) -> Path:
    """A one-layer chat model, warm-started for 10 steps on tool demonstrations, saved to
    `folder`.
    """
    tokenizer = tinylm.build_tokenizer(arith)
    model = tinylm.build_model(tokenizer, n_layer=1, n_embd=32, n_head=2, n_positions=64, seed=0)
    warmstart.train(model, warmstart.demonstrations(template_of(model, tokenizer), arith,
                                                    random.Random(0), 0.5, 16),
                    steps=10, lr=1e-2, tokenizer=tokenizer, seed=0)
    tinylm.save(model, tokenizer, folder)
    return folder


def encoded(champion: Path, question: str, completion: list[dict]) -> tuple[list, list]:
    """The ids of a completion of `question` as a rollout records them, and their mask."""
    model, tokenizer = tinylm.load(champion)
    task = arith.chat_task(question)
    return chat.encode(template_of(model, tokenizer).for_task(task),
                       task["messages"] + completion)


def episodes(champion: Path, groups, names: list[str] | None = None) -> list[dict]:
    """Rollout rows: one task per group of completions (task id `arith:<name>`, by default
    `t<group>`), log-probs from the champion itself.
    """
    model, tokenizer = tinylm.load(champion)
    template = template_of(model, tokenizer)
    rows = []
    for t, (question, completions) in enumerate(groups):
        task = {"task_id": names[t] if names else f"t{t}", **arith.chat_task(question)}
        for s, completion in enumerate(completions):
            messages = task["messages"] + completion
            ids, mask = chat.encode(template.for_task(task), messages)
            rows.append({"task_id": f"arith:{task['task_id']}", "environment": "arith",
                         "sample": s,
                         "task": json.dumps(task), "messages": json.dumps(messages),
                         "completion": json.dumps(completion), "token_ids": ids,
                         "model_mask": mask, "finish": "eos", "error": None,
                         "tool_calls": sum(bool(m.get("tool_calls")) for m in completion),
                         "tool_errors": 0})
    grpo.reference_logprobs(model, rows, tokenizer.pad_token_id, 16)
    for row in rows:  # as the rollout records them: the policy's log-prob where the model chose
        row["logprobs"] = [lp if m else 0.0 for lp, m in zip(row.pop("ref_logprobs"),
                                                             row["model_mask"])]
    return rows


def scored(tmp_path: Path, champion: Path, groups, names: list[str] | None = None) -> Path:
    """A rewards file of those rollouts, scored by the reward stage (in this process)."""
    path = tmp_path / "rollouts.parquet"
    pq.write_table(pa.Table.from_pylist(episodes(champion, groups, names),
                                        schema=rollout.SCHEMA), path)
    reward.run(cfg.Reward(workers=1), path, tmp_path / "rewards.parquet", SPECS)
    return tmp_path / "rewards.parquet"
