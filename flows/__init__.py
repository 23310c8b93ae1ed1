"""offseason's orchestration: the Prefect cycle around the stages, promotion, lineage, reports.

Also the `offseason` command line, tracking in MLflow and the UIs; the stages themselves are in
`stages/`, which never imports this package.
"""
