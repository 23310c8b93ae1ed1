"""offseason's orchestration and everything else that is not a stage, in folders by kind.

    flows/
      cli.py          the `offseason` command line: reads every folder, no folder reads it
      project/        the project folder and what every command shares: workspace (root, git,
                      DVC, the cycle lock, the embedded defaults), params (the whole params.yaml
                      and the Run form's parameters), overrides (a run's parameters written into
                      params.yaml and undone), tracking (MLflow runs and registry), notify
      intake/         traces in: collect (the OTLP/HTTP receiver feeding the inbox), pull
                      (Langfuse and LangSmith exports)
      audit/          what people read afterwards: lineage (a trace to the generations that
                      learned from it), report (the cycle report and its plots), ui (the Prefect
                      and MLflow UIs of the workspace)
      orchestration/  the Prefect cycle: cycle (the flow), pipeline (its DVC stages, run warm
                      through forkserver), cost (the ledger, the estimate and the budget a cycle
                      must fit), promotion (approval, the champion alias), serve (the deployments)

The one rule of each folder, which is what it may import (tests/test_layout.py checks it, every
import read, function-level ones included): `project/` imports nothing of flows/; `intake/`
imports only `project/`; `audit/` imports `project/` and `intake/` (the report counts what
collect received); `orchestration/` imports any of the three; `cli.py` imports any folder, and
nothing imports it. The stages themselves are in `stages/`, which never imports this package.
"""
