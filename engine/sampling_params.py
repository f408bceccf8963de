"""``SamplingParams``: how to pick each next token and when to stop (names and defaults as in vLLM)."""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from typing import Any

import attrs

from engine.errors import InvalidParameterError

# The most alternatives a caller may ask for per position (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20
# Seeds are signed 64-bit integers, as in OpenAI's API description; so is every other integer of
# a request (a larger one cannot cross the wire to an engine process: it was refused there).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MIN_SEED, MAX_SEED = INT64_MIN, INT64_MAX
# Bounds on what one request may ask for, so that no single request can flood the engine:
# completions per request (vLLM's VLLM_MAX_N_SEQUENCES; the HTTP API holds n to OpenAI's 128,
# and a server queues at most max_waiting_requests), and stop strings (each is searched for,
# in the event loop, after every token of every completion).
MAX_N = 16384
MAX_N_API = 128
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 256
# bad_words: each word is banned as two token sequences (with and without a leading space),
# matched against the output after every token.
MAX_BAD_WORDS = 128


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a stream carries (as in vLLM)."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes


def _check(param: str, ok: bool, message: str) -> None:
    if not ok:
        raise InvalidParameterError(param, f"{param} {message}")


def is_int64(value: Any) -> bool:
    """An integer (not a bool) of 64 bits."""
    return isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _list_of(param: str, *, optional: bool = False, text: bool = False) -> Callable[[Any], list | None]:
    """A converter to a list: None is empty (None where ``optional``), a lone string a list of
    it where ``text``; a value that is no sequence at all is an error naming ``param``."""
    def convert(value: Any) -> list | None:
        if value is None:
            return None if optional else []
        if text and isinstance(value, str):
            return [value]
        try:
            return list(value)
        except TypeError:
            raise InvalidParameterError(param, f"{param} must be a list; got {value!r}") from None

    return convert


def _to_seed(value: Any) -> Any:
    return None if value == -1 and is_int64(value) else value  # (-1: no seed, as vLLM)


def _to_count(value: Any) -> Any:
    return 1 if value is True else value  # (logprobs=True: the sampled token's, as vLLM)


def _to_sequences(value: Any) -> list[list[int]] | None:
    return None if value is None else [list(ids) for ids in value]


def _to_bias(value: dict | None) -> dict[int, float]:
    if not value:
        return {}
    try:
        return {int(k): v for k, v in value.items()}
    except (TypeError, ValueError, AttributeError):
        raise InvalidParameterError("logit_bias", "logit_bias must map token ids to numbers") from None


PARAM_STRUCTURED = "structured_outputs"
STRUCTURED_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@attrs.frozen(kw_only=True)
class StructuredOutputsParams:
    """Exactly one constraint, plus options (names as in vLLM).

    Attributes:
        json: a JSON schema (dict or its JSON text); the output is a JSON value valid against it.
        regex: the whole output matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's GBNF dialect, root rule ``root``).
        json_object: the output is any JSON object.
        structural_tag: xgrammar's structural tag (dict or JSON text).
        disable_any_whitespace: JSON without free whitespace (compact separators ``,`` and ``:``
            followed by one space, as xgrammar writes them).
        disable_additional_properties: objects take no properties beyond those of their
            schema. Always true here: the schema is enforced strictly.
        whitespace_pattern: not supported by the xgrammar backend (a 400, never ignored).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __attrs_post_init__(self) -> None:
        given = [name for name in STRUCTURED_CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameterError(PARAM_STRUCTURED, f"give exactly one of {', '.join(STRUCTURED_CONSTRAINTS)}; got "
                                               f"{', '.join(given) if given else 'none'}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidParameterError(PARAM_STRUCTURED, f"{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidParameterError(PARAM_STRUCTURED, "choice must be a non-empty list of non-empty strings")
        if self.json_object not in (None, True, False):
            raise InvalidParameterError(PARAM_STRUCTURED, "json_object must be a boolean")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, dict)):
                raise InvalidParameterError(PARAM_STRUCTURED, f"{name} must be an object or its JSON text")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(PARAM_STRUCTURED, f"{name} must be a boolean")
        if self.whitespace_pattern is not None:
            raise InvalidParameterError(PARAM_STRUCTURED, "whitespace_pattern is not supported by the xgrammar backend "
                                               "(use disable_any_whitespace for compact JSON)")

    @property
    def kind(self) -> str:
        return next(name for name in STRUCTURED_CONSTRAINTS if getattr(self, name) not in (None, False))

    def key(self) -> str:
        """The constraint in canonical form: equal for equal constraints (the cache key)."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "structural_tag"):
            value = parse_json_constraint(value, self.kind)
        return json.dumps([self.kind, value, self.disable_any_whitespace], sort_keys=True, ensure_ascii=False)


def parse_json_constraint(value: str | dict, name: str) -> Any:
    if isinstance(value, dict):
        return value
    try:
        return json.loads(value)
    except ValueError as exc:
        raise InvalidParameterError(PARAM_STRUCTURED, f"{name} is not valid JSON: {exc}") from None


def _checked(instance: SamplingParams, attribute: attrs.Attribute, value: Any) -> Any:
    """A field set after construction is checked with all the others first: a bad value is
    refused and leaves the parameters as they were."""
    attrs.evolve(instance, **{attribute.alias: value})
    return value


@attrs.define(kw_only=True, on_setattr=[attrs.setters.convert, _checked])
class SamplingParams:
    """Sampling and stopping parameters of one request.

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 means no top-k cut. Penalties and
    ``logit_bias`` apply before temperature; ``logprobs`` report the model's raw
    log-probabilities (before any of them), as vLLM does by default.

    Mutable, as vLLM's (``params.max_tokens = 64`` is checked as the constructor checks); the
    engine takes its own copy of a request's parameters when the request is queued, so a
    change never reaches a request already queued. ``clone()`` copies.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = attrs.field(default=None, converter=_to_seed)
    stop: list[str] = attrs.field(factory=list, converter=_list_of("stop", text=True))
    stop_token_ids: list[int] = attrs.field(factory=list, converter=_list_of("stop_token_ids"))
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = attrs.field(default=None, converter=_to_count)
    prompt_logprobs: int | None = attrs.field(default=None, converter=_to_count)
    logit_bias: dict[int, float] = attrs.field(factory=dict, converter=_to_bias)
    # vLLM's token restrictions: only ``allowed_token_ids`` may be sampled; no ``bad_words``
    # may appear in the output. The engine tokenizes each bad word into
    # ``bad_words_token_ids`` (``with_bad_words_tokenized``): callers leave that None.
    allowed_token_ids: list[int] | None = attrs.field(default=None,
                                                    converter=_list_of("allowed_token_ids", optional=True))
    bad_words: list[str] = attrs.field(factory=list, converter=_list_of("bad_words", text=True))
    bad_words_token_ids: list[list[int]] | None = attrs.field(default=None, converter=_to_sequences)
    # Keep only the prompt's last this many tokens (-1: as many as max_model_len), as vLLM.
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Requests share prefix-cache blocks only with requests of the same salt (vLLM's
    # cache_salt: one per tenant keeps tenants' prompts from probing each other's cache).
    cache_salt: str | None = None
    # A constraint on the output (JSON schema, regex, choice, grammar), as in vLLM.
    structured_outputs: StructuredOutputsParams | None = None

    def __attrs_post_init__(self) -> None:
        self._check_kinds()
        self._check_counts()
        self._check_probabilities()
        self._check_stops()
        self._check_restrictions()
        self._check_truncation()
        self._check_salt()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidParameterError(PARAM_STRUCTURED, "structured_outputs must be a StructuredOutputsParams")

    def _check_kinds(self) -> None:
        flags = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens")
        for name in flags:
            _check(name, isinstance(getattr(self, name), bool), f"must be a boolean; got {getattr(self, name)!r}")
        _check("output_kind", isinstance(self.output_kind, RequestOutputKind),
               f"must be a RequestOutputKind; got {self.output_kind!r}")

    def _check_counts(self) -> None:
        _check("n", is_int64(self.n) and 1 <= self.n <= MAX_N, f"must be an integer in [1, {MAX_N}]; got {self.n!r}")
        if self.max_tokens is not None:
            _check("max_tokens", is_int64(self.max_tokens) and self.max_tokens >= 1,
                   f"must be an integer >= 1 (of 64 bits); got {self.max_tokens!r}")
        _check("min_tokens", is_int64(self.min_tokens) and self.min_tokens >= 0,
               f"must be an integer >= 0 (of 64 bits); got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _check("min_tokens", self.min_tokens <= self.max_tokens,
                   f"({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(name, is_int64(value) and 0 <= value <= MAX_LOGPROBS,
                       f"must be an integer in [0, {MAX_LOGPROBS}]; got {value!r}")
        if self.seed is not None:
            _check("seed", is_int64(self.seed),
                   f"must be an integer in [{MIN_SEED}, {MAX_SEED}]; got {self.seed!r}")

    def _check_probabilities(self) -> None:
        # (logits divided or multiplied by a value past _SCALE_LIMIT overflow float32: a row of
        # NaNs samples a token no mask allows)
        _check("temperature", _is_number(self.temperature) and 0 <= self.temperature <= _SCALE_LIMIT,
               f"must be a number >= 0 and <= {_SCALE_LIMIT:g}; got {self.temperature!r}")
        _check("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, f"must be in (0, 1]; got {self.top_p!r}")
        _check("top_k", is_int64(self.top_k) and self.top_k >= -1,
               f"must be an integer >= -1 of 64 bits (0 or -1 disable it); got {self.top_k!r}")
        _check("min_p", _is_number(self.min_p) and 0 <= self.min_p <= 1, f"must be in [0, 1]; got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(name, _is_number(value) and -2 <= value <= 2, f"must be in [-2, 2]; got {value!r}")
        _check("repetition_penalty", _is_number(self.repetition_penalty)
               and 1 / _SCALE_LIMIT <= self.repetition_penalty <= _SCALE_LIMIT,
               f"must be a number from {1 / _SCALE_LIMIT:g} to {_SCALE_LIMIT:g} (1: none); got {self.repetition_penalty!r}")
        for token_id, bias in self.logit_bias.items():
            _check("logit_bias", _is_number(bias) and -100 <= bias <= 100,
                   f"values must be in [-100, 100]; got {bias!r} for token {token_id}")

    def _check_truncation(self) -> None:
        if self.truncate_prompt_tokens is not None:
            _check("truncate_prompt_tokens", is_int64(self.truncate_prompt_tokens)
                   and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1),
                   f"must be an integer >= 1 of 64 bits, or -1 (max_model_len); got {self.truncate_prompt_tokens!r}")

    def _check_salt(self) -> None:
        if self.cache_salt is not None:
            _check("cache_salt", isinstance(self.cache_salt, str) and self.cache_salt != "",
                   f"must be a non-empty string; got {self.cache_salt!r}")

    def _check_stops(self) -> None:
        _check("stop", len(self.stop) <= MAX_STOP_STRINGS,
               f"may hold at most {MAX_STOP_STRINGS} strings; got {len(self.stop)}")
        for s in self.stop:
            _check("stop", isinstance(s, str) and 0 < len(s) <= MAX_STOP_LENGTH,
                   f"must be non-empty strings of at most {MAX_STOP_LENGTH} characters")
        for t in self.stop_token_ids:
            _check("stop_token_ids", is_int64(t) and t >= 0, f"must be non-negative integers; got {t!r}")

    def _check_restrictions(self) -> None:
        if self.allowed_token_ids is not None:
            _check("allowed_token_ids", len(self.allowed_token_ids) > 0, "must not be empty")
            for t in self.allowed_token_ids:
                _check("allowed_token_ids", is_int64(t) and t >= 0, f"must be non-negative integers; got {t!r}")
        _check("bad_words", len(self.bad_words) <= MAX_BAD_WORDS,
               f"may hold at most {MAX_BAD_WORDS} words; got {len(self.bad_words)}")
        for word in self.bad_words:
            _check("bad_words", isinstance(word, str) and 0 < len(word) <= MAX_STOP_LENGTH,
                   f"must be non-empty strings of at most {MAX_STOP_LENGTH} characters")
        for ids in self.bad_words_token_ids or ():
            _check("bad_words_token_ids", 0 < len(ids) <= MAX_STOP_LENGTH and all(is_int64(t) and t >= 0 for t in ids),
                   f"must be non-empty lists of at most {MAX_STOP_LENGTH} non-negative token ids")
        if self.allowed_token_ids is not None:
            banned = {ids[0] for ids in self.bad_words_token_ids or () if len(ids) == 1}
            _check("allowed_token_ids", not set(self.allowed_token_ids) <= banned,
                   "leaves no token to sample: bad_words ban every one of them")
            if self.min_tokens:
                _check("allowed_token_ids", not set(self.allowed_token_ids) <= banned | set(self.stop_token_ids),
                       "leaves no token to sample before min_tokens: bad_words and stop_token_ids exclude them all")

    def with_bad_words_tokenized(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """These parameters with ``bad_words_token_ids`` filled in from ``bad_words`` (a no-op
        without bad words, or where they are filled in already). ``encode``: text to token ids,
        no special tokens. Each word is banned as written at the start of a text and after a
        space (two token sequences where they differ), as vLLM does."""
        if not self.bad_words or self.bad_words_token_ids is not None:
            return self
        sequences: list[list[int]] = []
        for word in self.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = encode(text) if text else []
                if ids and ids not in sequences:
                    sequences.append(ids)
        return attrs.evolve(self, bad_words_token_ids=sequences)

    def clone(self) -> SamplingParams:
        """A copy (vLLM's ``clone``): its lists and dicts are its own."""
        return attrs.evolve(self)

    @property
    def processes_logits(self) -> bool:
        """Whether anything but ``min_tokens`` changes the logits before sampling (bias,
        restrictions, penalties)."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids
                    or self.needs_penalties)

    @property
    def restricts(self) -> bool:
        """Whether tokens are masked out by ``allowed_token_ids`` or ``bad_words``."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def reads_output(self) -> bool:
        """Whether sampling reads the tokens generated so far (penalties, bad words of several
        tokens)."""
        return self.needs_penalties or any(len(ids) > 1 for ids in self.bad_words_token_ids or ())

    @property
    def greedy(self) -> bool:
        """True when the next token is always the most likely one."""
        return self.temperature < _GREEDY_EPSILON

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


# Temperatures below this are treated as greedy (dividing by them would overflow).
_GREEDY_EPSILON = 1e-5
_SCALE_LIMIT = 1e30


def sampling_params_or_none(value: Any, param: str = "sampling_params") -> SamplingParams | None:
    """``value`` where it is a ``SamplingParams`` (or None).

    Raises:
        InvalidParameterError: naming ``param``, for anything else (a dict of its fields, say).
    """
    if value is not None and not isinstance(value, SamplingParams):
        raise InvalidParameterError(param, f"{param} must be a SamplingParams; got {type(value).__name__}")
    return value
