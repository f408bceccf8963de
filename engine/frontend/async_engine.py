"""The concurrent engine: the core and output actors in one trio nursery, and the client API.

Resource handling: ``Engine.run`` owns the actors; leaving it (cancellation, or a fault in
the core) fails every open request stream with ``EngineDeadError``, so no consumer waits
forever. Cancellation takes effect between steps: a step already on the device thread
finishes first (one step is the shutdown deadline).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from engine.core.core_actor import STEP_QUEUE_SIZE
from engine.core.engine_core import EngineCore
from engine.core.interface import Core, CoreActorLike
from engine.errors import (EngineDeadError, EngineOverloadedError, EngineShutdownError, InvalidParameterError,
                           ungrouped)
from engine.frontend.beam_search import BeamSearchParams, beam_search
from engine.frontend.output_actor import OutputActor
from engine.frontend.output_channel import MergedOutputs, RequestOutputChannel, Wakeup
from engine.frontend.request_state import RequestState
from engine.frontend.stats import IterationStats, StatLogger
from engine.messages import AbortRequest, AddRequest, EngineStats, KVCacheInfo, StepOutput
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, is_int64, sampling_params_or_none
from engine.structured_outputs import CompiledGrammar, StructuredOutputManager
from engine.transport.processes import attached_engines, engine_processes
from engine.transport.remote import DataParallelCore

log = logging.getLogger(__name__)

# Step outputs a slow ``steps()`` subscriber may fall behind before steps are dropped for it.
SUBSCRIBER_QUEUE_SIZE = 256

# The cores an actor graph drives now (by id), from any thread: one graph at a time steps a core.
_DRIVEN: set[int] = set()
_DRIVEN_LOCK = threading.Lock()


class Engine:
    """The actor graph over one core (``Core``: here, in an engine process, or a data-parallel
    group of them); ``client`` is how requests get in."""

    def __init__(self, core: Core, tokenizer, structured_outputs: StructuredOutputManager | None = None) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.structured_outputs = structured_outputs or StructuredOutputManager.for_engine(
            tokenizer, core.vocab_size, core.config)
        self.client = EngineClient(self)
        self.error: EngineDeadError | None = None
        self.registry: dict[str, RequestOutputChannel] = {}
        self.reserved = 0  # waiting room held by beam searches between their steps
        self.subscribers: set[trio.MemorySendChannel] = set()
        self.stat_loggers: list[StatLogger] = []
        self.num_dropped_steps = 0
        self.failed = trio.Event()  # set when the core fails (not on a normal shutdown)
        self._inbox: trio.MemorySendChannel | None = None

    @property
    def running(self) -> bool:
        return self._inbox is not None and self.error is None

    def send(self, message: AddRequest | AbortRequest) -> None:
        """Hand a message to the core actor (never blocks)."""
        if self.error is not None:
            raise self.error
        if self._inbox is None:
            raise EngineDeadError("the engine is not running")
        self._inbox.send_nowait(message)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the actors until cancelled or the core fails; ``task_status.started(client)`` once ready."""
        with self._driving():
            inbox_send, inbox_recv = trio.open_memory_channel(math.inf)
            steps_send, steps_recv = trio.open_memory_channel(STEP_QUEUE_SIZE)
            # In-process, the core actor itself; with the core in an engine process, its stand-in.
            core = self.core.actor(inbox_recv, steps_send)
            outputs = OutputActor(steps_recv, inbox_send, self.registry, self._publish)
            self.error = None
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self._run_core, core)
                    await nursery.start(outputs.run)
                    self._inbox = inbox_send
                    task_status.started(self.client)
            finally:
                self._inbox = None
                self._fail_all(self.error or EngineShutdownError("the engine has shut down"))
                self.core.abort_all()  # requests die with the engine; their blocks are free for the next run

    @contextlib.contextmanager
    def _driving(self) -> Iterator[None]:
        """This graph drives its core for the block (refused where it cannot run, or another does)."""
        with _DRIVEN_LOCK:
            self._check_runnable()
            _DRIVEN.add(id(self.core))
        try:
            yield
        finally:
            with _DRIVEN_LOCK:
                _DRIVEN.discard(id(self.core))

    def _check_runnable(self) -> None:
        if self.core.fault is not None:
            raise EngineDeadError(f"the engine failed earlier and cannot run again: {self.core.fault!r}")
        if id(self.core) in _DRIVEN:  # (each graph's core actor would step it, and take the other's outputs)
            raise RuntimeError("this engine core is already running under another Engine: one actor graph "
                               "drives a core at a time (serve it once and share the client)")

    async def _run_core(self, core: CoreActorLike, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            await core.run(task_status=task_status)
        except Exception as exc:
            log.exception("engine step failed; the engine is dead")
            self.core.fault = exc  # its state is unknown now: it must not run again
            if isinstance(exc, EngineDeadError):  # (an engine process's death, already said as such)
                self.error = exc
            else:
                self.error = EngineDeadError(f"the engine failed: {exc!r}")
                self.error.__cause__ = exc
            self._fail_all(self.error)
            self.failed.set()

    def _fail_all(self, error: EngineDeadError) -> None:
        stats = IterationStats(time.monotonic())
        for channel in self.registry.values():
            channel.state.fail(stats, str(error))
            channel.fail(error)
        self.registry.clear()
        self._log_stats(stats)
        for subscriber in self.subscribers:
            subscriber.close()
        self.subscribers.clear()

    def _publish(self, step: StepOutput, stats: IterationStats) -> None:
        self._log_stats(stats)
        for subscriber in list(self.subscribers):
            try:
                subscriber.send_nowait(step)
            except trio.WouldBlock:
                self.num_dropped_steps += 1
            except trio.BrokenResourceError:
                self.subscribers.discard(subscriber)

    def _log_stats(self, stats: IterationStats) -> None:
        if stats.empty:
            return
        for logger in self.stat_loggers:
            try:
                logger(stats)
            except Exception:  # a broken logger must not take the engine down
                log.exception("stat logger %r failed", logger)

    @asynccontextmanager
    async def serve(self) -> AsyncIterator[EngineClient]:
        """Run the engine in a nursery of its own for the duration of the block."""
        self._check_runnable()
        async with trio.open_nursery() as nursery:
            client = await nursery.start(self.run)
            try:
                yield client
            finally:
                nursery.cancel_scope.cancel()


class QueuedRequests:
    """Requests an ``EngineClient`` has queued (``add_request``, ``add_requests``) and their
    outputs as an async iterator: ``RequestOutput`` for one request, ``(index, output)`` for
    several. ``close`` (or ``aclose``, ``async with``) aborts those not finished, and so does
    dropping it unread: a caller that fails before it reads them leaks no request."""

    def __init__(self, client: EngineClient, channels: list[RequestOutputChannel],
                 source: RequestOutputChannel | MergedOutputs | None) -> None:
        self.channels = channels
        self.source = source
        self._client = client
        self._loop = trio.lowlevel.current_trio_token()

    def __aiter__(self) -> QueuedRequests:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.source.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def close(self) -> None:
        """Abort the requests that have not finished (``abort`` needs no await)."""
        channels, self.channels = self.channels, []
        for channel in channels:
            if not channel.state.finished:
                self._client.abort(channel.state.request_id)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> QueuedRequests:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # The collector may run this on any thread, and in the middle of the engine's own loops:
        # the aborts are made in the event loop, at its next turn. (A stopped loop: nothing runs.)
        if self.channels:
            with contextlib.suppress(trio.RunFinishedError):
                self._loop.run_sync_soon(self.close)


def _integers(token_ids) -> list:
    """``token_ids`` as a list; integers of another type (numpy's: a sequence holds one type) as
    ints. What is not an integer stays for the checks to name."""
    ids = list(token_ids)
    if ids and type(ids[0]) is not int:  # (one look: this runs in the event loop for every prompt)
        ids = [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in ids]
    return ids


class _Done:
    """What ``EngineClient.abort`` returns: nothing to wait for, yet awaitable."""

    def __await__(self):
        return iter(())


_DONE = _Done()


class EngineClient:
    """What callers use: submit requests and read their outputs, abort, read stats.

    All methods must be called from the trio thread that runs the engine.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._max_token_chars: int | None = None  # the longest vocabulary entry, once needed

    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def errored(self) -> bool:
        return self._engine.error is not None

    @property
    def max_model_len(self) -> int:
        return self._engine.core.max_model_len

    async def get_tokenizer(self):
        """``tokenizer``, awaited as vLLM's ``AsyncLLM.get_tokenizer``."""
        return self.tokenizer

    @property
    def default_sampling(self) -> dict[str, float]:
        """The sampling values a request gets where it sets none (``--generation-config auto``:
        the model's generation_config.json; ``vllm``: none)."""
        return self._engine.core.sampling_defaults

    @property
    def backend_name(self) -> str:
        return self._engine.core.backend_name

    def engine_kv_caches(self) -> list[KVCacheInfo]:
        """Each engine's KV cache, as it started (one, unless ``data_parallel_size`` > 1)."""
        return self._engine.core.engine_kv_caches()

    def stats(self) -> EngineStats:
        return self._engine.core.stats()

    def engine_stats(self) -> list[EngineStats]:
        """Each engine's counters (one, unless ``data_parallel_size`` > 1)."""
        core = self._engine.core
        return core.engine_stats()

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not yet finished by the engine."""
        return len(self._engine.registry)

    async def wait_failed(self) -> EngineDeadError:
        """Return (the error) once the engine has failed; never returns if it does not."""
        await self._engine.failed.wait()
        return self._engine.error

    async def wait_idle(self, poll_s: float = 0.05) -> None:
        """Return once no request is left unfinished (for draining at shutdown)."""
        while self._engine.registry:
            await trio.sleep(poll_s)

    def add_stat_logger(self, logger: StatLogger) -> None:
        """Call ``logger`` with the request timings observed in each step (TTFT, inter-token
        latency, finished requests of every kind). It runs in the event loop: keep it quick."""
        self._engine.stat_loggers.append(logger)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raise InvalidParameterError if the engine would reject this prompt and parameters."""
        self._engine.core.validate(prompt_token_ids, params, priority)

    def check_text_length(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse text that cannot fit in ``max_model_len`` tokens before spending time tokenizing
        it: no token of this vocabulary stands for more characters than its longest entry."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self.tokenizer.get_vocab()))
        if num_chars > self.max_model_len * self._max_token_chars:
            raise InvalidParameterError(param, f"{param} has {num_chars} characters: more than this model's maximum "
                                               f"context length of {self.max_model_len} tokens can hold")

    def tokenize_bad_words(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its bad words as token ids (``with_bad_words_tokenized``)."""
        return params.with_bad_words_tokenized(lambda word: self.tokenizer.encode(word, add_special_tokens=False))

    def truncates(self, keep: int | None) -> bool:
        """Whether ``keep`` (a ``truncate_prompt_tokens``) cuts a prompt: -1, or 1 to
        ``max_model_len``; only then may a text of any length come in (``encode``)."""
        return is_int64(keep) and (keep == -1 or 1 <= keep <= self.max_model_len)

    @functools.cached_property
    def leading_special_tokens(self) -> int:
        """How many special tokens the tokenizer puts before a text (a BOS: 1; none: 0)."""
        plain = self.tokenizer.encode("a", add_special_tokens=False)
        marked = self.tokenizer.encode("a")
        return next((i for i in range(len(marked)) if marked[i:i + len(plain)] == plain), 0)

    def truncate(self, prompt_token_ids: list[int], params: SamplingParams, specials: bool = False) -> list[int]:
        """The prompt's last ``params.truncate_prompt_tokens`` tokens (all without it). With
        ``specials`` (the ids are a text's, encoded with the tokenizer's special tokens) those in
        front (``leading_special_tokens``: a BOS) stay, as a tokenizer's own truncation keeps them.

        Raises:
            InvalidParameterError: more tokens to keep than ``max_model_len``.
        """
        keep = params.truncate_prompt_tokens
        if keep is None:
            return prompt_token_ids
        if keep == -1:
            keep = self.max_model_len
        if keep > self.max_model_len:
            raise InvalidParameterError("truncate_prompt_tokens",
                                        f"truncate_prompt_tokens ({keep}) is greater than this model's maximum "
                                        f"context length ({self.max_model_len})")
        if len(prompt_token_ids) <= keep:
            return prompt_token_ids
        front = min(self.leading_special_tokens if specials else 0, keep)
        return prompt_token_ids[:front] + prompt_token_ids[len(prompt_token_ids) - (keep - front):]

    def encode(self, text: str, add_special_tokens: bool = True, truncating: bool = False) -> list[int]:
        """Token ids of ``text`` (after ``check_text_length``, unless ``truncating``: the caller
        keeps only the last tokens, ``truncate_prompt_tokens``, so a text of any length may come)."""
        if not truncating:
            self.check_text_length(len(text))
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def prepare(self, prompt: str | list[int] | dict[str, Any], truncating: bool = False,
                add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(prompt text, prompt token ids) for a prompt given as text, token ids or vLLM's dict
        forms; ``truncating`` and ``add_special_tokens`` (for a text) as ``encode``'s."""
        if isinstance(prompt, str):
            return prompt, self.encode(prompt, add_special_tokens, truncating)
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:  # e.g. vLLM's prompt-level cache_salt: here it is a SamplingParams field
                raise InvalidParameterError("prompt", f"a dict prompt takes 'prompt' and 'prompt_token_ids'; "
                                                      f"got {', '.join(sorted(map(repr, unknown)))}")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _integers(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.prepare(prompt["prompt"], truncating, add_special_tokens)
            raise InvalidParameterError("prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'")
        ids = _integers(prompt) if isinstance(prompt, (list, tuple)) else None
        if ids is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            several = ids is not None and any(isinstance(p, (str, dict, list)) for p in ids)
            why = "several prompts go to generate_many" if several else f"got {type(prompt).__name__}"
            raise InvalidParameterError("prompt", f"a prompt is a string, a list of token ids or a dict ({why})")
        return None, ids

    async def generate(self, prompt: str | list[int] | dict[str, Any], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Submit a request and iterate over its outputs (their form per ``sampling_params.output_kind``).

        However the iteration ends (finished, exception, cancellation, ``break``), the request is
        aborted and its KV blocks freed before the engine's next step. Use
        ``contextlib.aclosing`` to make that happen at the ``break`` rather than at garbage
        collection.

        Raises:
            InvalidParameterError: bad prompt or parameters (before anything is queued).
            EngineOverloadedError: no room in the waiting queue (``check_room``).
            EngineDeadError: the engine failed or shut down.
            RequestFailedError: this request failed inside the engine (the engine goes on).
        """
        queued = await self.add_request(prompt, sampling_params, request_id, priority)
        receive = queued.source.receive
        try:
            while True:  # (``async for`` over the queue adds a call of its ``__anext__`` per output)
                try:
                    output = await receive()
                except trio.EndOfChannel:
                    return
                yield output
        finally:
            queued.close()

    async def generate_many(self, prompts: Sequence[str | list[int] | dict[str, Any]],
                            sampling_params: SamplingParams | None = None, request_ids: Sequence[str] | None = None,
                            priority: int = 0) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Submit one request per prompt and iterate over ``(prompt index, output)`` as they come.

        Every prompt is checked before any is queued. However the iteration ends, the
        requests still running are aborted, as with ``generate``. One consumer reads them
        all, with no task per request (a generator that yields inside a nursery cannot be
        cancelled safely; this one holds none).

        Raises:
            InvalidParameterError: a bad prompt or parameter (nothing is queued).
            EngineOverloadedError: no room in the waiting queue for all of them (``check_room``).
            EngineDeadError, RequestFailedError: the engine, or one of the requests, failed.
        """
        queued = await self.add_requests(prompts, sampling_params, request_ids, priority)
        try:
            async for item in queued:
                yield item
        finally:
            queued.close()

    async def add_request(self, prompt: str | list[int] | dict[str, Any], sampling_params: SamplingParams | None = None,
                          request_id: str | None = None, priority: int = 0) -> QueuedRequests:
        """Queue a request now and return its outputs, to read (vLLM's ``AsyncLLM.add_request``):
        what ``generate`` does before its first output, for a caller that must know the request
        is queued, or refused, before it answers anything (a server, before a stream's status
        line). Closing the result, or dropping it unread, aborts the request.

        Raises: as ``generate``, here rather than at the first output.
        """
        grammar = await self.compile(sampling_params_or_none(sampling_params))
        self.check_room((sampling_params or SamplingParams()).n)  # (no await between it and the submit)
        channel = self.submit(prompt, sampling_params, request_id, priority, grammar=grammar)
        return QueuedRequests(self, [channel], channel)

    async def add_requests(self, prompts: Sequence[str | list[int] | dict[str, Any]],
                           sampling_params: SamplingParams | None = None, request_ids: Sequence[str] | None = None,
                           priority: int = 0, admitted: bool = False) -> QueuedRequests:
        """``add_request`` for several prompts (``generate_many``'s queueing): every prompt checked,
        then all queued or none; the outputs come as ``(prompt index, output)``. ``admitted``: they
        wait in room the caller holds (``reserve``: a beam search's steps), and count only there."""
        params = self.tokenize_bad_words(sampling_params_or_none(sampling_params) or SamplingParams())  # (once)
        if isinstance(request_ids, str) or (request_ids is not None and (
                len(request_ids) != len(prompts) or not all(isinstance(i, str) for i in request_ids))):
            raise InvalidParameterError("request_ids", f"request_ids must be a list of one id per prompt "
                                                       f"({len(prompts)}); got {request_ids!r}"[:200])
        ids = list(request_ids) if request_ids is not None else [uuid.uuid4().hex for _ in prompts]
        truncating = self.truncates(params.truncate_prompt_tokens)
        inputs = [(text, self.truncate(token_ids, params, encoded(p)))
                  for p, (text, token_ids) in ((p, self.prepare(p, truncating)) for p in prompts)]
        for _, token_ids in inputs:
            self.validate(token_ids, params, priority)
        grammar = await self.compile(params)
        if not admitted:
            self.check_room(len(inputs) * params.n)  # all or none: no await from here to the last submit
        wakeup = Wakeup()
        channels: list[RequestOutputChannel] = []
        try:
            for request_id, (text, token_ids) in zip(ids, inputs):
                channels.append(self.submit({"prompt": text, "prompt_token_ids": token_ids}, params, request_id,
                                            priority, wakeup, grammar, waits=not admitted))
        except BaseException:
            QueuedRequests(self, channels, None).close()
            raise
        return QueuedRequests(self, channels, MergedOutputs(channels, wakeup))

    async def compile(self, sampling_params: SamplingParams | None) -> CompiledGrammar | None:
        """The request's structured-output constraint compiled (in a worker thread, cached), or
        None without one.

        Raises:
            InvalidParameterError: the constraint does not compile, or not within the time budget.
        """
        if sampling_params is None or sampling_params.structured_outputs is None:
            return None
        return await self._engine.structured_outputs.compile_async(sampling_params.structured_outputs)

    def submit(self, prompt: str | list[int] | dict[str, Any], sampling_params: SamplingParams | None = None,
               request_id: str | None = None, priority: int = 0, wakeup: Wakeup | None = None,
               grammar: CompiledGrammar | None = None, waits: bool = True) -> RequestOutputChannel:
        """Queue a request now (no await) and return its output channel.

        ``grammar`` is the compiled structured-output constraint (``compile``); without it, one
        is compiled here, in the event loop (cached: callers that submit many requests with one
        constraint, like the offline ``LLM``, compile it once).

        The caller owns the request: it must read the channel to the end or ``abort`` it.
        ``generate`` is the safe wrapper; this is for callers that must queue many requests
        before the engine takes its next step (the offline ``LLM`` does, so that batches
        do not depend on task timing); it applies no ``max_waiting_requests`` limit, the
        caller bounds its own queue. A request id stays taken until the engine has finished
        that request, even after its stream ended. ``waits``: it counts as waiting
        (``num_waiting_sequences``) until it starts; not when it waits in room held for it.
        """
        engine = self._engine
        params = sampling_params_or_none(sampling_params) or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if engine.error is not None:
            raise engine.error
        if not isinstance(request_id, str):
            raise InvalidParameterError("request_id", f"request_id must be a string; got {request_id!r}")
        if isinstance(priority, numbers.Integral) and not isinstance(priority, bool):
            priority = int(priority)  # (numpy's integers: validate_request takes Python's)
        if request_id in engine.registry:
            raise InvalidParameterError("request_id", f"request id {request_id!r} is already in use")
        text, ids = self.prepare(prompt, self.truncates(params.truncate_prompt_tokens))
        # (``prompt`` stays the text given, as vLLM's; a text's BOS stays in front)
        ids = self.truncate(ids, params, encoded(prompt))
        params = self.tokenize_bad_words(params.clone())  # (the engine's own copy: the caller's may change)
        self.validate(ids, params, priority)
        if params.structured_outputs is not None and grammar is None:
            grammar = engine.structured_outputs.compile(params.structured_outputs)
        channel = RequestOutputChannel(RequestState(request_id, text, ids, params, self.tokenizer, waits=waits), wakeup,
                                       engine.core.config.stream_interval)
        engine.send(AddRequest(request_id, tuple(ids), params, priority, grammar))
        engine.registry[request_id] = channel
        return channel

    async def beam_search(self, prompt: str | list[int] | dict[str, Any], params: BeamSearchParams,
                          request_id: str | None = None, priority: int = 0, admitted: bool = False) -> RequestOutput:
        """The ``params.beam_width`` best continuations of ``prompt`` (engine/frontend/beam_search.py),
        best first, as one finished output (vLLM's ``beam_search``). It holds waiting room for
        its beams from start to end (``admitted``: the caller holds it, or bounds its own queue,
        as the offline ``LLM`` does)."""
        return await beam_search(self, prompt, params, request_id, priority, admitted)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's end tokens: its EOS, then generation_config's others."""
        return self._engine.core.eos_token_ids

    def check_room(self, num_sequences: int, param: str = "n") -> None:
        """Refuse at once a request of ``num_sequences`` sequences (prompts x ``n``) that would
        take the sequences waiting past ``max_waiting_requests``.

        A sequence waits from its submission until its first token (or its end). This client
        counts its own, from the outputs it reads, so the count is the same whether the core
        runs here, in an engine process or in several (each API server counts its own).

        Raises:
            InvalidParameterError: more sequences than the limit: this request can never fit
                (naming ``param``).
            EngineOverloadedError: no room now (a 503: try again later).
        """
        limit = self._engine.core.config.max_waiting_requests
        if num_sequences > limit:
            raise InvalidParameterError(param, f"this request asks for {num_sequences} sequences (prompts x n, or "
                                             f"beams), more than this server queues at once ({limit}, "
                                             "max_waiting_requests)")
        waiting = self.num_waiting_sequences
        if waiting + num_sequences > limit:
            raise EngineOverloadedError(f"the server is overloaded: {waiting} sequences are waiting and this request "
                                        f"adds {num_sequences} (max_waiting_requests {limit}); try again later")

    @property
    def num_waiting_sequences(self) -> int:
        """Sequences this client submitted that have not produced a token yet, nor ended, and
        those a running beam search holds room for."""
        engine = self._engine
        return sum(channel.state.num_waiting for channel in engine.registry.values()) + engine.reserved

    @contextlib.contextmanager
    def reserve(self, num_sequences: int, param: str = "beam_width") -> Iterator[None]:
        """Hold waiting room for ``num_sequences`` for the block (beam searches', whose steps
        wait in it: ``add_requests(admitted=True)``), after checking there is room
        (``check_room``, naming ``param``)."""
        self.check_room(num_sequences, param)
        self._engine.reserved += num_sequences
        try:
            yield
        finally:
            self._engine.reserved -= num_sequences

    def abort(self, request_id: str | Iterable[str]) -> _Done:
        """Abort a request, or several (vLLM's forms); a no-op for unknown or finished ones (or
        a stopped engine). It needs no await, and may be awaited (vLLM's ``abort`` is async).

        Raises:
            TypeError: a request id that is not a string.
        """
        ids = (request_id,) if isinstance(request_id, str) else tuple(request_id)
        for one in ids:
            if not isinstance(one, str):
                raise TypeError(f"request ids are strings; got {type(one).__name__}")
        engine = self._engine
        if engine.running and ids:
            engine.send(AbortRequest(ids))
        elif not engine.running:
            for one in ids:
                engine.registry.pop(one, None)
        return _DONE

    async def steps(self) -> AsyncIterator[StepOutput]:
        """Every step's output, as it happens (for user actors: logging, metrics, tracing).

        A subscriber that falls ``SUBSCRIBER_QUEUE_SIZE`` steps behind misses steps rather than
        slowing the engine. Ends when the engine stops.
        """
        if not self._engine.running:  # (no step will come, nor the close that ends the loop)
            raise self._engine.error or EngineDeadError("the engine is not running")
        send, receive = trio.open_memory_channel(SUBSCRIBER_QUEUE_SIZE)
        self._engine.subscribers.add(send)
        try:
            async with receive:
                async for step in receive:
                    yield step
        finally:
            self._engine.subscribers.discard(send)


def encoded(prompt: str | list[int] | dict[str, Any]) -> bool:
    """Whether a prompt's ids come from the tokenizer (a text), not the caller."""
    return isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt)


@asynccontextmanager
async def open_engine(config=None, *, engine_fds: Sequence[int] | None = None,
                      **fields: Any) -> AsyncIterator[EngineClient]:
    """Load a model and run the engine for the duration of the block (with
    ``engine_process=True``, the engine core in a process of its own).

    Args:
        config: an ``EngineConfig``; or give its fields as keywords instead.
        engine_fds: sockets to engine processes another process started (a front of
            ``--api-server-count``): this front links to them instead of starting its own.

    Yields:
        the ``EngineClient``.
    """
    from engine.config import EngineConfig
    from engine.tokenizer import tokenizer_for

    if config is None:
        config = EngineConfig.from_kwargs(**fields)
    elif fields:
        raise InvalidParameterError(next(iter(fields)), "give a config or keyword fields, not both")
    if engine_fds or config.engine_process or config.data_parallel_size > 1 or config.data_parallel_local < 1:
        engines = attached_engines(config, engine_fds) if engine_fds else engine_processes(
            config, config.data_parallel_size)
        # (ungrouped: an error of the caller's block, or the engine's, leaves it as itself, not
        # inside the engine nursery's ExceptionGroup)
        with ungrouped():
            async with engines as cores:
                core = cores[0] if len(cores) == 1 else DataParallelCore(cores)
                tokenizer = await trio.to_thread.run_sync(tokenizer_for, config)
                checks = StructuredOutputManager.for_engine(tokenizer, core.vocab_size, config, validate_only=True)
                async with Engine(core, tokenizer, checks).serve() as client:
                    yield client
        return
    core = await trio.to_thread.run_sync(EngineCore, config)
    try:
        tokenizer = await trio.to_thread.run_sync(tokenizer_for, config)
        with ungrouped():
            async with Engine(core, tokenizer).serve() as client:
                yield client
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(core.close)  # (tensor-parallel ranks end with the engine)
