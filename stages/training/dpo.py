"""DPO through TRL's DPOTrainer, on pre-tokenized pairs, with the champion as the reference.

Helper of `stages/train.py` (`train.algorithm: dpo`, settings in `train.dpo`). Pairs come from a
task's higher- and lower-reward rollouts (`examples`) and from the traces' thumbs
(`feedback_pairs`, never overruling the verifier). The pairs come from rollouts, so they are
token ids already: the trainer's own preparation (extract the prompt from text, apply the chat
template, tokenize) is replaced by ours, which keeps the rollout's exact tokens, and the collator
marks as completion only the tokens the model chose (`model_mask`), so TRL's loss (which sums
log-probabilities over `completion_mask`) never treats a tool result the environment injected as
the model's choice. Checked against trl 1.16: DPOConfig defaults to bf16 and gradient
checkpointing; both are set here (precision from the hardware).
"""

from __future__ import annotations

from pathlib import Path

import torch
from trl import DPOConfig, DPOTrainer

from stages import tinylm
from stages.training import trainers

UNIT = "preference pairs"  # what one example is, for the stage's messages


def prompt_length(mask: list[int]) -> int:
    """The leading tokens the model did not choose: the prompt."""
    return next((i for i, m in enumerate(mask) if m), len(mask))


def examples(rows: list[dict]) -> tuple[list[dict], dict]:
    """Per task: each distinct best-reward completion against a distinct lower-reward one.

    A completion sampled several times is ranked by its samples' mean reward: a judge that
    compares a group's samples (`reward_group`) may score the same text differently in one group.
    The prompt is the leading run of tokens the model did not choose; chosen and rejected are the
    rest, with their masks (tool results inside them are not the model's).
    """
    pairs, no_pair = [], 0
    for task, group in trainers.by_task(rows).items():
        distinct: dict[str, list[dict]] = {}
        for row in group:
            distinct.setdefault(row["completion"], []).append(row)
        mean = {c: sum(r["reward"] for r in same) / len(same) for c, same in distinct.items()}
        best = max(mean.values())
        hi = [same[0] for c, same in sorted(distinct.items()) if mean[c] == best]
        lo = [same[0] for c, same in sorted(distinct.items()) if mean[c] < best]
        if not lo:
            no_pair += 1
            continue
        for i in range(max(len(hi), len(lo))):
            chosen, rejected = hi[i % len(hi)], lo[i % len(lo)]
            cut = prompt_length(chosen["model_mask"])
            rcut = prompt_length(rejected["model_mask"])
            pairs.append({
                "task_id": task, "completion": f"{chosen['completion']}\x00{rejected['completion']}",
                "prompt_ids": chosen["token_ids"][:cut],
                "chosen_ids": chosen["token_ids"][cut:], "chosen_mask": chosen["model_mask"][cut:],
                "rejected_ids": rejected["token_ids"][rcut:],
                "rejected_mask": rejected["model_mask"][rcut:]})
    return pairs, {"tasks_without_pair": no_pair}


def _partner(group: list[dict], thumbs_up: bool) -> dict | None:
    """The rollout a trace's own answer is paired with: for a thumbs up its task's worst failing
    rollout, for a thumbs down its best verified-correct one (None: there is none).
    """
    ranked = sorted((r for r in group if r["correct"] is not None),
                    key=lambda r: (-r["reward"], r["completion"]))
    if thumbs_up:
        return next((r for r in reversed(ranked) if r["correct"] < 1.0), None)
    return next((r for r in ranked if r["correct"] == 1.0), None)


def _feedback_pair(task_id: str, own: dict, thumbs_up: bool, full: bool | None,
                   group: list[dict], counts: dict, taken: set | None) -> dict | None:
    """The pair of a trace's own answer (`own`: token_ids, model_mask, completion) and its
    partner rollout, or None with the reason counted: feedback the verifier overrules (`full`:
    whether it gives the answer full marks; None: it cannot judge, the thumbs decide), no partner,
    or another prompt than its rollouts'. A pair already `taken` is skipped uncounted.
    """
    if thumbs_up and full is False:
        counts["thumbs_up_verifier_wrong"] += 1
        return None
    if not thumbs_up and full is True:
        counts["thumbs_down_verifier_correct"] += 1
        return None
    partner = _partner(group, thumbs_up)
    if partner is None:
        counts["feedback_without_partner"] += 1
        return None
    chosen, rejected = (own, partner) if thumbs_up else (partner, own)
    cut, rcut = prompt_length(chosen["model_mask"]), prompt_length(rejected["model_mask"])
    if chosen["token_ids"][:cut] != rejected["token_ids"][:rcut]:
        counts["feedback_unusable"] += 1  # not the prompt its rollouts answered
        return None
    key = (task_id, f"{chosen['completion']}\x00{rejected['completion']}")
    if key in (taken or set()):
        return None
    return {"task_id": key[0], "completion": key[1], "prompt_ids": chosen["token_ids"][:cut],
            "chosen_ids": chosen["token_ids"][cut:], "chosen_mask": chosen["model_mask"][cut:],
            "rejected_ids": rejected["token_ids"][rcut:],
            "rejected_mask": rejected["model_mask"][rcut:]}


def feedback_pairs(rows: list[dict], traces: list[dict], taken: set | None = None
                        ) -> tuple[list[dict], dict]:
    """Pairs from the thumbs of production traces: a thumbs-up conversation is `chosen` against
    its task's worst failing rollout, a thumbs-down one `rejected` against its best full-marks
    rollout, and feedback never overrules the reward (a thumbs up the reward scores lower, or a
    thumbs down it gives full marks, is counted, not used; a reward that cannot judge leaves the
    thumbs to decide). `traces`:
    `train.encoded_traces` items (the conversation encoded with the chat template as its rollouts
    were); their task is `<environment>:trace:<id>`. A trace whose prompt ids differ from its
    rollouts' is unusable (counted).
    """
    from stages.envs import contract

    tasks = trainers.by_task(rows)
    counts = dict.fromkeys(("feedback_traces", "thumbs_up_verifier_wrong",
                            "thumbs_down_verifier_correct", "feedback_unusable",
                            "feedback_without_partner"), 0)
    pairs = []
    for trace in traces:
        group = tasks.get(trace["task_id"])
        if trace["thumbs_up"] is None or not group:
            continue
        counts["feedback_traces"] += 1
        if trace["error"] is not None:
            counts["feedback_unusable"] += 1
            continue
        full = None if trace["scores"] is None else contract.full_marks(trace["scores"])
        own = {k: trace[k] for k in ("token_ids", "model_mask", "completion")}
        pair = _feedback_pair(trace["task_id"], own, trace["thumbs_up"], full, group, counts,
                              taken)
        if pair is not None:
            pairs.append(pair)
    return pairs, counts


def collate(pad: int):
    """Chosen rows then rejected rows: the prompt's ids and the side's, right-padded, with
    `completion_mask` 1 on the model's own tokens (its end tokens included: the ids are whole
    conversations as the model saw them).
    """
    def build(rows: list[dict]) -> dict:
        seqs, masks = [], []
        for side in ("chosen", "rejected"):
            for row in rows:
                seqs.append([*row["prompt_ids"], *row[f"{side}_ids"]])
                masks.append([0] * len(row["prompt_ids"]) + list(row[f"{side}_mask"]))
        width = max(len(s) for s in seqs)
        out = {"input_ids": torch.full((len(seqs), width), pad, dtype=torch.long),
               "attention_mask": torch.zeros((len(seqs), width), dtype=torch.long),
               "completion_mask": torch.zeros((len(seqs), width), dtype=torch.long)}
        for i, (seq, mask) in enumerate(zip(seqs, masks)):
            out["input_ids"][i, :len(seq)] = torch.tensor(seq)
            out["attention_mask"][i, :len(seq)] = 1
            out["completion_mask"][i, :len(seq)] = torch.tensor(mask)
        return out
    return build


class PairsDPOTrainer(trainers.StepLog, DPOTrainer):
    """TRL's DPOTrainer on a dataset that is already tokenized (see the module docstring)."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset

    def _set_signature_columns_if_needed(self):
        self._signature_columns = ["prompt_ids", "chosen_ids", "rejected_ids", "chosen_mask",
                                   "rejected_mask"]


def trainer(model, tokenizer, champion: Path, pairs: list[dict], args_for, config):
    """The DPOTrainer for `pairs`; `args_for(n)`: the TrainingArguments for n dataset rows;
    `config`: the `train.dpo` section.
    """
    from datasets import Dataset

    data = Dataset.from_list([{k: p[k] for k in ("prompt_ids", "chosen_ids", "chosen_mask",
                                                 "rejected_ids", "rejected_mask")}
                              for p in pairs])
    reference, _ = tinylm.load(champion)
    args = args_for(len(data), cls=DPOConfig, beta=config.beta, gradient_checkpointing=False,
                    max_length=None, precompute_ref_log_probs=False, disable_dropout=True)
    return PairsDPOTrainer(
        model=model, ref_model=reference, args=args, train_dataset=data,
        processing_class=tokenizer,
        data_collator=collate(trainers.pad_id(tokenizer)))
