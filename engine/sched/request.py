"""Per-sequence state the scheduler and block manager work on (no trio, no torch)."""

from __future__ import annotations

import enum
from typing import Any

import attrs

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS or a stop token (or, later, a stop string)
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # this request's own part of a step failed (the engine is fine)

    # Members are singletons compared by identity: hash them so too (C) rather than by name
    # (Enum.__hash__, Python), since every request asks ``finished`` several times a step.
    __hash__ = object.__hash__

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                       RequestStatus.FINISHED_ERROR})

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@attrs.define(eq=False)
class Request:
    """One sequence being generated. A request with ``n > 1`` becomes ``n`` of these.

    ``token_ids`` is prompt + output so far; the KV cache holds the first
    ``num_computed_tokens`` of them. A running request in decode has exactly one token
    (the last sampled) not yet computed.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, capped by max_model_len
    eos_token_id: int | None
    arrival_order: int  # tie-break for scheduling; lower is older
    priority: int = 0
    parent_id: str = ""  # the caller's request id; differs from request_id only when n > 1
    index: int = 0  # which of the parent's n completions this is
    token_ids: list[int] = attrs.field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_cached_tokens: int = -1  # prefix-cache hit length at first admission; -1 until admitted
    num_preemptions: int = 0
    num_prompt_logprobs: int = 0  # prompt positions whose logprobs were reported (they survive preemption)
    first_scheduled_at: float | None = None  # time.monotonic() at first admission
    block_hashes: list[bytes] = attrs.field(factory=list)  # hashes of full blocks of token_ids, in order
    # How many of its block ids the model runner has been sent; -1: the runner has no state for
    # it (not scheduled since it was admitted or preempted). The scheduler's step plan keeps it.
    num_runner_blocks: int = -1
    # Leading blocks given back by the sliding layer groups because their window has passed them
    # (their places in those groups' tables hold BlockManager.WINDOWED_OUT).
    num_windowed_out: int = 0
    # This sequence's place in its structured-output grammar (None: unconstrained). The engine
    # core fills its token mask into each step's plan and advances it by the sampled token; it
    # survives preemption, since recomputing samples nothing twice.
    matcher: Any = None
    # Proposed tokens after the last known one, computed in the step being scheduled
    # (speculative decoding; empty when none): the step's plan carries them after that token.
    spec_token_ids: list[int] = attrs.field(factory=list)
    # A draft model's proposals after the last known token, from the step that sampled it
    # (speculative method draft_model): what the next step's drafts are taken from.
    proposed_token_ids: tuple[int, ...] = ()
    # Where each n-gram of token_ids starts (speculative method ngram: engine.speculative's
    # NgramIndex), made at its first lookup and kept up to date by each one after it.
    ngram_index: Any = None

    def __attrs_post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.parent_id = self.parent_id or self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
