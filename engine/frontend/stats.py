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
    """One request (all its ``n`` completions) that has ended, however it ended."""

    finish_reasons: tuple[str, ...]  # per completion: 'stop' | 'length' | 'abort' | 'error'
    e2e_latency: float  # seconds from arrival to the end
    queue_time: float | None  # seconds from arrival to first scheduling; None if never scheduled
    num_prompt_tokens: int
    num_generation_tokens: int
    prefill_time: float | None = None  # first scheduling to first token (None: no token came)
    decode_time: float | None = None  # first token to last token
    max_num_generation_tokens: int = 0  # the longest completion's tokens
    n: int = 1  # completions asked for


@attrs.define
class IterationStats:
    """What one engine step (or one engine failure) produced, in seconds of ``time.monotonic()``."""

    now: float
    time_to_first_tokens: list[float] = attrs.field(factory=list)
    inter_token_latencies: list[float] = attrs.field(factory=list)
    finished: list[FinishedRequestStats] = attrs.field(factory=list)

    @property
    def empty(self) -> bool:
        return not (self.time_to_first_tokens or self.inter_token_latencies or self.finished)


# A stat logger takes each step's IterationStats; it runs in the event loop, so it must be quick.
StatLogger = Callable[[IterationStats], None]


@attrs.define
class RequestTimes:
    """One request's clock (monotonic seconds)."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None

    def on_tokens(self, stats: IterationStats) -> None:
        """Tokens of this request arrived in the step ``stats`` describes (counted once per step)."""
        if self.first_token is None:
            self.first_token = stats.now
            stats.time_to_first_tokens.append(stats.now - self.arrival)
        elif stats.now != self.last_token:
            stats.inter_token_latencies.append(stats.now - self.last_token)
        self.last_token = stats.now

    def finished(self, stats: IterationStats, reasons: tuple[str, ...], num_prompt_tokens: int,
                 generation_tokens: tuple[int, ...]) -> None:
        """The request ended; ``generation_tokens``: each completion's."""
        queue = None if self.first_scheduled is None else max(0.0, self.first_scheduled - self.arrival)
        prefill = decode = None
        if self.first_token is not None and self.first_scheduled is not None:
            prefill = max(0.0, self.first_token - self.first_scheduled)
            decode = max(0.0, (self.last_token or self.first_token) - self.first_token)
        stats.finished.append(FinishedRequestStats(reasons, stats.now - self.arrival, queue, num_prompt_tokens,
                                                   sum(generation_tokens), prefill, decode, max(generation_tokens),
                                                   len(generation_tokens)))


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
