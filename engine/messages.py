"""Values that cross the engine's boundaries (and, in the actor graph, its channels). All frozen."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import attrs

from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams, StructuredOutputsParams


@attrs.frozen
class TokenDelta:
    """What one step added to one completion (``index`` of request ``request_id``)."""

    request_id: str
    index: int
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    new_prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort' | 'error' once finished
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_at: float | None = None
    error: str | None = None  # why this request failed alone (finish_reason 'error')
    error_param: str | None = None  # the parameter at fault, where the caller's parameters were (a 400)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.frozen
class Decodes:
    """The step's common delta, as columns: one new token for each of many completions (entry
    ``i``: completion ``indices[i]`` of request ``request_ids[i]``) that already have output, ask
    for no logprobs and did not finish. A step of many streams builds three tuples rather than a
    ``TokenDelta`` each; every other delta (a first token, logprobs, a finish, an error) is one."""

    request_ids: tuple[str, ...] = ()
    indices: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.request_ids)

    def select(self, keep: Callable[[str], bool]) -> Decodes:
        """The entries whose request id ``keep`` accepts."""
        rows = [i for i, request_id in enumerate(self.request_ids) if keep(request_id)]
        if len(rows) == len(self.request_ids):
            return self
        return Decodes(tuple(self.request_ids[i] for i in rows), tuple(self.indices[i] for i in rows),
                       tuple(self.token_ids[i] for i in rows))

    def as_deltas(self) -> list[TokenDelta]:
        return [TokenDelta(r, i, (t,)) for r, i, t in zip(self.request_ids, self.indices, self.token_ids)]


@attrs.frozen
class EngineStats:
    """A snapshot of the engine's counters (what ``/metrics`` reports)."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    num_prompt_tokens: int  # prompt tokens computed (cache hits excluded)
    num_generation_tokens: int
    num_steps: int
    # Speculative decoding (vLLM's spec_decode counters; zero without it): steps of a request
    # that carried drafts, draft tokens, drafts kept, and drafts kept per position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # Prompt tokens of the sequences that produced a first token, cached or computed: vLLM's
    # vllm:prompt_tokens (a preempted sequence counts once).
    num_request_prompt_tokens: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @classmethod
    def total(cls, each: list[EngineStats]) -> EngineStats:
        """Several engines' counters added up (tuples of counts position by position)."""
        def added(field: attrs.Attribute) -> Any:
            values = [getattr(s, field.name) for s in each]
            if isinstance(field.default, tuple):
                return tuple(map(sum, itertools.zip_longest(*values, fillvalue=0)))
            return sum(values)

        return cls(**{f.name: added(f) for f in attrs.fields(cls)})


@attrs.frozen
class KVCacheInfo:
    """What an engine's KV cache is, fixed at start-up (``/metrics``' ``vllm:cache_config_info``)."""

    block_size: int  # tokens a block
    num_blocks: int
    cache_dtype: str  # resolved: never "auto"
    bytes_per_token: int  # of a token held in every layer
    enable_prefix_caching: bool
    sliding_window: int | None  # the widest window of a windowed layer group, if any


# ---- messages to the core actor ----

@attrs.frozen
class AddRequest:
    """Queue a request. The core validates it; a rejection reaches the request's stream."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 0
    grammar: Any = None  # params.structured_outputs, compiled by the front (a CompiledGrammar)


@attrs.frozen
class AbortRequest:
    """Stop requests (by the caller's ids) and free their KV blocks; unknown ids are ignored."""

    request_ids: tuple[str, ...]


@attrs.frozen
class StopRequest:
    """Finish one completion as 'stop' (the detokenizer found stop string ``stop_reason``) after
    its first ``num_tokens`` output tokens (the core may have made more: no output shows them)."""

    request_id: str
    index: int
    stop_reason: str
    num_tokens: int


@attrs.frozen
class RequestRejected:
    """The core refused an ``AddRequest``; ``error`` says why (an InvalidParameterError)."""

    request_id: str
    error: Exception


@attrs.frozen
class StepTimings:
    schedule_s: float
    execute_s: float
    update_s: float


@attrs.frozen
class StepOutput:
    """One engine step's results, from the core actor to the detokenizer and step subscribers:
    what it added to each completion is in ``deltas`` and ``decodes`` (each completion in one of
    them)."""

    deltas: tuple[TokenDelta, ...]
    rejected: tuple[RequestRejected, ...]
    stats: EngineStats
    num_scheduled_tokens: int
    num_scheduled_seqs: int
    timings: StepTimings | None
    decodes: Decodes = Decodes()

    def all_deltas(self) -> list[TokenDelta]:
        """Every delta of the step as a ``TokenDelta`` (for readers that want one form)."""
        return [*self.deltas, *self.decodes.as_deltas()]


# What crosses a process boundary (engine.transport.wire): the messages to and from the core actor, and
# every class their fields hold (all of them part of the wire's digest).
WIRE_MESSAGES = (AddRequest, AbortRequest, StopRequest, StepOutput, TokenDelta, Decodes, RequestRejected,
                 EngineStats, StepTimings, TokenLogprobs, SamplingParams, StructuredOutputsParams)
