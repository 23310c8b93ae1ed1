"""The errors of environments and their task suites: a leaf module every other module may import.

`VerifierError`: a verifier or its infrastructure (sandbox, server) broke; the reward stage records
it with its cause, never as a score of zero. `TaskFileError`: a line of a task suite that is not a
task; its message names the file and line. `ToolError`: raised by a user's environment's
`call_tool` for an error the agent should see and recover from (stages/envs/contract.py).
"""


class VerifierError(RuntimeError):
    """The verifier or its infrastructure broke: an error with its cause, never a score of zero."""


class TaskFileError(ValueError):
    """A task suite line that is not a task; the message names the file and line."""


class ToolError(Exception):
    """A tool call the agent got wrong (an unknown id, a refused request): raised by a user's
    `call_tool`, its message is shown to the agent as the tool's result, which it may recover
    from. Any other exception from `call_tool` is an infrastructure failure (see
    `stages/envs/contract.py`).
    """
