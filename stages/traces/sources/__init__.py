"""Readers that map agent-trace export formats onto the normalized trace form."""
