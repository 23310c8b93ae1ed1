"""DPO through TRL's DPOTrainer, on pre-tokenized pairs, with the champion as the reference.

Helper of `stages/train.py`. The pairs come from rollouts, so they are token ids already: the
trainer's own preparation (extract the prompt from text, append EOS, tokenize) is replaced by ours,
which keeps the rollout's exact tokens, and the collator marks as completion only the tokens the
model chose (`model_mask`), so TRL's loss (which sums log-probabilities over `completion_mask`)
never treats a tool result the environment injected as the model's choice. Our tokenizer has no
chat template, which is why the text formats are not used. Checked against trl 1.16: DPOConfig
defaults to bf16 and gradient checkpointing; both are set here (precision from the hardware).
"""

from __future__ import annotations

from pathlib import Path

import torch
from trl import DPOConfig, DPOTrainer

from stages import tinylm, trainers


def collate(bos: int, eos: int, pad: int):
    """Chosen rows then rejected rows: `<bos> prompt completion <eos>`, right-padded, with
    `completion_mask` 1 on the model's own completion tokens and the end of sequence.
    """
    def build(rows: list[dict]) -> dict:
        seqs, masks = [], []
        for side in ("chosen", "rejected"):
            for row in rows:
                seqs.append([bos, *row["prompt_ids"], *row[f"{side}_ids"], eos])
                masks.append([0] * (1 + len(row["prompt_ids"])) + list(row[f"{side}_mask"]) + [1])
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
    from datasets import Dataset

    data = Dataset.from_list([{k: p[k] for k in ("prompt_ids", "chosen_ids", "chosen_mask",
                                                 "rejected_ids", "rejected_mask")} for p in pairs])
    steps = trainers.total_steps(len(data), config.batch_size, config.epochs)
    reference, _ = tinylm.load(champion)
    args = args_for(steps, cls=DPOConfig, beta=config.beta, gradient_checkpointing=False,
                    max_length=None, precompute_ref_log_probs=False, disable_dropout=True)
    return PairsDPOTrainer(
        model=model, ref_model=reference, args=args, train_dataset=data,
        processing_class=tokenizer,
        data_collator=collate(tokenizer.bos_token_id, tokenizer.eos_token_id,
                              tokenizer.pad_token_id))
