"""Values that cross the engine's boundaries (and, in the actor graph, its channels). All frozen."""

from __future__ import annotations

import attrs

from engine.outputs import TokenLogprobs


@attrs.frozen
class TokenDelta:
    """What one step added to one completion (``index`` of request ``request_id``)."""

    request_id: str
    index: int
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    new_prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort' once finished
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
