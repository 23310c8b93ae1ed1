"""The project folder, its params, MLflow records and notices; imports nothing of flows/ (flows/__init__.py)."""
