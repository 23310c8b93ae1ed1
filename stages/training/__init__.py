"""Training on scored rollouts: one module per `train.algorithm` (`sft`, `dpo`, `grpo`), each with
`UNIT`, `examples(rows)` and `trainer(...)`; `trainers` (TrainingArguments, DeepSpeed, per-step
logs: what they share); `warmstart` (the plain PyTorch loop that builds the demo's generation 0).
"""
