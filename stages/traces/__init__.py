"""Production traces: `schema` (the ingested row and its content hash), `pii` (scrubbing), `drift`
(the task mix from cycle to cycle), and `sources/`, one reader per trace format with `messages`,
the OpenAI chat helpers they share.
"""
