"""The Prefect cycle, its DVC stages, promotion and deployments; imports any other folder of flows/ but cli (flows/__init__.py)."""
