"""The environments tasks run in, by the name `base.environment` gives in params.yaml.

An environment is one module with: `NAME`, `TAGS` and `CHARS` (what its tokenizer must know),
`TOOL_CLOSE` (the token after which the environment answers), `prompt(question)`,
`on_tool_close(text) -> injected text`, `verify(question, answer, completion) -> 1.0 | 0.0 | None`,
`task_from_messages(messages) -> {"question", "answer"} | None`, `messages_from_completion(...)`,
`sample_question(rng, weights)`, `task_kind(question)` (for drift reports),
`mix_for_day(day, shift)` and `demonstration(question, use_tool)`.
Add one by writing the module and naming it here.
"""

from stages import arith

ENVIRONMENTS = {"arith": arith}
