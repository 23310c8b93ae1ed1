"""offseason's orchestration: the Prefect cycle around the stages, promotion, lineage, reports.

Also the `offseason` command line, tracking in MLflow, the UIs and the OTLP receiver that feeds
the inbox (`offseason collect`); the stages themselves are in `stages/`, which never imports this
package.
"""
