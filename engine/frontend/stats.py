"""Per-request timings the engine observes, handed to stat loggers (``/metrics`` is one).

The output actor stamps each step's outputs as it applies them, whatever output kind
the consumer asked for, so time to first token and inter-token latency are the engine's
own, not the moments a consumer happened to read its stream. Requests that end by abort or
error are reported too.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from engine.messages import EngineStats


@attrs.frozen
class FinishedRequestStats:
    """One sequence that has ended, however it ended: a request, or one of a request's ``n``
    completions (each counts as one, as vLLM's child requests do)."""

    finish_reason: str  # 'stop' | 'length' | 'abort' | 'error'
    e2e_latency: float  # seconds from arrival to the end
    queue_time: float | None  # seconds from arrival to first scheduling; None if never scheduled
    num_prompt_tokens: int
    num_generation_tokens: int
    prefill_time: float | None = None  # first scheduling to first token (None: no token came)
    decode_time: float | None = None  # first token to last token


@attrs.define
class IterationStats:
    """What one engine step (or one engine failure) produced, in seconds of ``time.monotonic()``."""

    now: float
    time_to_first_tokens: list[float] = attrs.field(factory=list)
    inter_token_latencies: list[float] = attrs.field(factory=list)
    finished: list[FinishedRequestStats] = attrs.field(factory=list)
    # Of each request whose completions have all ended (vLLM's parent request): its n, and
    # its longest completion's tokens.
    params_n: list[int] = attrs.field(factory=list)
    max_num_generation_tokens: list[int] = attrs.field(factory=list)

    @property
    def empty(self) -> bool:
        return not (self.time_to_first_tokens or self.inter_token_latencies or self.finished or self.params_n)


# A stat logger takes each step's IterationStats; it runs in the event loop, so it must be quick.
StatLogger = Callable[[IterationStats], None]


@attrs.define
class TokenClock:
    """One sequence's first scheduling, first and latest token (monotonic seconds): the
    completions of a request may be scheduled steps apart."""

    scheduled: float | None = None
    first: float | None = None
    last: float | None = None


@attrs.define
class RequestTimes:
    """One request's clock (monotonic seconds); each of its sequences has a ``TokenClock``."""

    arrival: float
    first_scheduled: float | None = None

    def on_tokens(self, clock: TokenClock, stats: IterationStats) -> None:
        """Tokens of the sequence of ``clock`` arrived in the step ``stats`` describes (counted
        once per step)."""
        if clock.first is None:
            clock.first = stats.now
            stats.time_to_first_tokens.append(stats.now - self.arrival)
        elif stats.now != clock.last:
            stats.inter_token_latencies.append(stats.now - clock.last)
        clock.last = stats.now

    def finished(self, clock: TokenClock, stats: IterationStats, reason: str, num_prompt_tokens: int,
                 num_generation_tokens: int) -> None:
        """The sequence of ``clock`` ended."""
        scheduled = self.first_scheduled if clock.scheduled is None else clock.scheduled
        queue = None if scheduled is None else max(0.0, scheduled - self.arrival)
        prefill = decode = None
        if clock.first is not None and scheduled is not None:
            prefill = max(0.0, clock.first - scheduled)
            decode = max(0.0, (clock.last or clock.first) - clock.first)
        stats.finished.append(FinishedRequestStats(reason, stats.now - self.arrival, queue, num_prompt_tokens,
                                                   num_generation_tokens, prefill, decode))


def activity_line(before: EngineStats, now: EngineStats, seconds: float) -> str | None:
    """What the engines did between two snapshots, as vLLM's periodic log line says it
    (throughputs, requests, KV cache use, and speculative decoding's acceptance where it is
    on); None when nothing happened and nothing runs or waits."""
    prompt = now.num_prompt_tokens - before.num_prompt_tokens
    generated = now.num_generation_tokens - before.num_generation_tokens
    if not (prompt or generated or now.num_running or now.num_waiting):
        return None
    line = (f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, Avg generation throughput: "
            f"{generated / seconds:.1f} tokens/s, Running: {now.num_running} reqs, Waiting: {now.num_waiting} reqs, "
            f"KV cache usage: {100 * now.kv_cache_usage:.1f}%")
    drafts = now.spec_num_drafts - before.spec_num_drafts
    if drafts:
        drafted = now.spec_num_draft_tokens - before.spec_num_draft_tokens
        kept = now.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        line += (f"; SpecDecoding: mean acceptance length {1 + kept / drafts:.2f}, "
                 f"draft acceptance rate {100 * kept / drafted:.1f}%")
    return line
