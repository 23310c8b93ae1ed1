"""offseason's stages: one module per DVC stage, and the pieces they share, in folders by kind.

    stages/
      ingest validate rollout reward train champion_scores gate   the DVC stages (dvc.yaml)
      init simulate                  generation 0 and the demo's traffic (`offseason init/simulate`)
      config io tinylm               typed params, atomic writes, loading and saving model folders
      modelfiles                     what a model folder must hold, checked without torch
      remote http servers budget     a remote's probe, the one HTTP client and retry policy, a
                                     model server as a local process, the cycle's budget
      envs/        the environments: contract (what an environment module defines, loading and
                   checking one, the reward stage's scoring jobs), errors, the built-in ones on
                   the contract: arith (the demo's), coding (+ its sandbox), toolcall, replay
                   (any trace as a task, its tool calls answered from the record); judge (the
                   LLM judge a reward calls), mcp_tools (the tools of MCP servers)
      generation/  the episode loop: episode (turns, progress), transformers_backend, openai_backend,
                   serve_tiny (the demo model behind an OpenAI-compatible server), chat (a chat
                   model in a user's environment, token in and token out), tool_parsers
      training/    sft, dpo, grpo (one module per `train.algorithm`), trainers (what they share),
                   batches (examples as token ids, the collator), warmstart (the plain loop
                   behind generation 0)
      traces/      schema, pii, drift, sources/ (one reader per trace format, messages: helpers)

The one rule of each folder, which is what it may import (imports point down, never in a circle;
nothing in stages/ imports Prefect or flows/; tests/test_layout.py checks every import, the ones
inside functions included):
- a stage module may import anything below it in stages/; no stage imports another stage, except
  champion_scores, which scores with the gate's own code;
- `envs/` imports only itself (`errors` is its leaf; `contract` the sandbox), but `judge` reads
  `config` (the judge's params), `remote` (its probe), `http` (its client) and `servers` (a judge
  it starts), and `replay` reads `config`;
- `generation/` imports nothing of stages/ but `tinylm`, `envs/contract` (how a user's tool call
  is answered), `remote`, `http` and `servers` (the servers it starts and talks to); an
  environment comes in as an argument;
- `training/` imports itself (`trainers` and `batches` are its leaves), `tinylm`, `io` (atomic
  writes), `envs/contract` (what full marks are, for DPO's pairs) and `generation/chat`
  (generation 0's demonstrations in the chat template);
- `traces/` imports only itself (`schema` and `pii` are its leaves; `sources/` read formats).
`config` imports nothing of stages/ but `envs/sandbox` and `envs/mcp_tools` (the settings it
checks there), `io` only `config` and the error types it explains;
`modelfiles`, `remote`, `http` and `servers` import nothing, so `tinylm` and the CLI can check a
folder before torch loads.
dvc.yaml lists, for each stage, the files and folders it imports (tests/test_layout.py checks it).
"""
