"""OpenAI's Responses API (``POST /v1/responses``), served by translation to a chat completion.

A request becomes a chat request (``chat_body``): ``instructions`` a system message, the input
items messages (``function_call`` items an assistant turn's tool calls, ``function_call_output``
items tool results, ``reasoning`` items the reasoning of the assistant turn they precede),
function tools and ``text.format`` their chat forms. It is then prepared and generated as
any chat completion, so the same request gives the same text through either API.

The output comes back as items (``ResponseBuilder``): a ``reasoning`` item (with a reasoning
parser), a ``message`` with its ``output_text``, and one ``function_call`` item per call, in
the order the model wrote them. Streamed, each item is announced, written in deltas and
closed (``response.output_item.added`` ... ``response.output_item.done``) between
``response.created``/``response.in_progress`` and ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it off), every event numbered.

Stateless unless the server keeps a ``ResponseStore`` (``--enable-responses-store``): then a
response is stored (``store``, true by default as in OpenAI's API) with the conversation it
ends, ``previous_response_id`` continues that conversation, and ``GET``/``DELETE
/v1/responses/{id}`` read and forget it. The store is bounded; the oldest go first.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Any

import attrs
import orjson

from api.errors import APIError, bad_request, unsupported
from api.protocol import REASONING_EFFORTS, ResponsesRequest
from api.serving import SplitDelta

# Input item types this server reads (all text); anything else is a 400 naming it.
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_ROLES = ("user", "assistant", "system", "developer")
# OpenAI's IncludeEnum: the rest name output of tools this server does not run, so there is
# nothing to add for them (as OpenAI answers a request without those tools).
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs")
# Where a chat field's error is a Responses field's.
_PARAM_NAMES = {"messages": "input", "prompt": "input", "max_completion_tokens": "max_output_tokens",
                "response_format": "text", "max_tokens": "max_output_tokens", "reasoning_effort": "reasoning"}
_MESSAGE_NAMES = {"response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the request ----

def check_request(req: ResponsesRequest, store: ResponseStore | None, reasoning_parser_on: bool) -> None:
    """Refuse, by name, what this server does not do (before any work)."""
    if req.background:
        raise unsupported("background", "background responses")
    if req.conversation is not None:
        raise unsupported("conversation", "conversation objects (send the history as input items, or use "
                                          "previous_response_id with --enable-responses-store)")
    if req.prompt is not None:
        raise unsupported("prompt", "stored prompt templates")
    if req.truncation not in (None, "disabled"):
        raise unsupported("truncation", f"truncation {req.truncation!r}")
    for value in req.include or ():
        if value not in INCLUDABLE:
            raise bad_request(f"include: unknown value {value!r} (OpenAI's are {', '.join(INCLUDABLE)})", "include")
        if value == "message.output_text.logprobs":
            raise unsupported("include", "message.output_text.logprobs")
    if req.top_logprobs:
        raise unsupported("top_logprobs", "top_logprobs in responses")
    if store is None:
        if req.store:
            raise bad_request("store: true needs the responses store: start the server with "
                              "--enable-responses-store (this server is stateless)", "store")
        if req.previous_response_id is not None:
            raise bad_request("previous_response_id needs the responses store: start the server with "
                              "--enable-responses-store, or send the conversation as input items",
                              "previous_response_id")
    _check_metadata(req.metadata)
    for where, key, allowed in (("reasoning", "summary", ("auto", "concise", "detailed")),
                                ("text", "verbosity", ("low", "medium", "high"))):
        value = (getattr(req, where) or {}).get(key)
        if value not in (None, *allowed):
            raise bad_request(f"{where}.{key} must be one of {', '.join(allowed)}; got {value!r}", where)
    for index, tool in enumerate(req.tools or ()):
        strict = tool.get("strict") if isinstance(tool, dict) else None
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"tools[{index}].strict must be a boolean or null; got {strict!r}", "tools")
    effort = (req.reasoning or {}).get("effort")
    if effort not in (None, *REASONING_EFFORTS):
        raise bad_request(f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}; got {effort!r}",
                          "reasoning")
    if effort not in (None, "none", "minimal") and not reasoning_parser_on:
        raise bad_request("reasoning needs a reasoning parser: start the server with --reasoning-parser",
                          "reasoning")


# OpenAI's bounds on metadata (a stored response keeps it).
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise bad_request(f"metadata holds at most {MAX_METADATA_PAIRS} pairs; got {len(metadata)}", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise bad_request(f"metadata keys are at most {MAX_METADATA_KEY} characters; {key[:16]!r}... has "
                              f"{len(key)}", "metadata")
        if len(value) > MAX_METADATA_VALUE:
            raise bad_request(f"metadata values are at most {MAX_METADATA_VALUE} characters; the value of {key!r} "
                              f"has {len(value)}", "metadata")


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat completion request (as JSON) that serves ``req``, and the conversation it sends
    (``history`` then the input, without the instructions: what a stored response continues)."""
    conversation = [*history, *input_messages(req.input)]
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body: dict[str, Any] = {
        "messages": messages, "stream": req.stream, "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "top_k": req.top_k, "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty, "priority": req.priority, "user": req.user,
        "chat_template_kwargs": req.chat_template_kwargs, "thinking_token_budget": req.thinking_token_budget,
        "reasoning_effort": (req.reasoning or {}).get("effort"),
    }
    if req.model is not None:
        body["model"] = req.model
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [_chat_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None and (req.tools or req.tool_choice not in ("auto", "none")):
        # (auto is the Responses API's default, which a response echoes: sent back with no tools,
        # it means none, as OpenAI takes it; chat refuses a tool_choice without tools)
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    format_ = (req.text or {}).get("format")
    if format_ is not None:
        body["response_format"] = _chat_response_format(format_)
    return {k: v for k, v in body.items() if v is not None}, conversation


def chat_param(param: str | None) -> str | None:
    """The Responses field a chat field's error is about."""
    return _PARAM_NAMES.get(param, param) if param else param


def in_responses_terms(message: str, param: str | None) -> str:
    """An error message about a chat field, naming the Responses field instead (the field
    within it where that is one: ``text.format``, ``reasoning.effort``), and a function tool
    or named tool_choice in the Responses shape (flat: no ``function`` object)."""
    name = _MESSAGE_NAMES.get(param, chat_param(param)) if param else param
    if param in ("tools", "tool_choice"):
        for chat, flat in _FLAT_TOOLS:
            message = message.replace(chat, flat)
    return message.replace(param, name, 1) if param and name != param else message


# A chat tool's or named tool_choice's words in an error, and a Responses one's.
_FLAT_TOOLS = (('{"type": "function", "function": {"name": "..."}}', '{"type": "function", "name": "..."}'),
               ('{"type": "function", "function": {...}}', '{"type": "function", "name": ...}'),
               (".function.", "."))


def input_messages(value: Any) -> list[dict[str, Any]]:
    """Chat messages of a Responses ``input``: a string (one user message) or a list of items."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request("input must be a string or a list of input items", "input")
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # of the assistant turn that comes next
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object (an input item)", "input")
        if not isinstance(item.get("id"), str | None):  # (kept: GET .../input_items lists it)
            raise bad_request(f"{where}.id must be a string; got {item['id']!r}", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            _add_message(messages, item, where, reasoning)
            reasoning = None  # (each takes the reasoning before it)
        elif kind == "function_call":
            _add_call(messages, item, where, reasoning)
            reasoning = None
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise bad_request(f"{where}: a function_call_output item needs its call_id (a string)", "input")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text(parts, f"{where}.content")
        elif kind == "item_reference":
            raise unsupported("input", f"{where}: item_reference items (send the item itself)")
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported; this server reads "
                              f"{', '.join(INPUT_ITEM_TYPES)}", "input")
    if not messages:
        raise bad_request("input must hold at least one message or function call output", "input")
    return messages


def _add_message(messages: list[dict[str, Any]], item: dict[str, Any], where: str, reasoning: str | None) -> None:
    """A message item onto the chat ``messages``, with the ``reasoning`` item that came before it."""
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}; got {role!r}", "input")
    if role != "assistant" and reasoning is not None:  # (an answer cut off while it reasoned)
        messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
        reasoning = None
    text = _text(item.get("content"), f"{where}.content")
    last = messages[-1] if messages else None
    if role == "assistant" and reasoning is None and last is not None and last.get("tool_calls") \
            and last["role"] == "assistant":
        last["content"] = _after(last, text)  # text after its calls: the same turn, as a response's
        return
    message = {"role": role, "content": text}
    if role == "assistant" and reasoning is not None:
        message["reasoning_content"] = reasoning
    messages.append(message)


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str, reasoning: str | None) -> None:
    """A function_call item onto the chat ``messages``: a call of the assistant turn before it,
    or of a new one (with the ``reasoning`` item that came before it)."""
    name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
    if not all(isinstance(v, str) for v in (name, arguments, call_id)):
        raise bad_request(f"{where}: a function_call item needs call_id, name and arguments (strings)", "input")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and reasoning is None:
        last.setdefault("tool_calls", []).append(call)  # the same turn as its text or other calls
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        if reasoning is not None:
            messages[-1]["reasoning_content"] = reasoning


def _after(turn: dict[str, Any], text: str) -> str:
    """An assistant turn's content with ``text`` that came after its calls: the newline that
    joins them in chat's one content (a message item after a call starts without it)."""
    return turn["content"] + ("\n" if turn["content"] and turn.get("tool_calls") else "") + text


def _text(content: Any, where: str) -> str:
    """The text of a content value: a string, or text parts (images and files are refused)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"  # (an assistant's refusal reads as its text)
        if kind not in (*_TEXT_PARTS, "refusal") or not isinstance(part.get(key), str):
            if kind in ("input_image", "input_file", "input_audio"):
                raise unsupported("input", f"{where}[{j}]: content of type {kind!r} (text only)")
            raise bad_request(f"{where}[{j}] must be a text part ({{\"type\": \"input_text\", \"text\": ...}}); "
                              f"got type {kind!r}", "input")
        texts.append(part[key])
    return "\n".join(texts)  # (one per line, as chat messages' text parts: engine.tokenizer.content_text)


def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool; other tool types are refused."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise unsupported("tools", f"tools[{index}]: tools of type {kind!r} (function tools only)")
    function = {"name": tool.get("name"), "parameters": tool.get("parameters")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and not isinstance(choice.get("type"), str):
        raise bad_request(f"a tool_choice object needs a type; got {choice!r}", "tool_choice")
    if isinstance(choice, dict):
        raise unsupported("tool_choice", f"tool_choice of type {choice.get('type')!r}")
    return choice  # none / auto / required (checked with the chat request)


def _chat_response_format(format_: Any) -> dict[str, Any]:
    kind = format_.get("type") if isinstance(format_, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(format_.get("name"), str) or not isinstance(format_.get("schema"), dict):
            raise bad_request("text.format of type 'json_schema' needs a name (a string) and a schema (a JSON "
                              "schema object)", "text")
        spec = {k: format_[k] for k in ("name", "schema", "strict", "description") if k in format_}
        return {"type": "json_schema", "json_schema": spec}
    got = repr(kind) if isinstance(format_, dict) else f"{format_!r} (text.format is an object with a type)"
    raise bad_request(f"text.format type must be 'text', 'json_object' or 'json_schema'; got {got}", "text")


# ---- the response ----

@attrs.define
class ResponseBuilder:
    """A response's output items, built from its output as it streams, and the events that
    announce them (``sequence_number`` counts every event of the stream)."""

    head: dict[str, Any]  # the response's fields other than status, output and usage
    items: list[dict[str, Any]] = attrs.field(factory=list)
    _open: dict[str, Any] | None = None  # the item being written
    _sequence: int = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, **fields, "sequence_number": self._sequence}
        self._sequence += 1
        return event

    def response(self, status: str, usage: dict | None = None, incomplete: str | None = None) -> dict[str, Any]:
        body = {**self.head, "status": status, "output": [dict(item) for item in self.items],
                "incomplete_details": {"reason": incomplete} if incomplete else None}
        if usage is not None:  # (not while in progress)
            body["usage"] = usage
        if status == "completed":
            body["completed_at"] = int(time.time())
        body["output_text"] = "".join(part["text"] for item in self.items if item["type"] == "message"
                                      for part in item["content"])
        return body

    def fail(self, error: APIError) -> list[dict[str, Any]]:
        """The events that end a stream which failed once begun: ``error``, then
        ``response.failed`` with what had been written (the open item left incomplete)."""
        body = error.body()["error"]
        events = [self.event("error", code=body["code"], message=body["message"], param=chat_param(body["param"]))]
        if self._open is not None:
            self._open["status"] = "incomplete"
            self._open = None
        response = self.response("failed")
        code = "invalid_prompt" if error.status == 400 else (
            "rate_limit_exceeded" if error.code == "overloaded" else "server_error")
        response["error"] = {"code": code, "message": body["message"]}
        events.append(self.event("response.failed", response=response))
        return events

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response("in_progress")
        return [self.event("response.created", response=snapshot),
                self.event("response.in_progress", response=snapshot)]

    def feed(self, split: SplitDelta) -> list[dict[str, Any]]:
        """The events of new output (reasoning, content, calls, in the order written)."""
        events: list[dict[str, Any]] = []
        if split.reasoning:
            events += self._write("reasoning", split.reasoning)
        for piece in split.pieces:
            if isinstance(piece, str):
                if self._open is not None and self._open["type"] == "function_call":
                    # (the newline that joins text after a call in chat's one content is no part
                    # of a message item of its own)
                    piece = piece.removeprefix("\n")
                if piece:
                    events += self._write("message", piece)
                continue
            call = piece
            if call.name is not None:
                events += self._close()
                item = {"type": "function_call", "id": _item_id("fc"), "call_id": call.id, "name": call.name,
                        "arguments": "", "status": "in_progress"}
                events += self._add(item)
            if call.arguments:
                self._open["arguments"] += call.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                                         output_index=len(self.items) - 1, delta=call.arguments))
        return events

    def finish(self, usage: dict, cut_off: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The finished response and its last events; ``cut_off``: max_output_tokens ended it."""
        events: list[dict[str, Any]] = []
        if not self.items:
            events += self._write("message", "")  # an answer, even an empty one
        events += self._close("incomplete" if cut_off else "completed")
        status = "incomplete" if cut_off else "completed"
        response = self.response(status, usage, "max_output_tokens" if cut_off else None)
        events.append(self.event(f"response.{status}", response=response))
        return response, events

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            if kind == "reasoning":
                item = {"type": "reasoning", "id": _item_id("rs"), "summary": [], "content": [],
                        "status": "in_progress"}
            else:
                item = {"type": "message", "id": _item_id("msg"), "role": "assistant", "content": [],
                        "status": "in_progress"}
            events += self._add(item)
            part = _part(kind, "")
            events.append(self.event("response.content_part.added", **self._at(), part=part))
            item["content"].append(part)
        if not text:  # (an empty answer: its item and part, no empty delta)
            return events
        content = self._open["content"]
        content[0] = _part(kind, content[0]["text"] + text)  # (replaced: the events keep what they said)
        if kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", **self._at(), delta=text))
        else:
            events.append(self.event("response.output_text.delta", **self._at(), delta=text, logprobs=[]))
        return events

    def _at(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = item
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=_copy(item))]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        events = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], name=item["name"],
                                     output_index=len(self.items) - 1, arguments=item["arguments"]))
        else:
            part = item["content"][0]
            at = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
            if item["type"] == "reasoning":
                events.append(self.event("response.reasoning_text.done", **at, text=part["text"]))
            else:
                events.append(self.event("response.output_text.done", **at, text=part["text"], logprobs=[]))
            events.append(self.event("response.content_part.done", **at, part=dict(part)))
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=len(self.items) - 1, item=_copy(item)))
        return events


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return orjson.loads(orjson.dumps(item))


def response_head(req: ResponsesRequest, response_id: str, model: str, stored: bool) -> dict[str, Any]:
    """The fields of a response that come from its request."""
    head = {
        "id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
        "error": None, "instructions": req.instructions, "metadata": req.metadata or {},
        "tools": [_response_tool(t) for t in req.tools or []],
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature, "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens, "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning, "store": stored,
        "text": {**(req.text or {}), "format": (req.text or {}).get("format") or {"type": "text"}},
        "truncation": "disabled", "background": False,
    }
    if req.user is not None:
        head["user"] = req.user
    return head


def _response_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as a response describes it (its parameters are always enforced: strict)."""
    return {"type": "function", "name": tool["name"], "description": tool.get("description"),
            "parameters": tool.get("parameters") or {"type": "object"},
            "strict": tool.get("strict") if tool.get("strict") is not None else True}


def responses_usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Chat usage in the Responses API's words."""
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            # (cache writes are not counted apart here)
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": chat_usage["total_tokens"]}


def output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the assistant turn of a chat conversation (what a later
    response continues)."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "reasoning":
            message["reasoning_content"] = item["content"][0]["text"] if item["content"] else ""
        elif item["type"] == "message":
            message["content"] = _after(message, item["content"][0]["text"])
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
    return [message]


def sse_event(event: dict[str, Any]) -> bytes:
    """One event of a Responses stream (named, as OpenAI sends them)."""
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


# ---- the store ----

@attrs.frozen
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # the chat messages it ends, its own output included
    input_items: list[dict[str, Any]] = attrs.field(factory=list)  # its request's input, as items with ids


_ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_item_resources(value: Any) -> list[dict[str, Any]]:
    """A request's input as the items ``GET /v1/responses/{id}/input_items`` lists (OpenAI's
    ItemResource): a string as one user message, a message's string content as one text part,
    an item without an id given one, without a status "completed" (the input was checked when
    it was read)."""
    items = [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value
    resources = []
    for given in items:
        item = _copy(given)
        kind = item.setdefault("type", "message")
        if kind == "message" and isinstance(item.get("content"), str | None):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item.get("content") or ""}]
        if kind == "message":
            item["content"] = [_resource_part(part, item.get("role")) for part in item["content"]]
        if kind == "reasoning" and item.get("summary") is None:  # (sent back with its content alone)
            item["summary"] = []
        if item.get("id") is None:  # (absent or null: a listed item always has one)
            item["id"] = _item_id(_ITEM_PREFIXES.get(kind, "item"))
        if item.get("status") is None:
            item["status"] = "completed"
        resources.append(item)
    return resources


def _resource_part(part: dict[str, Any], role: str | None) -> dict[str, Any]:
    """A text part as OpenAI lists it: an assistant's output_text (annotations and logprobs
    always there), anyone else's input_text, whichever of the text types it was sent as."""
    if part.get("type") not in ("text", "input_text", "output_text"):
        return part
    if role != "assistant":
        return {"type": "input_text", "text": part.get("text", "")}
    return {**part, "type": "output_text", "annotations": part.get("annotations") or [],
            "logprobs": part.get("logprobs") or []}


def item_page(items: list[dict[str, Any]], limit: int, order: str, after: str | None) -> dict[str, Any]:
    """One page of a list of items, as OpenAI's list endpoints give it (newest first for ``desc``)."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad_request(f"after: no input item with id {after!r} in this response", "after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}


class ResponseStore:
    """Responses kept in memory for ``previous_response_id`` and ``GET``/``DELETE``: at most
    ``capacity``, the oldest forgotten first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("the responses store holds at least one response")
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> None:
        self._responses[stored.response["id"]] = stored
        self._responses.move_to_end(stored.response["id"])
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        stored = self._responses.get(response_id)
        if stored is None:
            raise APIError(404, f"no response with id {response_id!r} is stored here (it was never stored, was "
                                f"deleted, or was evicted)", code="response_not_found")
        return stored

    def previous(self, response_id: str) -> StoredResponse:
        """The response a request continues; one not here is OpenAI's 400 with code
        previous_response_not_found (what agents' clients answer by sending the whole
        conversation again: with a bounded store, expect it)."""
        stored = self._responses.get(response_id)
        if stored is None:
            raise APIError(400, f"Previous response with id {response_id!r} not found (never stored here, "
                                f"deleted, or evicted).", "previous_response_id", code="previous_response_not_found")
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._responses[response_id]
