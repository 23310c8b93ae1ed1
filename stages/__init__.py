"""offseason's stages: one module per DVC stage, and the pieces they share, in folders by kind.

The DVC stages (ingest validate rollout reward train champion_scores gate) and init/simulate sit
at the top with the shared modules (config, io, tinylm, modelfiles, remote, http, servers,
budget); the folders are `envs/` (the environments and their contract), `generation/` (the
episode loop and its backends), `training/` (sft, dpo, grpo) and `traces/` (schema, pii, drift,
sources/). Imports point down, never in a circle; nothing in stages/ imports Prefect or flows/;
tests/test_layout.py checks every import, and that dvc.yaml lists what each stage imports.

Details: docs/layout.md, "The stages/ package and its import rules (stages/__init__.py)".
"""
