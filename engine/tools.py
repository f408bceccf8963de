"""Tool calling (OpenAI's ``tools``): the prompt, the grammar that shapes a call, and reading
calls back out of the generated text.

One output format for calls, whatever the model: Hermes style, as Qwen and Hermes models
write them::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The framing is enforced by a grammar (xgrammar's builder for this format: ``qwen_3`` with
reasoning off), so the reader below relies on it byte for byte and streams a call's
arguments verbatim instead of diffing partial JSON.

- ``tool_choice``: ``none`` (no tools in the prompt, no grammar), ``auto`` (free text until a
  call starts, then the call is constrained), ``required`` (at least one call, from the first
  token), or a named function (that one call, from the first token).
- ``parallel_tool_calls: false``: generation ends after the first call.
- A chat template that renders ``tools`` itself gets them (and earlier calls with their
  arguments as objects, as such templates expect). One that does not, such as the default
  model's ChatML, gets the tool list and the call format written into the system message,
  earlier calls as the text above, and tool results as a user turn between
  ``<tool_response>`` tags.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs

from engine.errors import InvalidParameterError
from engine.sampling_params import SamplingParams, StructuredOutputsParams

# The framing of one call; the grammar's builder (xgrammar's qwen_3 format) writes the same.
CALL_BEGIN = '<tool_call>\n{"name": "'
ARGUMENTS_BEGIN = '", "arguments": '
CALL_END = "}\n</tool_call>"
_CALL_TAG = "<tool_call>"  # (text that ends in a whole tag of a cut-off call is framing, not content)
TOOL_CHOICES = ("none", "auto", "required")
# OpenAI's rule for function names.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# Consecutive whitespace allowed inside arguments (as for JSON output).
_MAX_WHITESPACE = 20
# What may follow the last call of a ``required`` output.
_TRAILING_WHITESPACE = r"[ \n]{0,2}"

Message = dict[str, Any]


@attrs.frozen
class Tool:
    """One function the model may call. ``parameters`` is always enforced (``strict`` or not)."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        function = {"name": self.name}  # (in the order requests give them, as templates print them)
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@attrs.frozen
class ToolPlan:
    """What a request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask for.

    Attributes:
        tools: the functions, in the request's order.
        choice: ``none``, ``auto``, ``required`` or ``named``.
        named: the function a named choice forces.
        parallel: more than one call may be made.
    """

    tools: tuple[Tool, ...]
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def in_prompt(self) -> tuple[Tool, ...]:
        """The functions a chat template that renders tools is given: all, for tool_choice none
        too (as vLLM: the model knows them and is not asked to call one; a server may leave them
        out, its --exclude-tools-when-tool-choice-none)."""
        return self.tools

    @property
    def described(self) -> tuple[Tool, ...]:
        """The functions the engine's own tools block describes to a template that renders
        none, with its call format: none for tool_choice none (no call is read from the output)."""
        return self.tools if self.may_call else ()

    @property
    def may_call(self) -> bool:
        """Calls may come out (so the output is read for them)."""
        return self.choice != "none"

    @property
    def calls_only(self) -> bool:
        """The output is calls and nothing else (``required`` and named choices)."""
        return self.choice in ("required", "named")

    def structural_tag(self, content: StructuredOutputsParams | None = None) -> dict[str, Any] | None:
        """The grammar of the output (an xgrammar structural tag), or None for ``none``.

        ``content`` is another constraint on the text (``response_format``): under ``auto`` the
        output is either text that meets it or calls; ``required`` and named choices override it.
        """
        if self.choice == "none":
            return None
        if self.choice == "named":
            return self._hermes_tag({"type": "function", "function": {"name": self.named}})
        if self.choice == "required":
            return {**self._hermes_tag("required"), "format": self._calls_only()}
        if content is not None:
            calls = self._hermes_tag("required")["format"]
            text = as_structural_format(content, "structured_outputs")
            return {**self._hermes_tag("auto"), "format": {"type": "or", "elements": [text, calls]}}
        return self._hermes_tag("auto")

    def _calls_only(self) -> dict[str, Any]:
        """One call or more and nothing else, from the first token (xgrammar's builder for
        ``required`` lets free text come around the calls: a triggered tag). Calls are
        separated by a newline, and a little whitespace may follow the last (the parser drops
        it), so that a model that ends its line before the end token is not forced into
        another call."""
        tags = self._hermes_tag("required")["format"]["tags"]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                 "stop_after_first": not self.parallel}
        return {"type": "sequence", "elements": [calls, {"type": "regex", "pattern": _TRAILING_WHITESPACE}]}

    def _hermes_tag(self, tool_choice: Any) -> dict[str, Any]:
        """xgrammar's structural tag for Hermes-format calls to these tools."""
        from xgrammar.builtin_structural_tag import get_model_structural_tag

        return get_model_structural_tag(
            "qwen_3", tools=[t.as_openai() for t in self.tools], tool_choice=tool_choice, reasoning="disabled",
            exclude_special_tokens=False, max_whitespace_cnt=_MAX_WHITESPACE,
            parallel_tool_calls=self.parallel).model_dump(mode="json")

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the tool grammar as its constraint (merged with one already there)."""
        tag = self.structural_tag(params.structured_outputs)
        if tag is None:
            return params
        return attrs.evolve(params, structured_outputs=StructuredOutputsParams(structural_tag=tag))

    def finish_reason(self, finish_reason: str | None, num_calls: int) -> str | None:
        """OpenAI's finish reason: ``tool_calls`` when an ``auto`` or ``required`` output ended
        after complete calls; a named call ends as ``stop``; a cut-off output as ``length``."""
        if finish_reason == "stop" and num_calls and self.choice in ("auto", "required"):
            return "tool_calls"
        return finish_reason


def plan_tools(tools: Sequence[Any] | None, tool_choice: Any = None, parallel_tool_calls: bool = True,
               ) -> ToolPlan | None:
    """Check a request's tool fields; None when it has no tools.

    Raises:
        InvalidParameterError: naming ``tools``, ``tool_choice`` or ``parallel_tool_calls``.
    """
    if not isinstance(parallel_tool_calls, bool):
        raise InvalidParameterError("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    if tool_choice is not None and not isinstance(tool_choice, dict) and tool_choice not in TOOL_CHOICES:
        raise InvalidParameterError("tool_choice", f"tool_choice must be one of {', '.join(TOOL_CHOICES)} "
                                                   f"or a named function; got {tool_choice!r}")
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidParameterError("tool_choice", "tool_choice is only allowed when tools are given")
        if tools is not None and not isinstance(tools, list):
            raise InvalidParameterError("tools", "tools must be a list")
        return None
    if not isinstance(tools, list):
        raise InvalidParameterError("tools", "tools must be a list")
    parsed = tuple(_tool(t, i) for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise InvalidParameterError("tools", "tools has two functions of the same name")
    if tool_choice is None:
        return ToolPlan(parsed, "auto", parallel=parallel_tool_calls)
    if isinstance(tool_choice, str):
        return ToolPlan(parsed, tool_choice, parallel=parallel_tool_calls)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidParameterError("tool_choice", 'a named tool_choice is {"type": "function", "function": '
                                                   '{"name": "..."}}')
    if name not in names:
        raise InvalidParameterError("tool_choice", f"tool_choice names {name!r}, which is not in tools "
                                                   f"({', '.join(names)})")
    return ToolPlan(parsed, "named", named=name, parallel=parallel_tool_calls)


def _tool(value: Any, index: int) -> Tool:
    from engine.structured_outputs import unsupported_schema_keywords

    where = f"tools[{index}]"
    if not isinstance(value, dict) or value.get("type", "function") != "function":
        raise InvalidParameterError("tools", f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}} "
                                             f"(function tools only)")
    function = value.get("function")
    if not isinstance(function, dict):
        raise InvalidParameterError("tools", f"{where}.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidParameterError("tools", f"{where}.function.name must be 1 to 64 letters, digits, _ or -; "
                                             f"got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidParameterError("tools", f"{where}.function.description must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object"}  # arguments are always an object, even when not described
    if not isinstance(parameters, dict):
        raise InvalidParameterError("tools", f"{where}.function.parameters must be a JSON schema object")
    if parameters.get("type", "object") != "object":  # (OpenAI's rule: a call's arguments are an object)
        raise InvalidParameterError("tools", f"{where}.function.parameters must describe an object (\"type\": "
                                             f"\"object\"), the call's arguments; got type {parameters['type']!r}")
    if "type" not in parameters:  # ({} or only properties: still arguments of an object)
        parameters = {"type": "object", **parameters}
    bad = unsupported_schema_keywords(parameters)
    if bad:
        raise InvalidParameterError("tools", f"{where}.function.parameters uses keywords this server cannot "
                                             f"enforce: {'; '.join(bad[:10])}")
    return Tool(name, description, parameters)


def as_structural_format(params: StructuredOutputsParams, param: str) -> dict[str, Any]:
    """A constraint as a structural-tag format, to sit beside calls or after reasoning
    (``param``: the request field an error names)."""
    from engine.sampling_params import parse_json_constraint
    from engine.structured_outputs import MAX_JSON_WHITESPACE, enforceable_schema

    kind = params.kind
    if kind == "json":
        return {"type": "json_schema", "json_schema": enforceable_schema(params.json, param),
                "max_whitespace_cnt": MAX_JSON_WHITESPACE}
    if kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
    if kind == "regex":
        return {"type": "regex", "pattern": params.regex}
    if kind == "grammar":
        return {"type": "grammar", "grammar": params.grammar}
    if kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in params.choice]}
    tag = parse_json_constraint(params.structural_tag, "structural_tag")
    if not isinstance(tag, dict) or not isinstance(tag.get("format"), dict):
        raise InvalidParameterError(param, "a structural_tag combines with tool calls or reasoning only when it has "
                                           "a format (a JSON schema, regex, choice or grammar always does)")
    return tag["format"]


# ---- the prompt ----

# Per template text (the server's, and requests' own where it trusts them): whether it renders
# tools; the most recent few, from the threads that render.
_TEMPLATE_RENDERS_TOOLS: OrderedDict[str, bool] = OrderedDict()
_TEMPLATES_KEPT = 64
_TEMPLATES_LOCK = threading.Lock()
_PROBE = "probe_function_7f3a"


def template_renders_tools(tokenizer, chat_template: str | None = None) -> bool:
    """Whether the chat template writes a ``tools`` list into the prompt (probed once per template)."""
    source = chat_template or tokenizer.get_chat_template()
    with _TEMPLATES_LOCK:
        known = _TEMPLATE_RENDERS_TOOLS.get(source)
        if known is not None:
            _TEMPLATE_RENDERS_TOOLS.move_to_end(source)
    if known is None:
        # (a tool as requests give them, description and parameters filled in: templates such
        # as Hermes' write `tool.description` and each property's, and fail where one is missing)
        probe = [Tool(_PROBE, "Looks a word up.", {"type": "object", "properties": {
            "word": {"type": "string", "description": "The word."}}, "required": ["word"]}).as_openai()]
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe, tokenize=False,
                                                 chat_template=chat_template, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
            text = ""
        known = _PROBE in text
        with _TEMPLATES_LOCK:
            _TEMPLATE_RENDERS_TOOLS[source] = known
            if len(_TEMPLATE_RENDERS_TOOLS) > _TEMPLATES_KEPT:
                _TEMPLATE_RENDERS_TOOLS.popitem(last=False)
    return known


def render_inputs(tokenizer, messages: list[Message], plan: ToolPlan | None, chat_template: str | None,
                  ) -> tuple[list[Message], dict[str, Any]]:
    """The conversation and extra template arguments for ``plan``'s tools and for any earlier
    calls and results in ``messages``; unchanged (and no template probe) when there are none."""
    if plan is None and not any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        return messages, {}
    return prepare_messages(messages, plan, template_renders_tools(tokenizer, chat_template))


def prepare_messages(messages: list[Message], plan: ToolPlan | None, renders_tools: bool,
                     ) -> tuple[list[Message], dict[str, Any]]:
    """The conversation and extra template arguments to render a request with tools (or with
    earlier tool calls and results in its history).

    Raises:
        InvalidParameterError: a malformed ``tool_calls`` entry (naming ``messages``).
    """
    if renders_tools:
        converted = [_with_argument_objects(m, i) for i, m in enumerate(messages)]
        tools = plan.in_prompt if plan is not None else ()
        return converted, ({"tools": [t.as_openai() for t in tools]} if tools else {})
    tools = plan.described if plan is not None else ()
    converted: list[Message] = []
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "tool":
            response = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if i and messages[i - 1]["role"] == "tool":  # results of one turn's calls: one user turn
                converted[-1]["content"] += "\n" + response
            else:
                converted.append({"role": "user", "content": response})
        elif role == "assistant" and message.get("tool_calls"):
            calls = [_call_text(call, i) for call in message["tool_calls"]]
            content = message.get("content") or ""
            converted.append({"role": "assistant", "content": "\n".join(([content] if content else []) + calls)})
        else:
            converted.append({k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")})
    if tools:
        block = _tools_system_text(tools)
        if converted and converted[0]["role"] == "system":
            converted[0] = {**converted[0], "content": f"{converted[0]['content']}\n\n{block}"}
        else:
            converted.insert(0, {"role": "system", "content": block})
    return converted, {}


def _tools_system_text(tools: Sequence[Tool]) -> str:
    listing = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return ("# Tools\n\n"
            "You can call functions to answer the user. They are listed below, one JSON object per line, "
            "between <tools> and </tools>:\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "To call a function, write its name and arguments as a JSON object between <tool_call> and "
            "</tool_call>:\n"
            '<tool_call>\n{"name": "function_name", "arguments": {"argument_name": "value"}}\n</tool_call>\n'
            "The results come back between <tool_response> and </tool_response>.")


def _call_function(call: Any, index: int) -> tuple[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, (str, dict)):
        raise InvalidParameterError("messages", f"messages[{index}].tool_calls entries are "
                                                '{"type": "function", "function": {"name": str, "arguments": str}}')
    return name, arguments


def _call_text(call: Any, index: int) -> str:
    """An earlier call as the model writes one (its arguments verbatim when they are JSON)."""
    name, arguments = _call_function(call, index)
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    else:
        try:
            json.loads(arguments)
        except ValueError:
            arguments = json.dumps(arguments, ensure_ascii=False)
    return f"{CALL_BEGIN}{name}{ARGUMENTS_BEGIN}{arguments}{CALL_END}"


def _with_argument_objects(message: Message, index: int) -> Message:
    """Templates that render calls write ``arguments | tojson``: give them objects, not JSON text."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        name, arguments = _call_function(call, index)
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        calls.append({**call, "function": {**call["function"], "arguments": arguments}})
    return {**message, "tool_calls": calls}


# ---- reading calls back ----

@attrs.frozen
class CallDelta:
    """New output of call ``index``: its id, type and name come once (first), then argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict[str, Any]:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@attrs.frozen
class ParsedDelta:
    """New content and call output; ``pieces`` is the same in the order it was written
    (content text and ``CallDelta`` values), for consumers that keep the two apart in order."""

    content: str = ""
    calls: tuple[CallDelta, ...] = ()
    pieces: tuple[str | CallDelta, ...] = ()


_IN_TEXT, _IN_NAME, _IN_ARGUMENTS = range(3)


class ToolCallParser:
    """Splits generated text into content and calls, as it streams (one parser per sequence).

    Feeding the whole text at once gives what the deltas add up to, so a stream and a single
    response agree byte for byte. Whitespace right before a call or after the last one
    separates calls and is not content. Text that may be the start of a call's framing is held
    back until it is known. A call cut off in its arguments keeps what it has (the response
    then says ``length``); one cut off before its name is complete is dropped.
    """

    def __init__(self, calls_only: bool = False) -> None:
        self.calls_only = calls_only  # the grammar allows calls alone (required, named): no text at all
        self._state = _IN_TEXT
        self._buffer = ""
        self._calls: list[dict[str, str]] = []  # {"id", "name", "arguments"}
        self._after_call = False  # whitespace here separates, and is not content
        self._has_content = False
        self._newline_due = False  # text after a call starts a new line of the content
        self.num_complete = 0

    @property
    def calls(self) -> list[dict[str, Any]]:
        """The calls so far in OpenAI's ``message.tool_calls`` shape."""
        return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in self._calls]

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        self._buffer += text
        pieces: list[str | CallDelta] = []
        while True:
            if self._state == _IN_TEXT:
                if self._after_call:
                    self._buffer = self._buffer.lstrip()
                    if not self._buffer:
                        break
                    self._after_call = False
                    self._newline_due = self._has_content
                at = self._buffer.find(CALL_BEGIN)
                if at < 0:
                    keep = _held_back(self._buffer, CALL_BEGIN, whitespace=not final)
                    if final:  # a call cut off in its framing is dropped, not shown as text
                        keep = keep if self.calls_only or keep >= len(_CALL_TAG) else 0
                    text_part = self._buffer[:len(self._buffer) - keep]
                    if final and (self._calls or keep):  # (whitespace before a call separates)
                        text_part = text_part.rstrip()
                    pieces.append(self._content(text_part))
                    self._buffer = "" if final else self._buffer[len(self._buffer) - keep:]
                    break
                pieces.append(self._content(self._buffer[:at].rstrip()))
                self._buffer = self._buffer[at + len(CALL_BEGIN):]
                self._state = _IN_NAME
            elif self._state == _IN_NAME:
                at = self._buffer.find(ARGUMENTS_BEGIN)
                if at < 0:
                    if final:
                        self._buffer = ""  # cut off inside the name: not a call
                    break
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "name": self._buffer[:at], "arguments": ""}
                self._calls.append(call)
                pieces.append(CallDelta(len(self._calls) - 1, "", call["id"], call["name"]))
                self._buffer = self._buffer[at + len(ARGUMENTS_BEGIN):]
                self._state = _IN_ARGUMENTS
            else:
                at = self._buffer.find(CALL_END)
                # At the end, a held-back start of the framing is dropped: a call cut off there
                # has its arguments whole.
                end = at if at >= 0 else len(self._buffer) - _held_back(self._buffer, CALL_END)
                if end:
                    self._calls[-1]["arguments"] += self._buffer[:end]
                    pieces.append(CallDelta(len(self._calls) - 1, self._buffer[:end]))
                if at < 0:
                    self._buffer = "" if final else self._buffer[end:]
                    break
                self._buffer = self._buffer[at + len(CALL_END):]
                self._state = _IN_TEXT
                self._after_call = True
                self.num_complete += 1
        content = "".join(p for p in pieces if isinstance(p, str))
        return ParsedDelta(content, _merge([p for p in pieces if isinstance(p, CallDelta)]), _merge(pieces))

    def _content(self, text: str) -> str:
        if text:
            if self._newline_due:
                text = "\n" + text
                self._newline_due = False
            self._has_content = True
        return text


def _held_back(text: str, marker: str, whitespace: bool = False) -> int:
    """How many characters at the end of ``text`` may begin ``marker`` (or, with
    ``whitespace``, are trailing whitespace before such a start), and so must wait."""
    keep = 0
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            keep = size
            break
    if whitespace:
        stripped = text[:len(text) - keep]
        keep += len(stripped) - len(stripped.rstrip())
    return keep


def _merge(pieces: list) -> tuple:
    """Pieces with neighbours of a kind joined: one delta per call (its header, if new, with
    all its new argument text), one string per run of content; empty text left out."""
    merged: list = []
    for piece in pieces:
        if isinstance(piece, str):
            if not piece:
                continue
            if merged and isinstance(merged[-1], str):
                merged[-1] += piece
                continue
        elif merged and isinstance(merged[-1], CallDelta) and merged[-1].index == piece.index:
            merged[-1] = attrs.evolve(merged[-1], arguments=merged[-1].arguments + piece.arguments)
            continue
        merged.append(piece)
    return tuple(merged)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The content (None if empty) and the calls of a whole generated text."""
    parser = ToolCallParser()
    content = parser.feed(text, final=True).content
    return content or None, parser.calls
