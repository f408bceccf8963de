"""The output actor: turns the core's step outputs into per-request state and wakes streams."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from engine.errors import InvalidParameterError, RequestFailedError
from engine.frontend.output_channel import RequestOutputChannel
from engine.frontend.request_state import StopStringHit
from engine.frontend.stats import IterationStats
from engine.messages import AbortRequest, StepOutput, StopRequest

log = logging.getLogger(__name__)


class OutputActor:
    """Turns the core's ``StepOutput``s into per-request state and wakes each request's stream.

    It never waits on a consumer: streams read the latest state when they get to it. A
    request stays in the registry until the core has finished it (not just until its stream
    has ended), so its id cannot be reused while a late delta of it may still arrive. An
    error in one request's own processing fails that request and aborts it in the core.

    Args:
        steps: step outputs from the core actor.
        core_inbox: where stop-string hits (``StopRequest``) and aborts go.
        registry: request id -> the request's output channel (owned by the engine).
        on_step: called with every step output and the timings observed in it, after the
            streams are updated (subscribers, stat loggers).
    """

    def __init__(self, steps: trio.MemoryReceiveChannel, core_inbox: trio.MemorySendChannel, registry: dict,
                 on_step: Callable[[StepOutput, IterationStats], None]) -> None:
        self._steps = steps
        self._core_inbox = core_inbox
        self._registry = registry
        self._on_step = on_step

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._steps:
            async for step in self._steps:
                self.process(step)

    def process(self, step: StepOutput) -> None:
        stats = IterationStats(time.monotonic())
        for rejected in step.rejected:
            channel = self._registry.pop(rejected.request_id, None)
            if channel is not None:
                channel.fail(rejected.error)
        registry = self._registry
        for delta in step.deltas:
            channel = registry.get(delta.request_id)
            if channel is not None:  # else the consumer's abort is on the way
                state = channel.state
                try:
                    hit = state.apply(delta, stats)
                except Exception as exc:  # this request's own output processing failed; the rest go on
                    self._fail(channel, delta.request_id, stats, exc)
                else:
                    self._applied(channel, delta.request_id, hit)
                if delta.finished and state.engine_finished:
                    del registry[delta.request_id]
        # The common delta, one more token of a stream, is most of a step's work: the same as
        # above, with the checks that cannot apply to it left out (it carries no error).
        decodes = step.decodes
        for request_id, index, token in zip(decodes.request_ids, decodes.indices, decodes.token_ids):
            channel = registry.get(request_id)
            if channel is not None:
                try:
                    hit = channel.state.add_token(index, token, stats)
                except Exception as exc:
                    self._fail(channel, request_id, stats, exc)
                    continue
                if hit is not None:
                    self._core_inbox.send_nowait(StopRequest(request_id, hit.index, hit.stop, hit.num_tokens))
                channel.notify()
        self._on_step(step, stats)

    def _applied(self, channel: RequestOutputChannel, request_id: str, hit: StopStringHit | None) -> None:
        """A delta is in the request's state: report a stop-string hit to the core, end a failed
        request's stream, wake the stream."""
        if hit is not None:
            self._core_inbox.send_nowait(StopRequest(request_id, hit.index, hit.stop, hit.num_tokens))
        state = channel.state
        if state.error is not None:
            channel.fail(InvalidParameterError(state.error_param, state.error) if state.error_param else
                         RequestFailedError(f"request {request_id} failed: {state.error}"))
        channel.notify()

    def _fail(self, channel: RequestOutputChannel, request_id: str, stats: IterationStats, exc: Exception) -> None:
        """Processing this request's output raised: fail the request and abort it in the core."""
        log.exception("processing the output of request %s failed", request_id, exc_info=exc)
        channel.state.fail(stats, f"{type(exc).__name__}: {exc}")
        self._core_inbox.send_nowait(AbortRequest((request_id,)))
        self._applied(channel, request_id, None)
