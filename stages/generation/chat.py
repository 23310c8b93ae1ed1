"""Chat episodes: a Hugging Face chat model plays a user's environment, token in and token out.

Each turn is rendered by the model's own chat template with the environment's `TOOLS`; its tool
calls are read by the parser named as vLLM names it (`stages.generation.tool_parsers`) and
answered by the environment's `call_tool`, until it answers without a call or reaches the turn
limit. An episode keeps the exact ids the model produced and those injected between its turns,
never a re-tokenization. A conversation the template refuses ends that one episode
(`ChatEpisode.ended`, one of `ENDINGS`). `encode` turns a written conversation into ids and a mask
alike; `rollout` runs the episodes on the transformers backend. Reads and writes no file.

Details: docs/agent.md, "How chat episodes keep exact tokens (stages/generation/chat.py)".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from stages.envs import contract
from stages.generation import tool_parsers
from stages.remote import RemoteDown

_STUB = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
_PROBE_CALL = {"id": "call_0", "type": "function",
               "function": {"name": "probe", "arguments": json.dumps({"x": "1"})}}
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "probe", "parameters": {"type": "object", "properties": {}}}}]


DEFAULT_MAX_TURNS = 4  # tool calls per episode when neither the module nor params say

# How an episode ended (`ChatEpisode.ended`); the rollout stage counts each (`episodes_ended`).
# The first four are the model's own doing and are scored as they stand; the others are not the
# model's and carry `error` (scored by no one: the reward stage sets them aside, never a zero).
ENDINGS = {
    "answered": "the model answered without a tool call (finish eos)",
    "turn_limit": "it made one tool call more than the turn limit allows (finish turns)",
    "length": "out of tokens: its turn's max_new_tokens or the model's context (finish length)",
    "template_refused": "its own turn broke its chat template's rules, as two calls in one Llama "
                        "3.1 turn: no next prompt can be rendered (finish template)",
    "tool_failed": "the environment's call_tool raised: an infrastructure failure (finish error)",
    "tool_schema": "the chat template refuses the task's tools (Hermes 3's, a tool without a "
                   "description): never played (finish error)",
    "task_messages": "the chat template refuses the task's own messages: never played "
                     "(finish error)",
    "prompt_too_long": "the task's prompt leaves no room to answer in the model's context: never "
                       "played (finish error)",
    "template_unusable": "the chat template re-renders earlier turns so that the ids the model "
                         "produced cannot be kept exact, even over a stub (finish error)",
}
_BY_FINISH = {"eos": "answered", "turns": "turn_limit", "length": "length",
              "template": "template_refused"}


class TemplateError(ValueError):
    """A model whose chat template offseason cannot use; the message says why and what to do."""


class Refused(Exception):
    """The chat template raised on these messages: its own `raise_exception`, or an error on a
    shape it does not take (Hermes 3's on a tool without a description); says what it said.
    """


@dataclass
class ChatEpisode:
    """One episode of a chat model in an environment, as the rollout stage stores it."""

    messages: list[dict]  # the task's messages, then the assistant and tool turns
    token_ids: list[int] = field(default_factory=list)  # the whole conversation, as fed
    model_mask: list[int] = field(default_factory=list)  # 1 where the model chose the token
    logprobs: list[float] = field(default_factory=list)  # policy log-prob; 0.0 where forced
    finish: str = "length"  # "eos" (answered), "turns", "length", "error" or "template" (below)
    tool_calls: int = 0  # tool calls answered (tool errors the agent saw included)
    tool_errors: int = 0  # of those: unknown tools, bad arguments, ToolError, malformed calls
    # a failure that is not the model's (call_tool raised, a task or template that cannot be
    # rendered): its cause; such an episode is not scored
    error: str | None = None
    ended: str = ""  # how it ended: one of ENDINGS
    # turns whose tool calls a server returned with arguments that are not JSON (api: chat): read
    # from the ids by the tool parser instead, a malformed one answered as a tool error
    bad_arguments: int = 0
    # the model's own chat template refused its last turn (Llama 3.1's takes one call a turn,
    # this turn made two): what the template said; the episode ended there (finish "template")
    template_error: str | None = None
    turns: list[int] = field(default_factory=list)  # per token: 0 prompt, k the k-th turn


@dataclass
class Template:
    """How one tokenizer renders conversations with one set of tools."""

    tokenizer: object
    tools: list[dict] | None
    prefix_preserving: bool = True
    end_markers: tuple[str, ...] = ()
    # tool-call ids rendered as nine letters and digits: Mistral's templates refuse any other
    # (`call_0`, OpenAI's `call_` + 24) and vLLM's Mistral parser makes such ids (`short_ids`)
    short_ids: bool = False
    _variants: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, tokenizer, tools: list[dict] | None, end_ids: tuple[int, ...] = ()) -> Template:
        """The template of `tokenizer` for `tools`; checks it renders tools and keeps prefixes.

        Raises TemplateError for a tokenizer without a chat template.
        """
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                f"the model's tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat "
                f"template: add one to its tokenizer_config.json (\"chat_template\"), e.g. the "
                f"Instruct model's of the same family, or use the Instruct model")
        ids = set(end_ids) | {tokenizer.eos_token_id} - {None}
        markers = tuple(sorted({tokenizer.convert_ids_to_tokens(i) for i in ids}, key=len,
                               reverse=True))
        template = cls(tokenizer, list(tools) if tools else None, True, markers)
        template.short_ids = template._wants_short_ids()
        template.prefix_preserving = template._keeps_prefixes()
        return template

    def for_task(self, task: dict) -> Template:
        """The template for one task: rendered with the task's own `tools` when its line has them
        (offered tools may differ from task to task, as in OpenAI chat logs), else this one.
        """
        tools = task.get("tools")
        if tools is None:
            return self
        key = json.dumps(tools, sort_keys=True)
        if key not in self._variants:
            variant = Template(self.tokenizer, list(tools) or None, True, self.end_markers,
                               self.short_ids)
            variant.prefix_preserving = variant._keeps_prefixes()
            self._variants[key] = variant
        return self._variants[key]

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        """The template's text for `messages` (with the tools), as the model reads it.

        Raises Refused when the template raises (whatever it raises: its own exceptions, a jinja
        error, a TypeError on a shape it does not expect).
        """
        try:
            return self.tokenizer.apply_chat_template(
                _for_template(messages, self.short_ids), tools=self.tools,
                add_generation_prompt=generation_prompt, tokenize=False)
        except Exception as err:  # noqa: BLE001 (a template raises what it likes)
            raise Refused(f"{type(err).__name__}: {err}") from err

    def ids(self, text: str) -> list[int]:
        """The ids of rendered text: its special tokens are in the text, none are added."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, messages: list[dict]) -> list[int]:
        """The ids of the task's messages and the generation prompt: what the model first sees."""
        return self.ids(self.render(messages, True))

    def strip_end(self, text: str) -> str:
        """A turn's text without its end token (the parsers know the families' own end markers,
        not every tokenizer's eos).
        """
        for marker in self.end_markers:
            if marker and text.endswith(marker):
                return text[:-len(marker)]
        return text

    def _tail(self, before: str) -> str:
        """What the template writes after the last assistant turn's end token (Qwen: a newline)."""
        cut = max(((before.rfind(m), m) for m in self.end_markers if m), default=(-1, ""))
        return before[cut[0] + len(cut[1]):] if cut[0] >= 0 else ""

    def _ends(self, text: str) -> list[int]:
        """Where each end token in `text` ends, in order."""
        markers = [m for m in self.end_markers if m]  # longest first
        if not markers:
            return []
        return [m.end() for m in re.finditer("|".join(map(re.escape, markers)), text)]

    def _follows(self, before: str, after: str) -> str | None:
        """What `after` (a conversation, new messages, the generation prompt) feeds after the end
        token of the turn that ends `before` (the conversation alone): the rest of `after` where it
        extends `before`; else, for a template that re-renders the turn (Qwen3 drops its empty
        thinking once it is not the last), the rest of `after` after as many end tokens as
        `before` holds (the same turns, each still closed by its end token); else None.
        """
        if after.startswith(before):
            return self._tail(before) + after[len(before):]
        closed, ends = len(self._ends(before)), self._ends(after)
        if not closed or len(ends) < closed:
            return None
        return after[ends[closed - 1]:]

    def after_turn(self, history: list[dict], new: list[dict]) -> str:
        """The text fed after the model's end token: the rest of its turn's rendering, the `new`
        messages (tool results) and the generation prompt of its next turn.

        Raises Refused when the template refuses the conversation, TemplateError when no
        rendering gives the text that follows the turn.
        """
        if self.prefix_preserving:
            before = self.render(history, False)
            after = self.render(history + new, True)
            if after.startswith(before):
                return self._tail(before) + after[len(before):]
        text = self._follows(self.render(_STUB, False), self.render(_STUB + new, True))
        if text is None:
            raise TemplateError(
                "the chat template renders a conversation's earlier turns differently once new "
                "messages follow, even over a fixed stub, so the tokens the model produced cannot "
                "be kept exact; use a template that appends (most Instruct templates do)")
        return text

    def _wants_short_ids(self) -> bool:
        """Whether the template refuses a tool call's id as OpenAI writes it and takes nine letters
        and digits (Mistral's: "Tool call IDs should be alphanumeric strings with length 9!").
        """
        talk = [{"role": "user", "content": "Hello?"},
                {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
                {"role": "tool", "tool_call_id": _PROBE_CALL["id"], "content": "ok"}]
        for short in (False, True):
            try:
                self.tokenizer.apply_chat_template(_for_template(talk, short), tools=self.tools or _PROBE_TOOLS,
                                                   add_generation_prompt=True, tokenize=False)
            except Exception:  # noqa: BLE001 (a template raises what it likes)
                continue
            return short
        return False

    def _keeps_prefixes(self) -> bool:
        """Whether rendering a conversation then a longer one only appends, on the shapes of turn
        a rollout makes (`_PROBE_TALK`): calls after a think block, an empty one (which Qwen3's
        template drops once the turn is not the last) and none, a call after text, tool results
        (Hermes 3's closes the last one differently), an answer, a new question.
        """
        saved, self.tools = self.tools, self.tools or _PROBE_TOOLS
        try:
            talk = _PROBE_TALK
            for cut in range(2, len(talk)):
                if not self.render(talk[:cut + 1], False).startswith(
                        self.render(talk[:cut], False)):
                    return False
            return True
        except Refused:  # a template that cannot render this probe: take the safe path
            return False
        finally:
            self.tools = saved


def _probe_call(n: int) -> dict:
    return {**_PROBE_CALL, "id": f"call_{n}"}


# (a system prompt too: Mistral's template moves it to the last user message; one call a turn:
# Llama 3.1's takes no more, and a template that refuses a turn ends the episode there anyway)
_PROBE_TALK = [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"},
    {"role": "assistant", "content": "<think>\nprobe\n</think>\n\n", "tool_calls": [_probe_call(0)]},
    {"role": "tool", "tool_call_id": "call_0", "content": "ok"},
    {"role": "assistant", "content": "<think>\n\n</think>\n\n", "tool_calls": [_probe_call(1)]},
    {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    {"role": "assistant", "content": None, "tool_calls": [_probe_call(2)]},
    {"role": "tool", "tool_call_id": "call_2", "content": "ok"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [_probe_call(3)]},
    {"role": "tool", "tool_call_id": "call_3", "content": "ok"},
    {"role": "assistant", "content": "Done."},
    {"role": "user", "content": "Thanks?"},
    {"role": "assistant", "content": "<think>\nok\n</think>\n\nYou are welcome."},
]


def _for_template(messages: list[dict], short_ids: bool = False) -> list[dict]:
    """Messages as chat templates expect them: tool-call arguments as objects (Qwen's and Llama's
    templates `tojson` them, so a JSON string would be encoded twice) and content "" rather than
    None (templates concatenate it). With `short_ids`, each tool call's id that is not nine letters
    and digits already (`call_0`, OpenAI's `call_` + 24; vLLM's Mistral ids are kept) becomes one
    (`call00000`, `call00001`, ... in order of first appearance), the tool results' ids alike.
    An empty or null `tool_calls` is dropped: OpenAI means no call by it, and templates that test
    for the key refuse it (Llama 3.1's "only supports single tool-calls", Hermes 3's iterates it).
    """
    ids: dict[str, str] = {}

    def short(value):
        if not isinstance(value, str) or (len(value) == 9 and value.isascii() and value.isalnum()):
            return value
        if value not in ids:
            ids[value] = f"call{len(ids):05d}"
        return ids[value]

    out = []
    for message in messages:
        message = dict(message)
        if message.get("content") is None:
            message["content"] = ""
        if "tool_calls" in message and not message["tool_calls"]:
            del message["tool_calls"]
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function") or {})
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        function["arguments"] = json.loads(arguments) if arguments.strip() else {}
                    except json.JSONDecodeError:
                        pass  # a malformed call is rendered as the model wrote it
                call = {**call, "function": function}
                if short_ids and "id" in call:
                    call["id"] = short(call["id"])
                calls.append(call)
            message["tool_calls"] = calls
        if short_ids and "tool_call_id" in message:
            message["tool_call_id"] = short(message["tool_call_id"])
        out.append(message)
    return out


def assistant_message(parsed: tool_parsers.Parsed) -> dict:
    """The OpenAI-shaped assistant message of one parsed turn."""
    message = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    return message


def encode(template: Template, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Ids of a written conversation and the mask of the assistant's tokens (1: trained on),
    built turn by turn as a rollout builds them: the messages before the first assistant turn
    and the generation prompt, then each assistant turn up to and including its end token
    (mask 1), then what follows it (`Template.after_turn`, mask 0).
    """
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None:
        raise ValueError("the conversation has no assistant message to train on")
    ids = template.prompt(messages[:first])
    mask = [0] * len(ids)
    i = first
    while i < len(messages):
        # a template that rewrites earlier turns (Mistral's moves its system prompt to the last
        # user message): each turn as a rollout plays it, after a stub (tool-call ids then
        # numbered within the turn, as the tool results `after_turn` renders)
        history = messages[:i] if template.prefix_preserving else _STUB[:1]
        turn = template.render(history + [messages[i]], False)
        start = template.render(history, True)
        if not turn.startswith(start):
            raise TemplateError("the chat template renders the assistant turn after a "
                                "different prefix than its generation prompt")
        body = turn[len(start):]
        tail = template._tail(body)  # the turn's own end token, not an earlier message's
        body = body[:len(body) - len(tail)] if tail else body
        own = template.ids(body)
        ids += own
        mask += [1] * len(own)
        j = i + 1
        while j < len(messages) and messages[j].get("role") != "assistant":
            j += 1
        if j < len(messages):
            injected = template.ids(template.after_turn(messages[:i + 1], messages[i + 1:j]))
            ids += injected
            mask += [0] * len(injected)
        i = j
    return ids, mask


class _Play:
    """The environment's side of one batch of episodes: parses each finished turn, answers its
    tool calls and gives the ids to feed before the model's next turn.
    """

    def __init__(self, template: Template, env: contract.Environment, tasks: list[dict],
                 parser: str, max_turns: int):
        self.template, self.env, self.parser, self.max_turns = template, env, parser, max_turns
        self.tasks = tasks
        self.templates = [template.for_task(task) for task in tasks]  # a task's own tools
        self.episodes = [ChatEpisode(messages=[dict(m) for m in task["messages"]])
                         for task in tasks]
        self.turns_ended = [0] * len(tasks)  # turns that reached their end token
        self.answered = [(0, 0)] * len(tasks)  # (tool_calls, tool_errors) before the last turn
        # per episode, {message index: the text the model wrote} of each turn with a malformed
        # call, which the OpenAI message of the turn (its well-formed calls) does not hold
        self.written: list[dict[int, str]] = [{} for _ in tasks]

    def prompts(self, context: int | None = None) -> list[list[int] | None]:
        """The ids each episode starts from: its task's messages and the generation prompt; None
        where the episode cannot be played (ended here, `ended` and `error` saying why): its task
        the template refuses, or a prompt of `context` tokens or more (the model's context).
        """
        out: list[list[int] | None] = []
        for episode, template, task in zip(self.episodes, self.templates, self.tasks):
            try:
                ids = template.prompt(task["messages"])
            except Refused as err:
                tools = _refuses_tools(template)
                what = "tools" if tools else "messages"
                out.append(self._unplayed(episode, "tool_schema" if tools else "task_messages",
                                          f"the chat template refuses task "
                                          f"{task['task_id']}'s {what}: {err}"))
                continue
            if context is not None and len(ids) >= context:
                out.append(self._unplayed(episode, "prompt_too_long",
                                          f"task {task['task_id']}: its prompt ({len(ids)} tokens) "
                                          f"leaves no room to answer in the model's context of "
                                          f"{context}"))
                continue
            out.append(ids)
        return out

    def as_written(self, row: int) -> list[dict]:
        """Episode `row`'s messages as a server must render them to feed the model's own tokens:
        a turn with a malformed call as the text the model wrote (an OpenAI message holds calls,
        not a call that failed to parse), the others as they are.
        """
        written = self.written[row]
        return [{"role": "assistant", "content": written[i]} if i in written else message
                for i, message in enumerate(self.episodes[row].messages)]

    @staticmethod
    def _unplayed(episode: ChatEpisode, ended: str, error: str) -> None:
        episode.finish, episode.ended, episode.error = "error", ended, error

    def on_turn_end(self, row: int, turn_ids: list[int]):
        """`generate_ids`' hook: the ids to feed after this turn, or why the episode ends."""
        episode, task = self.episodes[row], self.tasks[row]
        self.turns_ended[row] += 1
        self.answered[row] = (episode.tool_calls, episode.tool_errors)
        template = self.templates[row]
        text = template.strip_end(template.tokenizer.decode(turn_ids, skip_special_tokens=False))
        parsed = tool_parsers.parse(self.parser, text)
        episode.messages.append(assistant_message(parsed))
        if parsed.errors:
            self.written[row][len(episode.messages) - 1] = text
        attempts = len(parsed.tool_calls) + len(parsed.errors)
        if not attempts:
            return None
        if episode.tool_calls + attempts > self.max_turns:
            return "turns"
        answers = []
        for call in parsed.tool_calls:
            function = call["function"]
            try:
                content, why = contract.call(self.env, task, function["name"],
                                             function["arguments"])
            except RemoteDown:  # a tool server down or stalled: every episode after would wait
                raise  # on it too, so the stage stops, naming it (mcp_tools.McpStalled)
            except Exception as err:  # an infrastructure failure: recorded, never a zero
                episode.error = (f"{self.env.where}: call_tool({function['name']!r}) raised "
                                 f"{type(err).__name__}: {err}")
                episode.ended = "tool_failed"
                return "error"
            episode.tool_errors += why is not None
            answers.append({"role": "tool", "tool_call_id": call["id"], "content": content})
        for number, problem in enumerate(parsed.errors):
            episode.tool_errors += 1
            answers.append({"role": "tool", "tool_call_id": f"call_malformed_{number}",
                            "content": f"Error: {problem}"})
        episode.tool_calls += attempts
        try:
            injected = template.after_turn(episode.messages, answers)
        except Refused as err:
            # the model's turn breaks its own template's rules (two calls where Llama 3.1's takes
            # one): no next prompt can be rendered, as a server would answer 400; the episode
            # ends, the policy's failure (finish "template", never an answer), not the stage's
            episode.messages.extend(answers)
            episode.template_error = str(err)
            return "template"
        except TemplateError as err:  # the template's doing, not the model's: not scored
            episode.messages.extend(answers)
            episode.error, episode.ended = f"TemplateError: {err}", "template_unusable"
            return "error"
        episode.messages.extend(answers)
        return template.ids(injected)


def _refuses_tools(template: Template) -> bool:
    """Whether `template` refuses its tools (or their absence) on a one-question conversation."""
    try:
        template.render([{"role": "user", "content": "Hello?"}], True)
    except Refused:
        return True
    return False


def resolve(rollout, tokenizer, env: contract.Environment) -> tuple[str, int]:
    """(the tool parser, the turn limit) for `env`: `rollout.tool_parser` (auto: the one the chat
    template implies) and `rollout.max_turns`, else the module's MAX_TURNS, else
    DEFAULT_MAX_TURNS. Raises ValueError naming `rollout.tool_parser` when it cannot tell.
    """
    rollout.check_tool_parser(tool_parsers.PARSERS)
    parser = rollout.tool_parser
    if parser == "auto":
        try:
            parser = tool_parsers.detect(tokenizer.chat_template or "")
        except ValueError as err:
            raise TemplateError(f"rollout.tool_parser: auto: {err}") from None
    return parser, rollout.max_turns or env.max_turns or DEFAULT_MAX_TURNS


def end_ids(model, tokenizer) -> tuple[int, ...]:
    """The tokens that end a turn: the generation config's eos ids (Llama 3 has three) and the
    tokenizer's eos.
    """
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(sorted(set(ids)))


def rollout(model, tokenizer, env: contract.Environment, tasks: list[dict], *, parser: str,
            temperature: float, max_new_tokens: int, max_turns: int, generator,
            top_p: float = 1.0, top_k: int = 0, template: Template | None = None,
            on_step=None) -> list[ChatEpisode]:
    """One episode per task (repeat a task for several samples), in one batch.

    `parser`: a `tool_parsers.PARSERS` name; `max_turns`: tool calls answered per episode;
    `max_new_tokens`: per model turn. `generator`: a torch.Generator, or one per task.
    """
    from stages.generation.transformers_backend import generate_ids

    if parser not in tool_parsers.PARSERS:
        raise ValueError(f"unknown tool parser {parser!r}: one of "
                         f"{', '.join(tool_parsers.PARSERS)}")
    ends = end_ids(model, tokenizer)
    template = template or Template.of(tokenizer, list(env.tools), ends)
    play = _Play(template, env, tasks, parser, max_turns)
    prompts = play.prompts(model.config.max_position_embeddings)
    live = [i for i, prompt in enumerate(prompts) if prompt is not None]  # the others ended
    skipped = len(prompts) - len(live)
    rows = generate_ids(model, tokenizer, [prompts[i] for i in live], temperature=temperature,
                        max_new_tokens=max_new_tokens,
                        generator=[generator[i] for i in live] if isinstance(generator, list)
                        else generator, top_p=top_p, top_k=top_k,
                        on_turn_end=lambda row, ids: play.on_turn_end(live[row], ids),
                        end_ids=ends,
                        on_step=None if on_step is None else lambda n: on_step(n + skipped))
    for index, row in zip(live, rows):
        settle(play, index, prompts[index], row.token_ids, row.model_mask, row.logprobs,
               row.finish, row.closes)
    return episodes_checked(play.episodes)


def greedy(model, tokenizer, env: contract.Environment, tasks: list[dict], settings,
           seed: int) -> list[ChatEpisode]:
    """One greedy episode per task, as the rollout `settings` say (tool parser, turns, tokens a
    turn), in batches of `settings.batch_size`: how the gate scores a model on a benchmark and
    simulate has the champion answer a day's traffic.
    """
    import torch

    parser, max_turns = resolve(settings, tokenizer, env)
    template = Template.of(tokenizer, list(env.tools), end_ids(model, tokenizer))
    episodes: list[ChatEpisode] = []
    for start in range(0, len(tasks), settings.batch_size):  # memory bounded by the batch
        episodes += rollout(
            model, tokenizer, env, tasks[start:start + settings.batch_size], parser=parser,
            temperature=0.0, max_new_tokens=settings.max_new_tokens, max_turns=max_turns,
            generator=torch.Generator().manual_seed(seed), template=template)
    return episodes


def settle(play: _Play, index: int, prompt: list[int], ids: list[int], mask: list[int],
           logprobs: list[float], finish: str, closes: list[int]) -> ChatEpisode:
    """Episode `index` of `play` from what the model and the environment wrote after its prompt
    (`closes`: where each answered turn's end token sits in `ids`), whichever backend generated it.
    """
    from stages.generation.episode import turn_index

    episode = play.episodes[index]
    episode.token_ids = prompt + ids
    episode.model_mask = [0] * len(prompt) + mask
    episode.logprobs = [0.0] * len(prompt) + logprobs
    episode.finish = finish
    episode.ended = episode.ended or _BY_FINISH[finish]
    episode.turns = turn_index(len(prompt), mask, closes)
    if finish == "length" and play.turns_ended[index] > len(closes):
        # its last turn's tool answers found no room in the context: never fed, not kept
        while episode.messages and episode.messages[-1].get("role") == "tool":
            episode.messages.pop()
        episode.tool_calls, episode.tool_errors = play.answered[index]
    if finish == "length" and play.turns_ended[index] == len(closes):
        # cut off mid-turn: what it wrote since the last injected token is its last message
        start = len(mask)
        while start and mask[start - 1]:
            start -= 1
        text = play.template.tokenizer.decode(ids[start:], skip_special_tokens=False)
        episode.messages.append(assistant_message(tool_parsers.parse(play.parser, text)))
    return episode


def episodes_checked(episodes: list[ChatEpisode]) -> list[ChatEpisode]:
    """The episodes, each with as many ids as mask entries and log-probs (a broken invariant is a
    bug, said at once rather than trained on).
    """
    for episode in episodes:
        if not len(episode.token_ids) == len(episode.model_mask) == len(episode.logprobs):
            raise AssertionError("an episode's ids, mask and log-probs differ in length")
    return episodes
