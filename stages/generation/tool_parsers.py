"""Turn a chat model's raw assistant text into OpenAI-shaped tool calls.

Parsers named as vLLM names them (`--tool-call-parser`): `hermes`, `llama3_json`, `mistral`. Each
returns a `Parsed`: the content, the well-formed calls and one message per malformed call, so the
rollout answers the model with a tool error. `detect` picks the parser a chat template implies
(`rollout.tool_parser: auto`). Reads and writes no file. On vLLM's own parser tests the calls and
content are vLLM's. Each difference, with the vLLM test it departs from:
1. Invalid JSON in a call is an error (hermes `test_hermes_parser_non_streaming_tool_call_invalid_json`,
   llama3_json `test_extract_tool_calls_invalid_json`).
2. A call without a name is an error (`test_extract_tool_calls_missing_name_key`).
3. A call without arguments gets `{}` (`test_extract_tool_calls_missing_parameters_and_arguments_key`).
4. String arguments must hold a JSON object (`test_hermes_parser_non_streaming_bare_string_arguments`).
5. llama3_json keeps the prose around the calls as content (`test_extract_tool_calls_simple`).
6. mistral: `[TOOL_CALLS]` and no call is an error (`test_extract_tool_calls_pre_v11_regex_fallback_fails`).
7. mistral (v11): unclosed arguments are an error (`test_extract_tool_calls`, "complex").
8. mistral (v11): a name without arguments is an error (`test_extract_tool_calls_v11_without_args_skipped`).
9. mistral: several `[TOOL_CALLS]` lists are read in turn (`test_extract_tool_calls_pre_v11_multiple_bot_tokens_raises`).
10. Calls are numbered `call_0`, `call_1`, ... in the turn; vLLM's ids are random.

Details: docs/agent.md, "How the tool parsers read calls (stages/generation/tool_parsers.py)".
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

_END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "</s>")
_SNIPPET = 200


@dataclass
class Parsed:
    """One assistant turn, parsed.

    `tool_calls` holds OpenAI-shaped calls: `{"id": "call_<n>", "type": "function",
    "function": {"name": str, "arguments": <JSON string of an object>}}`. `errors` has one message
    per malformed call; those calls are not in `tool_calls`.
    """

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class _Turn:
    """Collects a turn's calls and errors, numbering both."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.errors: list[str] = []
        self.attempts = 0

    def fail(self, problem: str, raw: str) -> None:
        """Record a malformed call: what was wrong and (the start of) what the model wrote."""
        raw = raw.strip()
        shown = raw if len(raw) <= _SNIPPET else raw[:_SNIPPET] + "..."
        self.errors.append(f"tool call {self.attempts}: {problem}: {shown}")
        self.attempts += 1

    def decode(self, raw: str) -> None:
        """Add the call in `raw`, which should be exactly one JSON object."""
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            self.fail(f"not valid JSON ({e.msg} at char {e.pos})", raw)
            return
        self.add(obj, raw)

    def add(self, obj: object, raw: str) -> None:
        """Add one decoded call object, or an error saying why it is not a call."""
        if not isinstance(obj, dict):
            self.fail(f'expected a JSON object {{"name": ..., "arguments": {{...}}}}, got {_kind(obj)}',
                      raw)
            return
        name = obj.get("name")
        if not isinstance(name, str) or not name.strip():
            self.fail('missing "name" (the tool to call, a string)', raw)
            return
        args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
        if isinstance(args, str):  # some models serialise the arguments themselves
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                self.fail(f'"arguments" is a string that is not JSON ({e.msg})', raw)
                return
        if not isinstance(args, dict):
            self.fail(f'"arguments" must be a JSON object, got {_kind(args)}', raw)
            return
        self.calls.append({"id": f"call_{len(self.calls)}", "type": "function",
                           "function": {"name": name.strip(),
                                        "arguments": json.dumps(args, ensure_ascii=False)}})
        self.attempts += 1

    def result(self, content: str | None) -> Parsed:
        """The turn as a `Parsed`."""
        return Parsed(_clean(content), self.calls, self.errors)


def _kind(value: object) -> str:
    return {list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _clean(text: str | None) -> str | None:
    text = (text or "").strip()
    return text or None


def _strip_end(text: str) -> str:
    text = text.rstrip()
    while True:
        for marker in _END_MARKERS:
            if text.endswith(marker):
                text = text[: -len(marker)].rstrip()
                break
        else:
            return text


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def hermes(text: str) -> Parsed:
    """Parse Hermes/Qwen2.5 `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""
    text = _strip_end(text)
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return Parsed(_clean(text))
    turn = _Turn()
    pos = start
    while pos >= 0:
        body = pos + len(_HERMES_OPEN)
        close, reopen = text.find(_HERMES_CLOSE, body), text.find(_HERMES_OPEN, body)
        ends = [i for i in (close, reopen) if i >= 0]
        end = min(ends) if ends else len(text)  # unclosed: the call runs to the next or the end
        raw = text[body:end]
        if raw.strip():
            turn.decode(raw.strip())
        else:
            turn.fail("empty <tool_call></tool_call> block", raw)
        pos = text.find(_HERMES_OPEN, end)
    return turn.result(text[:start])


_PYTHON_TAG = "<|python_tag|>"
# Where a Llama call object that failed to decode starts: `{"name":`, `{"parameters":`, ...
_LLAMA_CALL_START = re.compile(r'\{\s*"(?:name|parameters|arguments|type)"\s*:')
_LLAMA_NEXT_CALL = re.compile(r";\s*(?:" + re.escape(_PYTHON_TAG) + r")?\s*\{")
_LLAMA_KEYS = ("name", "parameters", "arguments")


def llama3_json(text: str) -> Parsed:
    """Parse Llama 3.x JSON tool calls: `[<|python_tag|>]{"name": ..., "parameters": {...}}[; ...]`."""
    text = _strip_end(text)
    tagged = _PYTHON_TAG in text
    turn = _Turn()
    decoder = json.JSONDecoder()
    spans: list[tuple[int, int]] = []  # the calls (good or bad), to cut out of the content
    pos = text.find("{")
    while pos >= 0:
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if _LLAMA_CALL_START.match(text, pos):  # a call the model got wrong
                following = _LLAMA_NEXT_CALL.search(text, pos)
                end = following.start() if following else len(text)
                turn.fail(f"not valid JSON ({e.msg} at char {e.pos - pos})", text[pos:end])
                spans.append((pos, end))
            else:  # a brace in prose
                end = pos + 1
        else:
            if isinstance(obj, dict) and any(key in obj for key in _LLAMA_KEYS):
                turn.add(obj, text[pos:end])
                spans.append((pos, end))
            # any other JSON value is prose; its inner braces are not calls either
        pos = text.find("{", end)
    if tagged and not spans:
        after = text[text.find(_PYTHON_TAG) + len(_PYTHON_TAG):]
        turn.fail('expected a JSON call {"name": ..., "parameters": {...}} after <|python_tag|>',
                  after)
    pieces, last = [], 0
    for start, end in spans + [(len(text), len(text))]:
        piece = text[last:start].replace(_PYTHON_TAG, "").strip().strip(";").strip()
        if piece:
            pieces.append(piece)
        last = end
    return turn.result(" ".join(pieces))


_MISTRAL_BOT = "[TOOL_CALLS]"
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.:\-]+")
_MISTRAL_LIST = re.compile(r"\[\s*\{")  # a JSON list of call objects, after other text


def _mistral_json(turn: _Turn, decoder: json.JSONDecoder, raw: str, start: int) -> None:
    """The calls of the JSON list (or object) at `start` of `raw`; text after it is ignored."""
    try:
        value, _ = decoder.raw_decode(raw, start)
    except json.JSONDecodeError as e:
        turn.fail(f"not valid JSON ({e.msg} at char {e.pos - start})", raw)
        return
    for obj in value if isinstance(value, list) else [value]:
        turn.add(obj, json.dumps(obj, ensure_ascii=False))


def mistral(text: str) -> Parsed:
    """Parse Mistral `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` or `[TOOL_CALLS]name{...}`."""
    text = _strip_end(text)
    if _MISTRAL_BOT not in text:
        return Parsed(_clean(text))
    head, *chunks = text.split(_MISTRAL_BOT)
    turn = _Turn()
    decoder = json.JSONDecoder()
    for chunk in chunks:
        raw = chunk.strip()
        if not raw:
            turn.fail(f"nothing after {_MISTRAL_BOT}", raw)
        elif raw[0] in "[{":  # before v11: a JSON list of calls (or one object); trailing text ignored
            _mistral_json(turn, decoder, raw, 0)
        else:  # v11 and later: name{arguments}; HF tokenizers may leave an [ARGS] marker between
            brace = raw.find("{")
            name = (raw if brace < 0 else raw[:brace]).replace("[ARGS]", "").strip()
            listed = _MISTRAL_LIST.search(raw)
            if not _MISTRAL_NAME.fullmatch(name) and listed:
                # before v11, the list after other text (vLLM's fallback finds it as well)
                _mistral_json(turn, decoder, raw, listed.start())
            elif not _MISTRAL_NAME.fullmatch(name):
                turn.fail('expected a tool name then its JSON arguments, as name{"key": ...}', raw)
            elif brace < 0:
                turn.fail(f"no JSON arguments after the tool name {name!r}", raw)
            else:
                try:
                    args, _ = decoder.raw_decode(raw, brace)
                except json.JSONDecodeError as e:
                    turn.fail(f"arguments are not valid JSON ({e.msg} at char {e.pos - brace})", raw)
                    continue
                turn.add({"name": name, "arguments": args}, raw)
    return turn.result(head)


PARSERS: dict[str, Callable[[str], Parsed]] = {
    "hermes": hermes,
    "llama3_json": llama3_json,
    "mistral": mistral,
}


def parse(name: str, text: str) -> Parsed:
    """Parse `text` with the parser called `name` (one of `PARSERS`)."""
    try:
        parser = PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; the valid ones are: "
                         f"{', '.join(PARSERS)}") from None
    return parser(text)


def detect(chat_template: str) -> str:
    """The parser a chat template implies: what `rollout.tool_parser: auto` resolves to.

    `[TOOL_CALLS]` means mistral, `<tool_call>` hermes, and `<|python_tag|>`, a `"parameters"` key
    or the `ipython` role llama3_json. Raises ValueError when none of these is in the template.
    """
    template = chat_template or ""
    if _MISTRAL_BOT in template:
        return "mistral"
    if _HERMES_OPEN in template:
        return "hermes"
    if _PYTHON_TAG in template or '"parameters"' in template or "ipython" in template:
        return "llama3_json"
    raise ValueError("cannot tell the tool-call format from the model's chat template"
                     f"{'' if template else ' (it has none)'}: set rollout.tool_parser to one of "
                     f"{', '.join(PARSERS)}")
