"""The environments tasks run in: `registry` (ENVIRONMENTS by name, loading task suites, scoring
jobs for the reward stage), `errors` (VerifierError, TaskFileError: the leaf everything may
import), and one module per built-in environment (`arith`, `coding` with its `sandbox`,
`toolcall`). `stages/envs/registry.py` documents what an environment module defines.
"""
