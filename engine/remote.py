"""The engine core in a process of its own, joined to the front by ``engine.wire``.

The actor graph does not change: the front keeps the detokenizer actor and one output
channel per request; the core actor runs in the engine process (``engine.core_process``).
Only the channel between them becomes a link:

    front                                        engine process
    client --AddRequest/AbortRequest--> inbox ==link==> inlet --> core actor
    detokenizer <-- steps <---------------------==link== <-- StepOutput (one per step)

``RemoteCore`` stands in for the ``EngineCore`` in the front's ``Engine``: it answers what the
front asks of a core (limits for validation, the latest stats) from the engine's
``EngineReady`` and from the stats riding on every step, and its actor pumps the two
channels through the link.

Death: the engine process's ``EngineFailed`` message, its socket closing without a goodbye,
and the process exiting all end the front's actor with an error, which the ``Engine`` turns
into one ``EngineDeadError`` for every open stream (and ``/health`` 503). The engine process
exits when its front goes away: an orderly close of the link, or the link breaking (the
kernel closes a dead front's socket, whatever killed it). (Not PR_SET_PDEATHSIG: it fires
when the *thread* that forked exits, and trio starts processes from worker threads.)
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from engine.config import EngineConfig
from engine.engine_core import validate_request
from engine.errors import EngineDeadError
from engine.messages import WIRE_MESSAGES, AddRequest, EngineStats
from engine.sampling_params import SamplingParams
from engine.wire import Codec, open_link

log = logging.getLogger(__name__)


@attrs.frozen
class EngineReady:
    """The engine process's first message: what the front needs to know of its core."""

    max_model_len: int
    vocab_size: int
    backend_name: str
    sampling_defaults: dict[str, float]
    stats: EngineStats
    pid: int


@attrs.frozen
class EngineFailed:
    """The engine process's last message when it could not start or a step failed."""

    error: Exception


CODEC = Codec([*WIRE_MESSAGES, EngineReady, EngineFailed])

# How long a front waits for its engine process to exit after closing the link, before killing it.
EXIT_TIMEOUT = 10.0


class RemoteCore:
    """The front's stand-in for an ``EngineCore`` running in an engine process."""

    def __init__(self, config: EngineConfig, ready: EngineReady, send, receive, process) -> None:
        self.config = config
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.backend_name = ready.backend_name
        self.sampling_defaults = dict(ready.sampling_defaults)
        self.pid = ready.pid
        self.fault: BaseException | None = None
        self._stats = ready.stats
        self._send = send
        self._receive = receive
        self._process = process

    def validate(self, prompt: list[int], params: SamplingParams, priority: int = 0) -> int:
        return validate_request(prompt, params, priority, max_model_len=self.max_model_len,
                                vocab_size=self.vocab_size, scheduling_policy=self.config.scheduling_policy)

    def stats(self) -> EngineStats:
        """The engine's counters as of its latest step."""
        return self._stats

    @property
    def num_running_requests(self) -> int:
        return self._stats.num_running

    def abort_all(self) -> list:
        """Nothing to do here: the engine process aborts its requests when its front goes away."""
        return []

    def actor(self, inbox: trio.MemoryReceiveChannel, outbox: trio.MemorySendChannel) -> RemoteCoreActor:
        return RemoteCoreActor(self, inbox, outbox)

    def _died(self, cause: BaseException) -> EngineDeadError:
        code = self._process.poll()
        how = (f"exited with status {code}" if code is not None and code >= 0 else
               f"was killed by {signal.Signals(-code).name}" if code is not None else "stopped answering")
        error = EngineDeadError(f"the engine process (pid {self.pid}) {how}: {cause}")
        error.__cause__ = cause
        return error


class RemoteCoreActor:
    """The core actor's place in the front: messages from the inbox go down the link; the
    engine's step outputs come up it to the detokenizer."""

    def __init__(self, core: RemoteCore, inbox: trio.MemoryReceiveChannel, outbox: trio.MemorySendChannel) -> None:
        self._core = core
        self._inbox = inbox
        self._outbox = outbox

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        core = self._core
        task_status.started()
        async with self._outbox, trio.open_nursery() as nursery:
            nursery.start_soon(self._forward)
            try:
                async for message in core._receive:
                    if isinstance(message, EngineFailed):
                        raise EngineDeadError(f"the engine failed: {message.error!r}") from message.error
                    core._stats = message.stats
                    await self._outbox.send(message)
            except trio.BrokenResourceError as exc:
                await trio.sleep(0.05)  # the process's exit status, if it is exiting
                raise core._died(exc) from None
            # Only the front ends the link in order; an engine that ends it has stopped.
            raise core._died(EngineDeadError("the engine process closed the link"))

    async def _forward(self) -> None:
        async for message in self._inbox:
            if isinstance(message, AddRequest) and message.grammar is not None:
                # A compiled grammar stays in this process; the engine compiles its own (cached).
                message = attrs.evolve(message, grammar=None)
            try:
                await self._core._send.send(message)
            except trio.BrokenResourceError:
                return  # the receiving side reports how the engine died


@asynccontextmanager
async def engine_process(config: EngineConfig) -> AsyncIterator[RemoteCore]:
    """Start an engine process for ``config`` and yield its ``RemoteCore`` once it is ready.

    Leaving the block closes the link (the engine aborts what is left and exits), waits for
    the process, and kills it if it does not exit within ``EXIT_TIMEOUT``: no child is left.

    Raises:
        the engine's own error (``ConfigError``...) if it could not start; ``EngineDeadError``
        if the process died first.
    """
    front_socket, engine_socket = socket.socketpair()
    argv = [sys.executable, "-m", "engine.core_process", "--fd", str(engine_socket.fileno()),
            "--config", json.dumps(attrs.asdict(config))]
    try:
        # A session of its own: a terminal's Ctrl-C goes to the front, which ends the engine in order.
        process = await trio.lowlevel.open_process(argv, pass_fds=(engine_socket.fileno(),),
                                                   start_new_session=True)
    finally:
        engine_socket.close()
    startup_error: BaseException | None = None
    try:
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(front_socket))
        async with open_link(stream, CODEC, role="front") as (send, receive):
            try:
                first = await receive.receive()
            except (trio.BrokenResourceError, trio.EndOfChannel) as exc:
                await _reap(process, 1.0)
                first = EngineFailed(EngineDeadError(f"the engine process exited ({_status(process)}) before it "
                                                     f"was ready: {exc}"))
            if isinstance(first, EngineFailed):
                startup_error = first.error  # raised below, outside the link's nursery: as in one process
            else:
                log.info("engine process %d ready", first.pid)
                try:
                    yield RemoteCore(config, first, send, receive, process)
                finally:
                    await send.aclose()  # orderly: the engine sees the end of its inbox
    finally:
        with trio.CancelScope(shield=True):
            await _reap(process, EXIT_TIMEOUT)
    if startup_error is not None:
        raise startup_error


async def _reap(process, timeout: float) -> None:
    with trio.move_on_after(timeout):
        await process.wait()
        return
    log.warning("engine process %d did not exit within %g s: killing it", process.pid, timeout)
    process.kill()
    await process.wait()


def _status(process) -> str:
    code = process.poll()
    if code is None:
        return "still running"
    return f"status {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
