"""The errors of environments and their task suites: a leaf module every other module may import.

`VerifierError`: a verifier or its infrastructure (sandbox, server) broke; the reward stage records
it with its cause, never as a score of zero. `TaskFileError`: a line of a task suite that is not a
task; its message names the file and line.
"""


class VerifierError(RuntimeError):
    """The verifier or its infrastructure broke: an error with its cause, never a score of zero."""


class TaskFileError(ValueError):
    """A task suite line that is not a task; the message names the file and line."""
