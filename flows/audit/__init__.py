"""What people read after a cycle: lineage, reports, the UIs; imports flows/project/ and flows/intake/ (flows/__init__.py)."""
