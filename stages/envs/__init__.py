"""The environments tasks run in: `contract` (what an environment module defines, loading and
checking one, scoring jobs for the reward stage), `errors` (VerifierError, TaskFileError: the
leaf everything may import), the built-in environments on that contract (`arith`, `coding` with
its `sandbox`, `toolcall`, `replay`), `judge` (the LLM judge a reward calls) and `mcp_tools` (the
tools of MCP servers).
"""
