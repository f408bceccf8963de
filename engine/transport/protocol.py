"""What both processes of a split engine share: the wire's message set, the engine's first
and last messages, and which place (front, or engine of a group) owns each live request."""

from __future__ import annotations

import attrs

from engine.messages import WIRE_MESSAGES, AddRequest, EngineStats, KVCacheInfo, StepOutput
from engine.transport.wire import Codec


@attrs.frozen
class EngineReady:
    """The engine process's first message: what the front needs to know of its core."""

    model: str  # what it serves: every engine of a data-parallel group must serve the same
    max_model_len: int
    vocab_size: int
    backend_name: str
    sampling_defaults: dict[str, int | float]  # (top_k an int: msgspec would make it a float)
    eos_token_ids: tuple[int, ...]
    kv_cache_info: KVCacheInfo
    stats: EngineStats
    pid: int
    data_parallel_rank: int  # (no two engines of a group may share one)
    clock: float  # the engine's time.monotonic() as it sent this (another machine's runs from another zero)


@attrs.frozen
class EngineFailed:
    """The engine process's last message when it could not start or a step failed."""

    error: Exception


@attrs.frozen
class Heartbeat:
    """Sent by the engine process to each front every ``HEARTBEAT_S``, whatever it is doing: a
    front that hears nothing for ``SILENCE_LIMIT_S`` knows the process has stopped (SIGSTOP, a
    wedged interpreter), which no watchdog inside it could report. ``clock``: as EngineReady's
    (a front keeps the times of an engine of another machine on its own clock by it)."""

    clock: float


# Seconds between an engine process's heartbeats, and of silence after which a front declares
# it dead. A long step is no silence: the heartbeats come from the event loop, the step runs
# on the device thread (the engine's own watchdog bounds steps: step_timeout).
HEARTBEAT_S = 1.0
SILENCE_LIMIT_S = 30.0
# How long an engine process waits for its front's Hello: the front may be held up by other
# joins (a connection that says nothing takes the link's 30 s to drop); a front that is gone
# closes the stream, which ends the wait at once.
ENGINE_HANDSHAKE_TIMEOUT_S = 300.0

CODEC = Codec([*WIRE_MESSAGES, EngineReady, KVCacheInfo, EngineFailed, Heartbeat])

class RequestOwners:
    """Which of several places (an engine of a data-parallel group, a front of an engine) each
    live request belongs to, until the step outputs show all its sequences finished."""

    def __init__(self) -> None:
        self._owner: dict[str, int] = {}  # request id -> place
        self._open: dict[str, int] = {}  # request id -> sequences not finished yet

    def add(self, message: AddRequest, place: int) -> None:
        self._owner[message.request_id] = place
        self._open[message.request_id] = message.params.n

    def get(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def of(self, place: int) -> tuple[str, ...]:
        return tuple(r for r, p in self._owner.items() if p == place)

    def forget_finished(self, step: StepOutput) -> None:
        for rejected in step.rejected:
            self._open.pop(rejected.request_id, None)
            self._owner.pop(rejected.request_id, None)
        for delta in step.deltas:
            if delta.finished and delta.request_id in self._open:
                self._open[delta.request_id] -= 1
                if self._open[delta.request_id] <= 0:
                    del self._open[delta.request_id], self._owner[delta.request_id]
