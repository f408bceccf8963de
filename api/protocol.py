"""Request bodies as attrs classes, structured from JSON with cattrs, and mapped to SamplingParams.

Types are checked strictly (a string is not an int, a float is not an int); cattrs' errors
name the failing field and become 400s. Range rules live in ``SamplingParams``. Unknown
fields are ignored, as OpenAI and vLLM do; fields this server cannot honour are rejected
by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Union, get_origin

import attrs
import cattrs
from cattrs.cols import list_structure_factory
from cattrs.gen import make_dict_structure_fn

from api.errors import APIError, bad_request, unsupported
from engine.errors import InvalidParameterError
from engine.frontend.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from engine.sampling_params import MAX_N_API, RequestOutputKind, SamplingParams, StructuredOutputsParams

StrOrList = Union[str, list[str], None]
# OpenAI's ReasoningEffort values; the chat template reads the one given ("none" turns thinking off).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
TokenPrompt = Union[str, list[str], list[int], list[list[int]]]


# What the hooks below accept, for the OpenAPI document (api.openapi).
_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 1}
_PROMPT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1},
                            _TOKEN_IDS_SCHEMA, {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1}]}
_CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
    "type": "object", "required": ["type"], "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}}]}


@attrs.frozen
class TextPart:
    """A content part: ``text``, or an assistant's ``refusal`` (read as its text, as vLLM does);
    other types are refused by name where the content is read (``engine.tokenizer.content_text``)."""

    type: str
    text: str | None = None
    refusal: str | None = None


@attrs.frozen
class ChatMessage:
    role: str
    content: Any = attrs.field(default=None, metadata={"schema": _CONTENT_SCHEMA})  # structured by a hook
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None  # an earlier turn's reasoning, for templates that render it (as
    reasoning_content: str | None = None  # responses carry it, or vLLM's older name)


@attrs.frozen
class StreamOptions:
    include_usage: bool = False
    continuous_usage_stats: bool = False


@attrs.frozen(kw_only=True)
class SamplingFields:
    """Fields common to chat and text completions (OpenAI's, then vLLM's extras).

    ``user`` is OpenAI's end-user label for abuse monitoring: accepted and not used, as in vLLM.
    """

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: StrOrList = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and the older
    # guided_* fields many clients still send (aliases; at most one constraint in all).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = attrs.field(default=None, metadata={"schema": {"anyOf": [{"type": "object"},
                                                                                {"type": "string"}]}})
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N"
    return_token_ids: bool = False  # choices carry token_ids, the response (or its first chunk) prompt_token_ids
    use_beam_search: bool = False  # n beams (engine/frontend/beam_search.py); see beam_search_params
    length_penalty: float = 1.0
    # vLLM's extras this server does not honour: accepted at their defaults, refused by name
    # otherwise (never ignored: a client that sets one relies on it).
    logits_processors: list[Any] | None = None

    def check_common(self) -> None:
        """Rules between fields that both endpoints share (as vLLM words them)."""
        if isinstance(self.n, int) and self.n > MAX_N_API:
            raise bad_request(f"n must be at most {MAX_N_API} (OpenAI's limit); got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options can only be set when stream is true", "stream_options")
        if self.stream and self.prompt_logprobs is not None:  # (0 too: the prompt's own tokens' logprobs)
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        for name, default in _NOT_HONOURED.items():
            if getattr(self, name) not in (default, None):
                raise unsupported(name, name)


_NOT_HONOURED = {"logits_processors": None}

# What beam search leaves at its neutral values (it scores raw log-probabilities and returns whole
# beams): each field, and the values that mean "not used".
_NOT_WITH_BEAM_SEARCH = {
    "stream": (False,), "stop": (None, [], ""), "presence_penalty": (0,), "frequency_penalty": (0,),
    "repetition_penalty": (None, 1), "top_p": (None, 1), "top_k": (None, 0, -1), "min_p": (None, 0),
    "logit_bias": (None, {}), "min_tokens": (0,), "prompt_logprobs": (None,), "logprobs": (None, False),
    "allowed_token_ids": (None,), "bad_words": (None, []), "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "tools": (None, []), "thinking_token_budget": (None,),
    "skip_special_tokens": (True,),
}


def beam_search_params(request: SamplingFields, max_tokens: int) -> BeamSearchParams | None:
    """The beam search a request asks for (``use_beam_search``: ``n`` beams, as vLLM), or None.
    ``max_tokens``: the request's, resolved.

    Raises:
        APIError: 400, a field beam search does not use (or ``length_penalty`` without it).
    """
    if not request.use_beam_search:
        if request.length_penalty != 1.0:
            raise bad_request("length_penalty applies only with use_beam_search", "length_penalty")
        return None
    for name, neutral in _NOT_WITH_BEAM_SEARCH.items():
        value = getattr(request, name, None)  # (False by identity: completions' logprobs 0 asks for logprobs)
        if not any(value is n if isinstance(n, bool) else value == n for n in neutral):
            raise bad_request(f"{name} is not available with use_beam_search", name)
    if not 1 <= request.n <= MAX_BEAM_WIDTH:
        raise bad_request(f"n (the number of beams) must be in [1, {MAX_BEAM_WIDTH}] with use_beam_search; "
                          f"got {request.n}", "n")
    try:
        return BeamSearchParams(beam_width=request.n, max_tokens=max_tokens, ignore_eos=request.ignore_eos,
                                temperature=1.0 if request.temperature is None else request.temperature,
                                length_penalty=request.length_penalty, stop_token_ids=request.stop_token_ids or [],
                                include_stop_str_in_output=request.include_stop_str_in_output,
                                cache_salt=request.cache_salt)
    except InvalidParameterError as exc:
        raise APIError(400, str(exc), exc.param) from None


@attrs.frozen(kw_only=True)
class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # (vLLM's; used where the server trusts requests' templates)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict] | None = None
    tool_choice: Any = attrs.field(default=None, metadata={"schema": {"anyOf": [
        {"type": "string", "enum": ["none", "auto", "required"]}, {"type": "object"}]}})
    parallel_tool_calls: bool = True
    # With --reasoning-parser (vLLM's names): most tokens the reasoning may take before it is
    # closed, and whether the response carries it.
    thinking_token_budget: int | None = None
    include_reasoning: bool = True
    reasoning_effort: str | None = attrs.field(default=None, metadata={"schema": {"enum": [*REASONING_EFFORTS, None]}})
    audio: Any = None
    modalities: list[str] | None = None
    add_special_tokens: bool = False  # (vLLM's: the tokenizer's BOS on top of what the template writes)
    documents: list[dict[str, str]] | None = None  # (vLLM's: for templates that cite them, RAG)
    # OpenAI's deprecated forms of tools and tool_choice: refused by name (a client sending them
    # relies on the model calling the functions; tools and tool_choice say the same).
    functions: list[dict] | None = None
    function_call: Any = attrs.field(default=None, metadata={"schema": {"anyOf": [{"type": "string"},
                                                                                  {"type": "object"}]}})

    def check_supported(self) -> None:
        self.check_common()
        if self.audio is not None:
            raise unsupported("audio", "audio output")
        if self.modalities and self.modalities != ["text"]:
            raise unsupported("modalities", f"output modalities {self.modalities!r} (only [\"text\"])")
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise unsupported(name, f"{name} (deprecated by OpenAI: use tools and tool_choice)")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if self.reasoning_effort not in (None, *REASONING_EFFORTS):
            raise bad_request(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; "
                              f"got {self.reasoning_effort!r}", "reasoning_effort")


@attrs.frozen(kw_only=True)
class CompletionRequest(SamplingFields):
    prompt: Any = attrs.field(metadata={"schema": _PROMPT_SCHEMA})  # TokenPrompt, structured by a hook
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # (vLLM's: the tokenizer's BOS and such on a text prompt)

    def check_supported(self) -> None:
        self.check_common()
        if self.suffix:
            raise unsupported("suffix", "suffix (insertion)")
        if isinstance(self.best_of, int) and isinstance(self.n, int) and self.best_of < self.n:
            raise bad_request(f"best_of must be at least n ({self.n}); got {self.best_of}", "best_of")
        if self.best_of not in (None, self.n):
            raise unsupported("best_of", "best_of other than n")


_INPUT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}


@attrs.frozen(kw_only=True)
class ResponsesRequest:
    """``POST /v1/responses`` (OpenAI's Responses API), served by translation to a chat
    completion (``api.responses``); vLLM's sampling extras are accepted as in chat."""

    model: str | None = None
    input: Any = attrs.field(metadata={"schema": _INPUT_SCHEMA})  # a string or input items
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: Any = attrs.field(default=None, metadata={"schema": {"anyOf": [
        {"type": "string", "enum": ["none", "auto", "required"]}, {"type": "object"}]}})
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    user: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    # vLLM's extras (as in chat completions)
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: int = 0
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_token_budget: int | None = None


@attrs.frozen(kw_only=True)
class TokenizeRequest:
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict] | None = None
    documents: list[dict[str, str]] | None = None
    add_special_tokens: bool | None = None  # (vLLM's defaults: true for a prompt, false for messages)
    add_generation_prompt: bool = True  # (these four: the messages' rendering, as for a chat completion)
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False  # each token's string too (vLLM's)


@attrs.frozen(kw_only=True)
class DetokenizeRequest:
    tokens: list[int]
    model: str | None = None


# ---- the converter ----

def _strict(kind: type, check) -> Any:
    def hook(value: Any, _type: Any) -> Any:
        if not check(value):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return kind(value)
    return hook


def _str_or_list(value: Any, _type: Any) -> StrOrList:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise TypeError("expected a string or a list of strings")


def _content(value: Any, _type: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        return [converter.structure(part, TextPart) for part in value]
    raise TypeError("expected a string or a list of content parts")


def _prompt(value: Any, _type: Any) -> Any:
    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str) or is_ids(value):
        return value
    if isinstance(value, list) and value and (all(isinstance(p, str) for p in value) or all(is_ids(p) for p in value)):
        return value
    raise TypeError("expected a string, a list of strings, a list of token ids or a list of token-id lists")


def _lists_only(list_type: Any) -> Any:
    """Structure a list field only from a JSON array: cattrs takes any iterable, so a string
    given for a list of strings became its letters ("bad_words": "apple" banned a, p, l, e)."""
    structure = list_structure_factory(list_type, converter)

    def hook(value: Any, _type: Any) -> Any:
        if not isinstance(value, list):
            raise TypeError(f"expected a list, got {type(value).__name__}")
        return structure(value, _type)
    return hook


def _objects_only(cls: type) -> Any:
    """Structure an attrs class only from a JSON object (cattrs would take any container,
    so a string or a list would silently become all defaults). A ``null`` for a field with a
    default is that default: OpenAI's schema marks such fields nullable (``n``, ``stream``,
    ``logprobs``, the penalties...), and vLLM reads them as Optional."""
    structure = make_dict_structure_fn(cls, converter)
    defaulted = frozenset(f.name for f in attrs.fields(cls) if f.default is not attrs.NOTHING and f.default is not None)

    def hook(value: Any, _type: Any) -> Any:
        if not isinstance(value, dict):
            raise TypeError(f"expected an object, got {type(value).__name__}")
        if None in value.values():
            value = {k: v for k, v in value.items() if v is not None or k not in defaulted}
        return structure(value, cls)
    return hook


converter = cattrs.Converter(forbid_extra_keys=False)
converter.register_structure_hook_factory(attrs.has, _objects_only)
converter.register_structure_hook_factory(lambda t: get_origin(t) is list, _lists_only)
converter.register_structure_hook(int, _strict(int, lambda v: isinstance(v, int) and not isinstance(v, bool)))
converter.register_structure_hook(float, _strict(float, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)))
converter.register_structure_hook(bool, _strict(bool, lambda v: isinstance(v, bool)))
converter.register_structure_hook(str, _strict(str, lambda v: isinstance(v, str)))
converter.register_structure_hook(StrOrList, _str_or_list)
converter.register_structure_hook_func(lambda t: t is Any, lambda v, _t: v)


def parse(body: Any, cls: type) -> Any:
    """Structure a parsed JSON body into ``cls``, turning type errors into a 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        request = converter.structure(body, cls)
    except cattrs.BaseValidationError as exc:
        message = "; ".join(cattrs.transform_error(exc, path="body"))
        raise bad_request(f"invalid request: {message}", _first_param(message)) from None
    fields = attrs.fields_dict(cls)
    if "messages" in fields and request.messages is not None:
        request = attrs.evolve(request, messages=[attrs.evolve(m, content=_structured(_content, m.content, "messages"))
                                                  for m in request.messages])
    if "prompt" in fields and cls is CompletionRequest:
        request = attrs.evolve(request, prompt=_structured(_prompt, request.prompt, "prompt"))
    return request


def _structured(hook, value: Any, param: str) -> Any:
    try:
        return hook(value, None)
    except (TypeError, cattrs.BaseValidationError) as exc:
        raise bad_request(f"invalid request: {param}: {exc}", param) from None


def _first_param(message: str) -> str | None:
    match = re.search(r"@ body\.([A-Za-z_]+)", message)
    return match.group(1) if match else None


# ---- structured outputs ----

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KEYS = frozenset(attrs.fields_dict(StructuredOutputsParams))


def structured_outputs(request: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field it came from (for error messages).

    Raises:
        APIError: 400 for a malformed constraint, or more than one.
    """
    found: list[tuple[str, dict[str, Any]]] = []
    if request.response_format is not None:
        fields = _response_format(request.response_format)
        if fields is not None:
            found.append(("response_format", fields))
    if request.structured_outputs is not None:
        unknown = set(request.structured_outputs) - _STRUCTURED_KEYS
        if unknown:
            raise bad_request(f"structured_outputs has unknown fields: {', '.join(sorted(unknown))} (known: "
                              f"{', '.join(sorted(_STRUCTURED_KEYS))})", "structured_outputs")
        found.append(("structured_outputs", dict(request.structured_outputs)))
    for name, key in _GUIDED.items():
        value = getattr(request, name)
        if value is not None:
            found.append((name, {key: value}))
    if request.guided_decoding_backend not in (None, "xgrammar", "auto"):
        raise unsupported("guided_decoding_backend", f"guided_decoding_backend {request.guided_decoding_backend!r} "
                                                     f"(this server uses xgrammar)")
    if request.guided_whitespace_pattern is not None:
        raise unsupported("guided_whitespace_pattern", "guided_whitespace_pattern (xgrammar has none; "
                                                       "structured_outputs' disable_any_whitespace gives compact JSON)")
    if not found:
        return None, None
    if len(found) > 1:
        raise bad_request(f"give one output constraint; got {', '.join(name for name, _ in found)}", found[1][0])
    source, fields = found[0]
    try:
        return StructuredOutputsParams(**fields), source
    except (InvalidParameterError, TypeError) as exc:  # TypeError: an unknown or missing field
        raise bad_request(f"{source}: {exc}", source) from None


def _response_format(value: dict[str, Any]) -> dict[str, Any] | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad_request("response_format of type 'json_schema' needs json_schema.schema, a JSON schema object",
                              "response_format")
        if not isinstance(spec.get("name"), str) or not isinstance(spec.get("strict", False), (bool, type(None))):
            raise bad_request("response_format.json_schema needs a name (a string); strict must be a boolean",
                              "response_format")
        return {"json": spec["schema"]}  # strict or not, the schema is enforced
    raise bad_request(f"response_format type must be 'text', 'json_object' or 'json_schema'; got {kind!r}",
                      "response_format")


# ---- to SamplingParams ----

_API_NAMES = {"logprobs": "top_logprobs"}  # our parameter name -> the chat API's, where they differ


def scoring_only(request: CompletionRequest) -> bool:
    """An echo of ``max_tokens`` 0: the prompt back, with its logprobs where asked, and nothing
    generated (OpenAI's legacy completions; how lm-evaluation-harness scores a text)."""
    return request.echo and request.max_tokens == 0


def in_request_terms(exc: InvalidParameterError, request: ChatCompletionRequest | CompletionRequest,
                     chat: bool) -> InvalidParameterError:
    """An engine error about a parameter, naming the field the request gave it by (a chat
    request's ``top_logprobs``, its ``messages`` for the prompt they render, or
    ``max_completion_tokens`` where it set that)."""
    if not chat:
        return exc
    names = dict(_API_NAMES, max_tokens="max_completion_tokens") if request.max_completion_tokens is not None \
        else _API_NAMES
    if exc.param == "prompt":  # (the message says "the prompt": the messages rendered, as it is)
        return InvalidParameterError("messages", str(exc))
    param = names.get(exc.param, exc.param)
    return exc if param == exc.param else InvalidParameterError(param, str(exc).replace(exc.param, param, 1))


def sampling_params(request: ChatCompletionRequest | CompletionRequest, *, chat: bool,
                    defaults: Mapping[str, float] | None = None) -> SamplingParams:
    """The engine's parameters for a request; range errors become 400s naming the API field.
    ``defaults`` (the model's generation_config.json) fill the sampling values it leaves unset."""
    defaults = defaults or {}

    def value(name: str, fallback: float) -> float:
        given = getattr(request, name)
        return defaults.get(name, fallback) if given is None else given

    if chat:
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    else:
        logprobs = request.logprobs
        max_tokens = request.max_tokens if request.max_tokens is not None else 16  # OpenAI's completions default
        if max_tokens == 0 and request.echo:  # (the prompt scored: the engine's one token is dropped, scoring_only)
            max_tokens = 1
    fields = dict(
        n=request.n, presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
        temperature=value("temperature", 1.0), top_p=value("top_p", 1.0), top_k=value("top_k", 0),
        min_p=value("min_p", 0.0), repetition_penalty=value("repetition_penalty", 1.0),
        seed=request.seed, stop=request.stop,
        stop_token_ids=request.stop_token_ids, include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos, max_tokens=max_tokens,
        min_tokens=request.min_tokens, logprobs=logprobs, prompt_logprobs=request.prompt_logprobs,
        logit_bias=request.logit_bias, allowed_token_ids=request.allowed_token_ids, bad_words=request.bad_words,
        truncate_prompt_tokens=request.truncate_prompt_tokens, skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens, cache_salt=request.cache_salt,
        output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
        structured_outputs=structured_outputs(request)[0],
    )
    try:
        return SamplingParams(**fields)
    except InvalidParameterError as exc:
        named = in_request_terms(exc, request, chat)
        raise APIError(400, str(named), named.param) from None
