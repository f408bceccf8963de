"""``Core``: what the front asks of an engine core, wherever the core runs."""

from __future__ import annotations

from typing import Protocol

import trio

from engine.config import EngineConfig
from engine.messages import EngineStats, KVCacheInfo
from engine.sampling_params import SamplingParams


class CoreActorLike(Protocol):
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Pump the inbox into the core and its step outputs into the outbox until the inbox
        closes (or the core fails: then raise)."""


class Core(Protocol):
    """The interface the front's ``Engine`` drives: ``EngineCore`` (in this process),
    ``RemoteCore`` (an engine process) and ``DataParallelCore`` (several) all give it."""

    config: EngineConfig
    max_model_len: int
    vocab_size: int
    backend_name: str
    sampling_defaults: dict[str, int | float]
    eos_token_ids: tuple[int, ...]  # the model's end tokens (its EOS, then generation_config's others)
    fault: BaseException | None  # set once a step failed: the core must not run again

    def validate(self, prompt: list[int], params: SamplingParams, priority: int = 0) -> int:
        """Check a prompt and its parameters against the model; the resolved max_tokens."""

    def stats(self) -> EngineStats:
        """The counters as of the latest step (summed over a group's engines)."""

    def engine_stats(self) -> list[EngineStats]:
        """Each engine's counters (one for a single core)."""

    def engine_kv_caches(self) -> list[KVCacheInfo]:
        """Each engine's KV cache, as it started (one for a single core)."""

    @property
    def num_running_requests(self) -> int: ...

    def abort_all(self) -> list:
        """Abort what is live here (after a fault, or at shutdown); deltas where there are any."""

    def actor(self, inbox: trio.MemoryReceiveChannel, outbox: trio.MemorySendChannel) -> CoreActorLike:
        """The actor that steps this core: messages in from ``inbox``, step outputs out to ``outbox``."""
