"""The core actor: owns the ``EngineCore`` and runs its steps, the device work on the device thread."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import trio

from engine.errors import InvalidParameterError, RequestFailedError, StepTimeoutError
from engine.messages import (
    AbortRequest,
    AddRequest,
    Decodes,
    RequestRejected,
    StepOutput,
    StepTimings,
    StopRequest,
    TokenDelta,
)
from engine.plan import RunnerOutput

if TYPE_CHECKING:  # (the core builds its own actor: ``EngineCore.actor``)
    from engine.core.engine_core import EngineCore
    from engine.sched.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

# (A RequestRejected in the inbox is a request refused before it reached the core: an engine
# process's inlet sends one when the request's grammar would not compile there.)
Message = AddRequest | AbortRequest | StopRequest | RequestRejected


# Step outputs the core may run ahead of the output actor before it waits.
STEP_QUEUE_SIZE = 4
# Seconds between looks, while idle, at what a step would find broken (a tensor-parallel rank
# gone): an idle server whose engine cannot step says so (/health 503, exit) before a request does.
IDLE_CHECK_INTERVAL = 1.0


class CoreActor:
    """Loop: drain the inbox (adds, aborts, stops) -> schedule -> execute on the device thread
    -> update -> send a ``StepOutput``. With nothing to run it sleeps on the inbox.

    Aborts are applied only between steps, in the event loop, so the worker thread never
    sees the scheduler change under it; an aborted request's blocks are free before the
    next step is scheduled.

    An exception from a step ends the actor: ``run`` raises it after closing its outbox,
    and the engine turns it into ``EngineDeadError`` for every consumer.

    Args:
        core: the synchronous engine core.
        inbox: messages from clients and the output actor (unbounded: senders never block).
        outbox: step outputs to the output actor.
    """

    def __init__(self, core: EngineCore, inbox: trio.MemoryReceiveChannel, outbox: trio.MemorySendChannel) -> None:
        self.core = core
        self._inbox = inbox
        self._outbox = outbox
        # Results of messages (rejections, abort deltas) that ride out with the next step output.
        self._rejected: list[RequestRejected] = []
        self._extra_deltas: list[TokenDelta] = []

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._outbox:
            while True:
                self._drain()
                if not self.core.has_unfinished_requests:
                    if self._rejected or self._extra_deltas:
                        await self._send(self._step_output([], 0, 0, None))
                    try:
                        with trio.move_on_after(IDLE_CHECK_INTERVAL) as idle:
                            self._apply(await self._inbox.receive())
                    except trio.EndOfChannel:
                        return
                    if idle.cancelled_caught:
                        self.core.check_health()
                    continue
                await self._step()

    async def _step(self) -> None:
        t0 = time.perf_counter()
        plan = self.core.schedule()
        t1 = time.perf_counter()
        result = await self._execute(plan)
        t2 = time.perf_counter()
        deltas, decodes = self.core.update(plan, result)
        t3 = time.perf_counter()
        await self._send(self._step_output(deltas, plan.num_batched_tokens, len(plan.chunks),
                                           StepTimings(t1 - t0, t2 - t1, t3 - t2), decodes))

    async def _execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """The step's device work on the core's device thread, under the watchdog.

        Shielded: shutting down waits for the step in flight (its K/V writes must not race
        the blocks being freed), but never longer than ``step_timeout``: a step that does not
        return by then is abandoned in its thread and the engine is declared dead.
        """
        timeout = self.core.config.step_timeout
        with trio.CancelScope(shield=True), trio.move_on_after(math.inf if timeout is None else timeout):
            return await self.core.device_thread.run(self.core.execute, plan)
        raise StepTimeoutError(f"an engine step ran for more than {timeout} s (step_timeout): a hung kernel?")

    def _step_output(self, deltas: list[TokenDelta], num_tokens: int, num_seqs: int,
                     timings: StepTimings | None, decodes: Decodes = Decodes()) -> StepOutput:
        extra, self._extra_deltas = self._extra_deltas, []
        rejected, self._rejected = tuple(self._rejected), []
        return StepOutput(tuple(extra + deltas), rejected, self.core.stats(), num_tokens, num_seqs, timings, decodes)

    async def _send(self, step: StepOutput) -> None:
        await self._outbox.send(step)

    def _drain(self) -> None:
        while True:
            try:
                self._apply(self._inbox.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                return

    def _apply(self, message: Message) -> None:
        if isinstance(message, AddRequest):
            try:
                self.core.add_request(message.request_id, message.prompt_token_ids, message.params, message.priority,
                                      message.grammar)
            except InvalidParameterError as exc:
                self._rejected.append(RequestRejected(message.request_id, exc))
            except Exception as exc:  # a fault of this request's own, not of the engine
                log.exception("request %s could not be added", message.request_id)
                error = RequestFailedError(f"the engine could not add the request: {exc!r}")
                self._rejected.append(RequestRejected(message.request_id, error))
        elif isinstance(message, AbortRequest):
            self._extra_deltas += self.core.abort_requests(message.request_ids)
        elif isinstance(message, StopRequest):
            delta = self.core.finish_request(message.request_id, message.index, message.stop_reason,
                                             message.num_tokens)
            if delta is not None:
                self._extra_deltas.append(delta)
        elif isinstance(message, RequestRejected):
            self._rejected.append(message)
        else:
            raise TypeError(f"unexpected message {message!r}")
