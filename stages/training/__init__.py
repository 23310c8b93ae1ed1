"""Training on scored rollouts: one module per `train.algorithm` (`sft`, `dpo`, `grpo`), each with
`UNIT`, `examples(rows)` and `trainer(...)`; `trainers` (TrainingArguments, DeepSpeed, per-step
logs: what they share); `batches` (examples as token ids, the one collator); `warmstart` (the
plain PyTorch loop that builds the demo's generation 0, without the Trainer's imports).
"""
