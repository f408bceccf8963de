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
import math
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import attrs
import trio

from engine.config import EngineConfig, resolve_device
from engine.engine_core import validate_request
from engine.errors import ConfigError, EngineDeadError, first_leaf
from engine.messages import WIRE_MESSAGES, AbortRequest, AddRequest, EngineStats, StepOutput
from engine.sampling_params import SamplingParams
from engine.wire import Codec, open_link

log = logging.getLogger(__name__)


@attrs.frozen
class EngineReady:
    """The engine process's first message: what the front needs to know of its core."""

    model: str  # what it serves: every engine of a data-parallel group must serve the same
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

    def __init__(self, config: EngineConfig, ready: EngineReady, send, receive, process, rank: int = 0) -> None:
        self.config = config
        self.rank = rank  # which engine of a data-parallel group (the ``engine`` label of its metrics)
        self.model = ready.model
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

    def engine_stats(self) -> list[EngineStats]:
        return [self._stats]

    @property
    def num_running_requests(self) -> int:
        return self._stats.num_running

    def abort_all(self) -> list:
        """Nothing to do here: the engine process aborts its requests when its front goes away."""
        return []

    def actor(self, inbox: trio.MemoryReceiveChannel, outbox: trio.MemorySendChannel) -> RemoteCoreActor:
        return RemoteCoreActor(self, inbox, outbox)

    def _died(self, cause: BaseException) -> EngineDeadError:
        code = self._process.poll() if self._process is not None else None
        how = (f"exited with status {code}" if code is not None and code >= 0 else
               f"was killed by {signal.Signals(-code).name}" if code is not None else "stopped answering")
        error = EngineDeadError(f"the engine process (engine {self.rank}, pid {self.pid}) {how}: {cause}")
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
        task_status.started()
        try:
            async with self._outbox, trio.open_nursery() as nursery:
                nursery.start_soon(self._forward)
                await self._receive()
        except BaseExceptionGroup as group:  # the engine's death as itself, not in the nursery's group
            leaf = first_leaf(group)
            if isinstance(leaf, Exception):
                raise leaf from None
            raise

    async def _receive(self) -> None:
        core = self._core
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


class DataParallelCore:
    """``--data-parallel-size N``: N engine processes, each with its own KV cache, behind one
    front. A new request goes to the least-loaded engine (waiting + running as of its latest
    step, plus what was sent to it since); its aborts and stops follow it there. ``stats()``
    adds the engines' counters up; ``engine_stats()`` has each one's (the ``engine`` label of
    the metrics). One engine's death is the group's: every open stream fails."""

    def __init__(self, engines: list[RemoteCore]) -> None:
        first = engines[0]
        self.engines = engines
        self.config = first.config
        self.max_model_len = min(e.max_model_len for e in engines)
        self.vocab_size = first.vocab_size
        self.backend_name = first.backend_name
        self.sampling_defaults = first.sampling_defaults
        self.fault: BaseException | None = None

    validate = RemoteCore.validate  # (the group's limits: the smallest max_model_len)

    def engine_stats(self) -> list[EngineStats]:
        return [e.stats() for e in self.engines]

    def stats(self) -> EngineStats:
        each = self.engine_stats()
        return EngineStats(*(sum(getattr(s, f.name) for s in each) for f in attrs.fields(EngineStats)))

    @property
    def num_running_requests(self) -> int:
        return sum(e.num_running_requests for e in self.engines)

    def abort_all(self) -> list:
        return []

    def actor(self, inbox: trio.MemoryReceiveChannel, outbox: trio.MemorySendChannel) -> DataParallelActor:
        return DataParallelActor(self, inbox, outbox)


class DataParallelActor:
    """The core actor's place in a data-parallel front: routes the inbox's messages to the
    engines, and merges their step outputs into the one outbox."""

    def __init__(self, group: DataParallelCore, inbox: trio.MemoryReceiveChannel,
                 outbox: trio.MemorySendChannel) -> None:
        self._group = group
        self._inbox = inbox
        self._outbox = outbox
        self._owners = RequestOwners()  # request id -> engine
        self._sent_since_step = [0] * len(group.engines)  # requests sent to an engine since its last step

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        engines = self._group.engines
        inboxes = [trio.open_memory_channel(math.inf) for _ in engines]
        relays = [trio.open_memory_channel(0) for _ in engines]
        try:
            async with self._outbox, trio.open_nursery() as nursery:
                for engine, (send, receive), (relay_send, relay_receive) in zip(engines, inboxes, relays):
                    nursery.start_soon(RemoteCoreActor(engine, receive, relay_send).run)
                    nursery.start_soon(self._merge, engine.rank, relay_receive)
                await self._route([send for send, _ in inboxes])
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # one engine's death: its EngineDeadError, not a group of it
            leaf = first_leaf(group)
            if isinstance(leaf, Exception):
                raise leaf from None
            raise

    async def _route(self, inboxes: list[trio.MemorySendChannel]) -> None:
        async for message in self._inbox:
            if isinstance(message, AddRequest):
                rank = min(range(len(inboxes)), key=self._load)
                self._owners.add(message, rank)
                self._sent_since_step[rank] += 1
                inboxes[rank].send_nowait(message)
            elif isinstance(message, AbortRequest):
                by_engine: dict[int, list[str]] = {}
                for request_id in message.request_ids:
                    if (rank := self._owners.get(request_id)) is not None:
                        by_engine.setdefault(rank, []).append(request_id)
                for rank, ids in by_engine.items():
                    inboxes[rank].send_nowait(AbortRequest(tuple(ids)))
            elif (rank := self._owners.get(message.request_id)) is not None:  # StopRequest
                inboxes[rank].send_nowait(message)

    def _load(self, rank: int) -> int:
        stats = self._group.engines[rank].stats()
        return stats.num_waiting + stats.num_running + self._sent_since_step[rank]

    async def _merge(self, rank: int, steps: trio.MemoryReceiveChannel) -> None:
        async for step in steps:
            self._sent_since_step[rank] = 0
            self._owners.forget_finished(step)
            await self._outbox.send(step)


@asynccontextmanager
async def engine_processes(config: EngineConfig, count: int = 1) -> AsyncIterator[list[RemoteCore]]:
    """Start ``count`` engine processes for ``config`` (they load their models at the same time)
    and yield their ``RemoteCore``s once all are ready. With ``data_parallel_size_local`` below
    ``count``, the others join over TCP (``run_headless`` on their machines).

    Leaving the block ends the links in order (each engine aborts what is left and exits),
    waits for the processes, and kills any that does not exit within ``EXIT_TIMEOUT``: no
    child is left.

    Raises:
        an engine's own error (``ConfigError``...) if it could not start; ``EngineDeadError``
        if a process died first.
    """
    local = count if config.data_parallel_size_local is None else min(count, config.data_parallel_size_local)
    processes, streams = [], []
    shares = device_shares(config, local)
    try:
        for share in shares:
            front_socket, engine_socket = socket.socketpair()
            try:
                processes.append(await _start_engine(config, [engine_socket], share))
            except BaseException:
                front_socket.close()
                raise
            streams.append(trio.SocketStream(trio.socket.from_stdlib_socket(front_socket)))
        if count > local:  # the others join over TCP (python -m engine.api --headless, elsewhere)
            streams += await _accept_engines(config, count - local)
        async with _engines(config, streams, processes) as cores:
            yield cores
    finally:
        with trio.CancelScope(shield=True):
            for process in processes:
                await _reap(process, EXIT_TIMEOUT)


@asynccontextmanager
async def engine_process(config: EngineConfig) -> AsyncIterator[RemoteCore]:
    """One engine process (``engine_processes``)."""
    async with engine_processes(config, 1) as (core,):
        yield core


@asynccontextmanager
async def attached_engines(config: EngineConfig, fds: list[int]) -> AsyncIterator[list[RemoteCore]]:
    """The engines another process started (``--api-server-count``'s launcher), one socket each:
    this front's ``RemoteCore``s for them. Leaving the block ends this front's links."""
    streams = [trio.SocketStream(trio.socket.from_stdlib_socket(socket.socket(fileno=fd))) for fd in fds]
    async with _engines(config, streams, []) as cores:
        yield cores


@asynccontextmanager
async def _engines(config: EngineConfig, streams: list[trio.SocketStream],
                   processes: list) -> AsyncIterator[list[RemoteCore]]:
    """Links over ``streams`` (the first ones to ``processes``), each engine's EngineReady, and
    an orderly end of every link when the block is left."""
    startup_error: BaseException | None = None
    async with AsyncExitStack() as links:
        # (the handshake runs in the link's tasks: opening one does not wait for its engine)
        ends = [await links.enter_async_context(open_link(stream, CODEC, role="front")) for stream in streams]
        cores = []
        for rank, (send, receive) in enumerate(ends):
            process = processes[rank] if rank < len(processes) else None
            first = await _first_message(receive, process)
            if isinstance(first, EngineReady) and cores and (first.model, first.vocab_size) != (
                    cores[0].model, cores[0].vocab_size):
                first = EngineFailed(ConfigError("data_parallel_size", (
                    f"engine {rank} serves {first.model} ({first.vocab_size} tokens), engine 0 "
                    f"{cores[0].model} ({cores[0].vocab_size}): every engine must serve the same model")))
            if isinstance(first, EngineFailed):
                startup_error = first.error  # raised below, outside the links' nurseries: as in one process
                break
            log.info("engine process %d (engine %d%s) ready", first.pid, rank, "" if process else ", not a child")
            cores.append(RemoteCore(config, first, send, receive, process, rank))
        if startup_error is None:
            try:
                yield cores
            finally:
                with trio.CancelScope(shield=True):
                    for core in cores:
                        await core._send.aclose()  # orderly: each engine sees the end of its inbox...
                    with trio.move_on_after(EXIT_TIMEOUT):
                        for core in cores:
                            await _drain(core._receive)  # ...and ends its side before the link closes
    if startup_error is not None:
        raise startup_error


async def start_engines_for_fronts(config: EngineConfig, count: int,
                                   fronts: int) -> tuple[list, list[list[socket.socket]]]:
    """``--api-server-count``: ``count`` engine processes, each linked to ``fronts`` fronts;
    returns the processes, and for each front its sockets (one per engine) to hand it."""
    processes, per_front = [], [[] for _ in range(fronts)]
    for share in device_shares(config, count):
        pairs = [socket.socketpair() for _ in range(fronts)]
        processes.append(await _start_engine(config, [engine for _, engine in pairs], share))
        for front, (front_socket, _) in enumerate(pairs):
            per_front[front].append(front_socket)
    return processes, per_front


def device_shares(config: EngineConfig, count: int) -> list[dict[str, str]]:
    """What each of ``count`` engine processes on this machine adds to its environment: its
    share of the machine, so that they do not fight over the same cores or the same GPU.

    On the CPU each gets an equal share of this process's cores as its thread count
    (``OMP_NUM_THREADS``: torch's and the native libraries' OpenMP pools both read it), unless
    ``OMP_NUM_THREADS`` is set already; on CUDA each gets a GPU of its own
    (``CUDA_VISIBLE_DEVICES``), as vLLM's data-parallel ranks do. One engine takes the machine
    as it is.

    Raises:
        ConfigError: fewer GPUs visible than engine processes on this machine.
    """
    if count <= 1:
        return [{} for _ in range(count)]
    if resolve_device(config) == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            gpus = [g.strip() for g in visible.split(",") if g.strip()]
        else:
            import torch

            gpus = [str(i) for i in range(torch.cuda.device_count())]
        if len(gpus) < count:
            raise ConfigError("data_parallel_size", f"{count} engine processes on this machine need a GPU each; "
                                                    f"{len(gpus)} visible")
        return [{"CUDA_VISIBLE_DEVICES": gpu} for gpu in gpus[:count]]
    if "OMP_NUM_THREADS" in os.environ:
        return [{} for _ in range(count)]
    threads = max(1, len(os.sched_getaffinity(0)) // count)
    return [{"OMP_NUM_THREADS": str(threads)} for _ in range(count)]


async def _start_engine(config: EngineConfig, engine_sockets: list[socket.socket], share: dict[str, str]):
    """An engine process serving over ``engine_sockets`` (one per front; handed to it, and
    closed here), with ``share`` (``device_shares``) added to its environment."""
    argv = [sys.executable, "-m", "engine.core_process", "--config", json.dumps(attrs.asdict(config)),
            "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())]
    for engine_socket in engine_sockets:
        argv += ["--fd", str(engine_socket.fileno())]
    if share:
        log.info("engine process with %s", " ".join(f"{k}={v}" for k, v in share.items()))
    try:
        # A session of its own: a terminal's Ctrl-C goes to the front, which ends the engine in order.
        return await trio.lowlevel.open_process(argv, pass_fds=tuple(s.fileno() for s in engine_sockets),
                                                start_new_session=True, env={**os.environ, **share} if share else None)
    finally:
        for engine_socket in engine_sockets:
            engine_socket.close()


async def run_headless(config: EngineConfig, connect_timeout: float = 300.0) -> int:
    """``python -m engine.api --headless``: this machine's share of a data-parallel group
    (``data_parallel_size_local`` engines), each joining the front at
    ``data_parallel_address:data_parallel_rpc_port`` over TCP. Returns once they have all
    exited (when the front ends their links, or dies): 0 if every one exited cleanly.

    SIGTERM / SIGINT stop the engines (the front sees them die)."""
    local = config.data_parallel_size if config.data_parallel_size_local is None else config.data_parallel_size_local
    if local < 1:
        raise ConfigError("data_parallel_size_local", "--headless needs at least one local engine")
    address, port = config.data_parallel_address, config.data_parallel_rpc_port
    processes = []
    shares = device_shares(config, local)
    try:
        for share in shares:
            with trio.fail_after(connect_timeout):
                while True:  # the front may not be listening yet
                    try:
                        stream = await trio.open_tcp_stream(address, port)
                        break
                    except OSError:
                        await trio.sleep(0.5)
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            processes.append(await _start_engine(config, [socket.socket(fileno=stream.socket.detach())], share))
            log.info("engine process %d joining %s:%d", processes[-1].pid, address, port)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signals, processes)
            for process in processes:
                await process.wait()
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            for process in processes:
                await _reap(process, EXIT_TIMEOUT)
    return 0 if all(p.returncode == 0 for p in processes) else 1


async def _stop_on_signals(processes) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for sig in signals:
            log.info("received %s: stopping the engines", signal.Signals(sig).name)
            for process in processes:
                if process.returncode is None:
                    process.terminate()


async def _drain(receive) -> None:
    try:
        async for _ in receive:
            pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def _first_message(receive, process) -> EngineReady | EngineFailed:
    try:
        return await receive.receive()
    except (trio.BrokenResourceError, trio.EndOfChannel) as exc:
        if process is None:
            return EngineFailed(EngineDeadError(f"a remote engine left before it was ready: {exc}"))
        await _reap(process, 1.0)
        return EngineFailed(EngineDeadError(f"the engine process exited ({_status(process)}) before it was ready: "
                                            f"{exc}"))


async def _accept_engines(config: EngineConfig, count: int) -> list[trio.SocketStream]:
    """Wait for ``count`` headless engines to connect to ``data_parallel_address:rpc_port``."""
    address, port = config.data_parallel_address, config.data_parallel_rpc_port
    listeners = await trio.open_tcp_listeners(port, host=address)
    streams = []
    try:
        log.info("waiting for %d engine(s) to join at %s:%d (python -m engine.api --headless ...)", count, address, port)
        while len(streams) < count:
            stream = await listeners[0].accept()
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            streams.append(stream)
            log.info("engine %d of %d joined from %s", len(streams), count, stream.socket.getpeername())
    finally:
        for listener in listeners:
            await listener.aclose()
    return streams


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
