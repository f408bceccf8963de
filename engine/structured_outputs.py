"""Structured outputs: constraints on what a request may generate (JSON schema, regex, choice,
EBNF grammar), compiled to token masks by a grammar library behind a small interface.

The flow, as in vLLM:

1. The front compiles a request's ``StructuredOutputsParams`` before the request is admitted
   (``StructuredOutputManager.compile_async``: a worker thread, bounded concurrency, a time
   budget, a cache that also remembers the compiler's refusals). A constraint that fails to compile is an
   ``InvalidParameterError`` and never reaches the engine core.
2. The core gives each sequence its own ``Matcher`` of the compiled grammar (n > 1: one each).
3. Each step, the sampler fills one preallocated bitmask row per constrained sequence that
   samples, applies the rows that forbid anything right after the LM head, samples, and
   feeds the token to the matcher. A refused token fails that request alone; a matcher that
   has accepted a stop token finishes its sequence as ``stop``.

``xgrammar`` is the one backend today; ``GrammarBackend`` is what another (llguidance) would
implement, selected with ``StructuredOutputsConfig.backend``.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import outcome
import torch
import trio

from engine.errors import ConfigError, InvalidParameterError, RequestFailedError
from engine.sampling_params import PARAM_STRUCTURED as PARAM
from engine.sampling_params import StructuredOutputsParams, parse_json_constraint

log = logging.getLogger(__name__)

BACKENDS = ("xgrammar",)


# ---- what a grammar backend provides ----

class Matcher(Protocol):
    """The state of one sequence in its grammar. Used by the engine core, one thread at a time:
    masks filled on the device thread before a step, tokens accepted after it."""

    backend: GrammarBackend

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the tokens allowed next into ``bitmask[row]``; False if every token is allowed."""

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar refuses it (state unchanged)."""

    @property
    def terminated(self) -> bool:
        """A stop token has been accepted: the sequence is complete."""


class CompiledGrammar(Protocol):
    nbytes: int  # memory it holds (its token masks), what the manager's cache counts

    def matcher(self, stop_token_ids: Sequence[int]) -> Matcher:
        """A fresh matcher; ``stop_token_ids`` are what it allows once the grammar is complete."""


class GrammarBackend(Protocol):
    name: str

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Raises InvalidParameterError with the compiler's message."""

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """An int32 ``[rows, ceil(vocab / 32)]`` token bitmask (bit set = allowed) to fill."""


# ---- xgrammar ----

# A cap on consecutive whitespace in JSON (xgrammar's max_whitespace_cnt): enough for indented
# output several levels deep, and a model cannot loop on spaces until max_tokens.
MAX_JSON_WHITESPACE = 20

# JSON-schema keywords xgrammar enforces, or that only annotate. Anything else is refused with
# a 400 rather than silently not enforced (measured against xgrammar 0.2.9: contains,
# uniqueItems, if/then/else, not, dependentRequired/-Schemas, multipleOf on non-integers, the
# rarer formats, and string lengths next to a pattern or format are accepted by it and ignored).
_SCHEMA_KEYWORDS = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
    "propertyNames", "minProperties", "maxProperties", "items", "prefixItems", "unevaluatedItems",
    "unevaluatedProperties", "minItems", "maxItems", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "pattern", "minLength", "maxLength", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf",
    # annotations
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "discriminator", "strict",
})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})  # name -> schema
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SCHEMA_ONE = frozenset({"items", "additionalProperties", "propertyNames", "unevaluatedItems",
                         "unevaluatedProperties"})
_FORMATS = frozenset({"email", "date", "date-time", "time", "duration", "uri", "uri-reference", "uri-template",
                      "ipv4", "ipv6", "uuid", "hostname", "json-pointer", "relative-json-pointer"})


_LOOKAROUND = re.compile(r"(?<!\\)\(\?<?[=!]")  # (an escaped parenthesis is a character)


def unsupported_schema_keywords(schema: Any, path: str = "") -> list[str]:
    """Where ``schema`` uses what the backend would not enforce: ``["path: keyword", ...]``."""
    found: list[str] = []
    if not isinstance(schema, dict):
        return found
    found += _unsupported_combinations(schema, path or "/")
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key not in _SCHEMA_KEYWORDS:
            found.append(f"{path or '/'}: {key}")
        elif key == "format" and value not in _FORMATS:
            found.append(f"{path or '/'}: format {value!r}")
        elif key == "multipleOf" and not (isinstance(value, int) and schema.get("type") == "integer"):
            found.append(f"{path or '/'}: multipleOf (enforced for integers only)")
        elif key in ("minLength", "maxLength") and ("pattern" in schema or "format" in schema):
            found.append(f"{path or '/'}: {key} together with pattern or format")
        elif key == "allOf" and isinstance(value, list) and len(value) > 1:
            found.append(f"{path or '/'}: allOf with more than one schema")
        elif key == "pattern" and isinstance(value, str) and _LOOKAROUND.search(value):
            found.append(f"{path or '/'}: pattern with a lookahead or lookbehind")
        elif key == "$ref" and isinstance(value, str) and not value.startswith("#"):
            found.append(f"{path or '/'}: $ref to another document ({value!r})")
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                if key == "patternProperties" and _LOOKAROUND.search(name):
                    found.append(f"{where}: a pattern with a lookahead or lookbehind")
                found += unsupported_schema_keywords(sub, f"{where}/{name}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                found += unsupported_schema_keywords(sub, f"{where}/{i}")
        elif key in _SCHEMA_ONE:
            found += unsupported_schema_keywords(value, where)
    return found


def enforceable_schema(value: Any, param: str) -> dict[str, Any]:
    """A ``json`` constraint's schema (a dict or its JSON text), refused (naming ``param``)
    where it is no object or uses what the backend would not enforce."""
    schema = parse_json_constraint(value, "json")
    if not isinstance(schema, dict):
        raise InvalidParameterError(param, "json must be a JSON schema object")
    bad = unsupported_schema_keywords(schema)
    if bad:
        raise InvalidParameterError(param, "the JSON schema uses keywords this server cannot enforce: "
                                           + "; ".join(bad[:10]))
    return schema


def _unsupported_combinations(schema: dict[str, Any], where: str) -> list[str]:
    """What xgrammar gets wrong in one object schema (vLLM refuses the same): propertyNames
    beside properties or patternProperties, and patternProperties beside properties (it wrote
    a key twice, the second value of the wrong type); a required name nothing admits (strict,
    with no additionalProperties, it can never be written: the output misses it). A record
    (propertyNames with additionalProperties: Zod's and Pydantic's dict schemas) is fine."""
    found = []
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    patterns = schema.get("patternProperties") if isinstance(schema.get("patternProperties"), dict) else {}
    if "propertyNames" in schema and ({"properties", "patternProperties"} & set(schema)):
        found.append(f"{where}: propertyNames together with properties or patternProperties")
    if patterns and properties:
        found.append(f"{where}: patternProperties together with properties")
    others = schema.get("additionalProperties", False) is not False  # (strict: absent is false)
    for name in schema.get("required") if isinstance(schema.get("required"), list) else ():
        if isinstance(name, str) and not others and name not in properties \
                and not any(_matches(p, name) for p in patterns):
            found.append(f"{where}: required {name!r}, which no property describes")
    return found


def _matches(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False


class _XGrammarMatcher:
    __slots__ = ("_matcher", "backend")

    def __init__(self, matcher, backend: XGrammarBackend) -> None:
        self._matcher = matcher
        self.backend = backend

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        return self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()


@attrs.frozen
class _XGrammarCompiled:
    backend: XGrammarBackend
    compiled: Any  # xgrammar.CompiledGrammar

    @property
    def nbytes(self) -> int:
        return int(self.compiled.memory_size_bytes)

    def matcher(self, stop_token_ids: Sequence[int]) -> Matcher:
        import xgrammar

        stops = list(stop_token_ids) or None  # None: the tokenizer's own stop tokens
        return _XGrammarMatcher(xgrammar.GrammarMatcher(self.compiled, override_stop_tokens=stops), self.backend)


class XGrammarBackend:
    """xgrammar: per-token masks in microseconds on this vocabulary, a C++ kernel applying them."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, max_threads: int = 2) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        kind = params.kind
        try:
            if kind == "json":
                compiled = self._compile_json(json.dumps(enforceable_schema(params.json, PARAM)), params)
            elif kind == "json_object":
                compiled = self._compile_json('{"type": "object"}', params, strict=False)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(params.regex)
            elif kind == "choice":
                alternatives = " | ".join(_ebnf_string(c) for c in params.choice)
                compiled = self._compiler.compile_grammar(f"root ::= {alternatives}")
            elif kind == "grammar":
                compiled = self._compile_grammar(params.grammar)
            else:
                tag = parse_json_constraint(params.structural_tag, "structural_tag")
                compiled = self._compiler.compile_structural_tag(json.dumps(tag))
        except InvalidParameterError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidParameterError(PARAM, f"invalid {kind.replace('_', ' ')}: {_compiler_message(exc)}") from None
        return _XGrammarCompiled(self, compiled)

    def _compile_grammar(self, grammar: str):
        try:
            return self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            if "::=" in grammar or not _LARK_RULE.search(grammar):
                raise
            raise InvalidParameterError(PARAM, f"invalid grammar: {_compiler_message(exc)}. It looks like Lark; "
                                               "grammars here are EBNF as xgrammar reads it (GBNF, llama.cpp's: "
                                               "'root ::= \"yes\" | \"no\"')") from None

    def _compile_json(self, schema: str, params: StructuredOutputsParams, strict: bool = True):
        if params.disable_any_whitespace:
            return self._compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=strict)
        return self._compiler.compile_json_schema(schema, any_whitespace=True, strict_mode=strict,
                                                  max_whitespace_cnt=MAX_JSON_WHITESPACE)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)



def _ebnf_string(text: str) -> str:
    """``text`` as an EBNF string literal (the JSON escapes are the grammar's too)."""
    return json.dumps(text, ensure_ascii=False)


# A Lark rule or terminal definition ("?start: ...", "NAME: /.../"), where EBNF writes "::=".
_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w.]*\s*(\.\d+)?\s*:(?!:)", re.MULTILINE)


def _compiler_message(exc: Exception) -> str:
    """xgrammar's message without its log prefix (``[time] source.cc:line: ``) or the words of the
    assertion that raised it (an invalid structural tag fails one, which then says what is wrong)."""
    message = re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", str(exc).strip())
    message = re.sub(r"^Check failed: \(.*?\) is false: ", "", message)  # (an internal assertion's words)
    return message.splitlines()[0][:500] if message else type(exc).__name__


# ---- compiling, cached, off the event loop ----

@attrs.frozen(kw_only=True)
class StructuredOutputsConfig:
    """``--structured-outputs-config`` (JSON), as in vLLM.

    Attributes:
        backend: the grammar library (``xgrammar``).
        compile_timeout_s: a request whose constraint takes longer to compile is refused
            (400); the compile goes on and its result is cached.
        max_concurrent_compiles: worker threads compiling at once (more requests wait, and
            that wait is not compile time).
        cache_size: compiled constraints (and the compiler's refusals) remembered.
        cache_size_mb: the most memory the compiled ones may hold (their token masks: ~2.5 MB
            for a small JSON schema over a 49k vocabulary), as vLLM's VLLM_XGRAMMAR_CACHE_MB
            bounds xgrammar's cache; the least recently used go first.
    """

    backend: str = "xgrammar"
    compile_timeout_s: float = 10.0
    max_concurrent_compiles: int = 2
    cache_size: int = 512
    cache_size_mb: float = 256

    def __attrs_post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError("structured_outputs_config", f"backend must be one of {', '.join(BACKENDS)}; "
                                                           f"got {self.backend!r}")
        for name in ("compile_timeout_s", "max_concurrent_compiles", "cache_size", "cache_size_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError("structured_outputs_config", f"{name} must be a positive number; got {value!r}")

    @classmethod
    def from_json(cls, text: str | dict | None) -> StructuredOutputsConfig:
        if text is None:
            return cls()
        try:
            fields = json.loads(text) if isinstance(text, str) else dict(text)
            return cls(**fields)
        except (ValueError, TypeError) as exc:
            raise ConfigError("structured_outputs_config", f"not a valid structured outputs config: {exc}") from None


@attrs.define(eq=False)
class _CompileJob:
    """One constraint compiling in a worker thread. The manager owns it, not the requests
    waiting on it: a request that gives up (its time budget, a disconnect) leaves it running,
    and what it produces is cached for the next request with that constraint."""

    token: trio.lowlevel.TrioToken  # the trio run whose requests wait on ``done``
    started: float  # trio time the compile began
    lease_ends: float  # when its slot is free again, finished or not
    done: trio.Event = attrs.field(factory=trio.Event)
    result: CompiledGrammar | Exception | None = None
    lost: bool = False  # its lease ran out before it finished


# A compile that runs this many times its budget stops counting against
# ``max_concurrent_compiles`` (its thread cannot be stopped; it is logged as lost), so that one
# constraint that never finishes cannot take a compile slot for the life of the server. At most
# as many lost compiles as slots may run at once: past that, new compiles wait for one to end.
SLOT_LEASE = 3.0


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe.

    Resource handling: holds the backend (built on first use), a bounded LRU cache of
    compiled grammars and of compile *errors* (a constraint the compiler refused is refused
    again at once), keyed by ``StructuredOutputsParams.key()``, and the compiles running in
    worker threads (``compile_async``), one per key, each holding one of
    ``max_concurrent_compiles`` slots until it ends or its lease (``SLOT_LEASE`` times the
    budget) runs out. A time-out is the request's, never remembered as the constraint's.
    """

    @classmethod
    def for_engine(cls, tokenizer, vocab_size: int, engine_config, validate_only: bool = False,
                   ) -> StructuredOutputManager:
        """The manager an ``EngineConfig`` asks for (its ``structured_outputs_config`` JSON)."""
        return cls(tokenizer, vocab_size, StructuredOutputsConfig.from_json(engine_config.structured_outputs_config),
                   validate_only)

    def __init__(self, tokenizer, vocab_size: int, config: StructuredOutputsConfig | None = None,
                 validate_only: bool = False) -> None:
        self.config = config or StructuredOutputsConfig()
        # A front of engine processes compiles only to refuse what will not compile before a
        # request is queued (the engine compiles, and caches, its own): it remembers verdicts.
        self.validate_only = validate_only
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[str, CompiledGrammar | InvalidParameterError] = OrderedDict()
        self.cache_bytes = 0  # what the cached grammars hold
        self._lock = threading.Lock()
        self._jobs: dict[str, _CompileJob] = {}  # key -> its compile in a worker thread
        self._slot_freed = trio.Event()  # (replaced each time it is set)
        self.num_compiles = 0  # compiles actually run (not answered from the cache)
        self.num_lost_compiles = 0  # compiles whose lease ran out before they finished

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                self._backend = XGrammarBackend(self._tokenizer, self._vocab_size)
            return self._backend

    def cached(self, params: StructuredOutputsParams) -> CompiledGrammar | None:
        """The compiled grammar if it is in the cache (raises a remembered compile error)."""
        key = params.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if isinstance(hit, InvalidParameterError):
            raise InvalidParameterError(hit.param, str(hit))
        return hit

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile now, in this thread (cached)."""
        hit = self.cached(params)
        if hit is not None:
            return hit
        compiled = self._compile(params)
        if isinstance(compiled, InvalidParameterError):
            raise compiled
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar | InvalidParameterError:
        """Run the compiler and remember what it said (a grammar, or its refusal)."""
        try:
            compiled: CompiledGrammar | InvalidParameterError = self.backend.compile(params)
        except InvalidParameterError as exc:
            compiled = exc
        with self._lock:
            self.num_compiles += 1
        self._remember(params.key(), compiled)
        return compiled

    async def compile_async(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile in a worker thread, at most ``max_concurrent_compiles`` at once, and wait at
        most ``compile_timeout_s`` from when the compile began (waiting for a slot does not
        count). Requests for a key being compiled wait for that compile rather than start another.

        Cancellation leaves the compile running (its result is cached); the caller's wait ends.

        Raises:
            InvalidParameterError: the compiler refused the constraint (remembered), or the
                compile ran past its budget (not remembered: it goes on, and a later request
                may find it done).
        """
        hit = self.cached(params)
        if hit is not None:
            return hit
        arrived = trio.current_time()
        job = await self._job(params)
        timeout = self.config.compile_timeout_s
        # The budget runs from when the compile began, or from this request's arrival if it
        # joined one already running (then it waited for no slot).
        with trio.move_on_at(max(job.started, arrived) + timeout):
            await job.done.wait()
        if isinstance(job.result, InvalidParameterError):
            raise InvalidParameterError(job.result.param, str(job.result))
        if isinstance(job.result, Exception):
            raise RequestFailedError(f"compiling the constraint failed: {job.result!r}")
        if job.result is None:
            raise InvalidParameterError(PARAM, f"the constraint took longer than {timeout:g} s to compile "
                                               f"(compile_timeout_s); simplify it")
        return job.result

    async def _job(self, params: StructuredOutputsParams) -> _CompileJob:
        """The compile of ``params``: running, started once a slot is free, or done already."""
        key, token = params.key(), trio.lowlevel.current_trio_token()
        while True:
            hit = self.cached(params)  # (it may have been compiled while this request waited)
            if hit is not None:
                job = _CompileJob(token, trio.current_time(), trio.current_time(), result=hit)
                job.done.set()
                return job
            job = self._jobs.get(key)
            if job is not None and job.token is token:
                return job
            recheck_at = self._free_slot_at(token)
            if recheck_at is None:
                return self._start(key, params, token)
            freed = self._slot_freed
            with trio.move_on_at(recheck_at):
                await freed.wait()

    def _free_slot_at(self, token: trio.lowlevel.TrioToken) -> float | None:
        """None if a compile may start now; else when to look again (the earliest lease's end;
        inf when only a compile's end can free a place). Jobs of another trio run, whose
        clock this one cannot read, are not counted."""
        now, slots = trio.current_time(), self.config.max_concurrent_compiles
        with self._lock:
            jobs = [job for job in self._jobs.values() if job.token is token]
        leases = [job.lease_ends for job in jobs if job.lease_ends > now]
        for job in jobs:
            if job.lease_ends <= now and not job.lost:
                job.lost = True
                self.num_lost_compiles += 1
                log.warning("a constraint has compiled for %.0f s (%g x compile_timeout_s): its slot is given "
                            "back; its thread goes on", now - job.started, SLOT_LEASE)
        if len(leases) < slots and len(jobs) < 2 * slots:
            return None
        return min(leases) if len(leases) >= slots else math.inf

    def _start(self, key: str, params: StructuredOutputsParams, token: trio.lowlevel.TrioToken) -> _CompileJob:
        now = trio.current_time()
        job = _CompileJob(token, now, now + SLOT_LEASE * self.config.compile_timeout_s)
        with self._lock:
            self._jobs[key] = job

        def deliver(result: outcome.Outcome) -> None:  # (in the worker thread)
            try:
                token.run_sync_soon(self._finished, key, job, result)
            except trio.RunFinishedError:  # nobody waits any more: the cache has what it made
                self._forget(key, job)

        trio.lowlevel.start_thread_soon(lambda: self._compile(params), deliver, name=f"compile {params.kind}")
        return job

    def _finished(self, key: str, job: _CompileJob, result: outcome.Outcome) -> None:
        if isinstance(result, outcome.Error):
            log.error("a constraint's compile raised (not the compiler refusing it)", exc_info=result.error)
        job.result = result.value if isinstance(result, outcome.Value) else result.error
        self._forget(key, job)
        job.done.set()
        self._slot_freed.set()
        self._slot_freed = trio.Event()

    def _forget(self, key: str, job: _CompileJob) -> None:
        with self._lock:
            if self._jobs.get(key) is job:
                del self._jobs[key]

    def _remember(self, key: str, value: CompiledGrammar | InvalidParameterError) -> None:
        """Cache ``value`` under ``key``; the least recently used go while there are more than
        ``cache_size`` or they hold more than ``cache_size_mb`` (the newest always stays)."""
        limit = self.config.cache_size_mb * 2**20
        if self.validate_only and not isinstance(value, InvalidParameterError):
            value = COMPILES
        with self._lock:
            self.cache_bytes -= _nbytes(self._cache.pop(key, None))
            self._cache[key] = value
            self.cache_bytes += _nbytes(value)
            while len(self._cache) > 1 and (len(self._cache) > self.config.cache_size or self.cache_bytes > limit):
                self.cache_bytes -= _nbytes(self._cache.popitem(last=False)[1])


def _nbytes(cached: CompiledGrammar | InvalidParameterError | None) -> int:
    return getattr(cached, "nbytes", 0)


class _Compiles:
    """What a validating manager keeps of a constraint that compiled: the verdict alone."""

    nbytes = 0

    def matcher(self, stop_token_ids: Sequence[int]) -> Matcher:
        raise RuntimeError("this constraint was only checked here: the engine process compiles its own")


COMPILES = _Compiles()


class GrammarBitmask:
    """The token bitmask of a step's constrained rows: allocated once for ``rows`` sequences
    (grown only if a batch is larger), filled per step by the engine core into the step plan."""

    def __init__(self, rows: int) -> None:
        self._rows = rows
        self._bitmask: torch.Tensor | None = None
        self._backend: GrammarBackend | None = None

    def get(self, backend: GrammarBackend, rows: int) -> torch.Tensor:
        if self._bitmask is None or self._backend is not backend or self._bitmask.shape[0] < rows:
            self._rows = max(self._rows, rows)
            self._bitmask = backend.allocate_bitmask(self._rows)
            self._backend = backend
        return self._bitmask
