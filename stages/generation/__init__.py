"""The episode loop: what the champion does with a task, whichever backend generates it.

`chat` (the chat path: the model's own chat template in, its tool calls parsed by
`tool_parsers`, exact token ids out), `episode` (turn numbering, progress), `transformers_backend`
(in-process, CPU or GPU; the default), `openai_backend` (any OpenAI-compatible server: vLLM,
SGLang, TGI, or `serve_tiny`, the demo model behind such a server).
"""
