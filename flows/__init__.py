"""offseason's orchestration and everything else that is not a stage, in folders by kind.

`cli.py` (the `offseason` command line), `project/` (the project folder and what every command
shares), `intake/` (traces in: collect, pull), `audit/` (lineage, report, ui) and
`orchestration/` (the Prefect cycle, its DVC pipeline, cost, promotion, the deployments). Imports:
`project/` nothing of flows/; `intake/` only `project/`; `audit/` `project/` and `intake/`;
`orchestration/` any of the three; `cli.py` any folder, and nothing imports it
(tests/test_layout.py checks it). The stages are in `stages/`, which never imports this package.

Details: docs/layout.md, "The flows/ package and its import rules (flows/__init__.py)".
"""
