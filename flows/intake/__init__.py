"""Traces in: the OTLP receiver and the vendors' exports; imports only flows/project/ (flows/__init__.py)."""
