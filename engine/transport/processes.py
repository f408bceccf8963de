"""Engine processes: starting them (here, or for the fronts of ``--api-server-count``, or as a
headless node's), linking them to their front, and reaping them (no process outlives its front)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
import trio

from engine.config import EngineConfig, resolve_device
from engine.errors import ConfigError, EngineDeadError, listening_at
from engine.signals import on_stop_signals
from engine.transport.protocol import CODEC, EngineFailed, EngineReady
from engine.transport.remote import RemoteCore
from engine.transport.wire import open_link

log = logging.getLogger(__name__)

# How long a front waits for its engine process to exit after closing the link, before killing it.
EXIT_TIMEOUT = 10.0


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
    local = min(count, config.data_parallel_local)
    processes, streams = [], []
    shares = device_shares(config, local)
    try:
        for rank, share in enumerate(shares):  # (this machine's engines first: ranks 0 .. local - 1)
            front_socket, engine_socket = socket.socketpair()
            try:
                processes.append(await _start_engine(config, rank, [engine_socket], share))
            except BaseException:
                front_socket.close()
                raise
            streams.append(trio.SocketStream(trio.socket.from_stdlib_socket(front_socket)))
        # (the others join over TCP: python -m engine.api --headless, elsewhere)
        async with _engines(config, streams, processes, joining=count - local) as cores:
            yield cores
    finally:
        with trio.CancelScope(shield=True):
            for process in processes:
                await reap(process, EXIT_TIMEOUT)


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
async def _engines(config: EngineConfig, streams: list[trio.SocketStream], processes: list,
                   joining: int = 0) -> AsyncIterator[list[RemoteCore]]:
    """Links over ``streams`` (the first ones to ``processes``) and to ``joining`` engines that
    join over TCP, each engine's EngineReady, and an orderly end of every link when the block
    is left."""
    startup_error: BaseException | None = None
    async with AsyncExitStack() as links:
        # (the handshake runs in the link's tasks: opening one sends this side's Hello at once,
        # so no engine's wait for it runs out while others join, and does not wait for its engine)
        ends = [await links.enter_async_context(open_link(stream, CODEC, role="front")) for stream in streams]
        if joining:
            ends += await _join_engines(config, joining, links)
        cores = []
        ranks: dict[int, int] = {}  # data-parallel rank -> its engine's pid
        for rank, (send, receive) in enumerate(ends):
            process = processes[rank] if rank < len(processes) else None
            first = await _first_message(receive, process)
            if isinstance(first, EngineReady) and (mismatch := _not_of_the_group(first, rank, cores, ranks, len(ends))):
                first = EngineFailed(mismatch)
            elif isinstance(first, EngineReady):
                ranks[first.data_parallel_rank] = first.pid
            if isinstance(first, EngineFailed):
                startup_error = first.error  # raised below, outside the links' nurseries: as in one process
                break
            log.info("engine process %d (engine %d%s) ready", first.pid, first.data_parallel_rank,
                     "" if process else ", not a child")
            # (an engine's number, the ``engine`` label of its metrics, is its rank: not the order joined)
            cores.append(RemoteCore(config, first, send, receive, process, first.data_parallel_rank,
                                    joined=rank >= len(streams)))
        cores.sort(key=lambda core: core.rank)
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


def _not_of_the_group(ready: EngineReady, index: int, cores: list[RemoteCore], ranks: dict[int, int],
                      size: int) -> ConfigError | None:
    """Why engine ``index`` cannot join the group of ``size`` whose engines ``cores`` are ready
    (``ranks``: their data-parallel ranks -> pids), or None if it can."""
    if cores and (ready.model, ready.vocab_size) != (cores[0].model, cores[0].vocab_size):
        return ConfigError("data_parallel_size", (
            f"engine {index} serves {ready.model} ({ready.vocab_size} tokens), engine 0 {cores[0].model} "
            f"({cores[0].vocab_size}): every engine must serve the same model"))
    if not 0 <= ready.data_parallel_rank < size:
        return ConfigError("data_parallel_start_rank", (
            f"an engine (pid {ready.pid}) has data-parallel rank {ready.data_parallel_rank}, outside this group of "
            f"{size}: check its machine's --data-parallel-size and --data-parallel-start-rank"))
    if ready.data_parallel_rank in ranks:  # (they would draw the same random numbers for requests without a seed)
        return ConfigError("data_parallel_start_rank", (
            f"two engines (pids {ranks[ready.data_parallel_rank]} and {ready.pid}) both have data-parallel rank "
            f"{ready.data_parallel_rank}: with several --headless machines, give each its own "
            "--data-parallel-start-rank"))
    return None


async def start_engines_for_fronts(config: EngineConfig, count: int,
                                   fronts: int) -> tuple[list, list[list[socket.socket]]]:
    """``--api-server-count``: ``count`` engine processes, each linked to ``fronts`` fronts;
    returns the processes, and for each front its sockets (one per engine) to hand it."""
    processes, per_front = [], [[] for _ in range(fronts)]
    for rank, share in enumerate(device_shares(config, count)):
        pairs = [socket.socketpair() for _ in range(fronts)]
        processes.append(await _start_engine(config, rank, [engine for _, engine in pairs], share))
        for front, (front_socket, _) in enumerate(pairs):
            per_front[front].append(front_socket)
    return processes, per_front


def device_shares(config: EngineConfig, count: int) -> list[dict[str, str]]:
    """What each of ``count`` engine processes on this machine adds to its environment: its
    share of the machine, so that they do not fight over the same cores or the same GPU.

    On the CPU each gets an equal share of this process's cores as its thread count
    (``OMP_NUM_THREADS``: torch's and the native libraries' OpenMP pools both read it), unless
    ``OMP_NUM_THREADS`` is set already; on CUDA each gets a GPU of its own
    (``CUDA_VISIBLE_DEVICES``), as vLLM's data-parallel ranks do; one per tensor-parallel rank
    (whose ranks then share the engine's cores, or take its GPUs one each). One engine takes the
    machine as it is.

    Raises:
        ConfigError: fewer GPUs visible than engine processes (times their ranks) on this machine.
    """
    if count <= 1:
        return [{} for _ in range(count)]
    if resolve_device(config) == "cuda":
        per = config.tensor_parallel_size  # (an engine's ranks are all on this machine: nnodes is 1 here)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            gpus = [g.strip() for g in visible.split(",") if g.strip()]
        else:
            import torch

            gpus = [str(i) for i in range(torch.cuda.device_count())]
        if len(gpus) < count * per:
            each = "a GPU each" if per == 1 else f"{per} GPUs each (one per tensor-parallel rank)"
            raise ConfigError("data_parallel_size", f"{count} engine processes on this machine need {each}; "
                                                    f"{len(gpus)} visible")
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per:(i + 1) * per])} for i in range(count)]
    if "OMP_NUM_THREADS" in os.environ:
        return [{} for _ in range(count)]
    threads = max(1, len(os.sched_getaffinity(0)) // count)
    return [{"OMP_NUM_THREADS": str(threads)} for _ in range(count)]


async def _start_engine(config: EngineConfig, rank: int, engine_sockets: list[socket.socket], share: dict[str, str]):
    """The engine process of data-parallel rank ``rank``, serving over ``engine_sockets`` (one
    per front; handed to it, and closed here), with ``share`` (``device_shares``) added to its
    environment."""
    config = attrs.evolve(config, data_parallel_rank=rank)
    argv = [sys.executable, "-m", "engine.transport.engine_process", "--config", json.dumps(attrs.asdict(config)),
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

    SIGTERM / SIGINT stop the engines (the front sees them die), or the wait for the front.

    Raises:
        ConfigError: no front took the engines within ``connect_timeout`` seconds."""
    local = config.data_parallel_local
    if local < 1:
        raise ConfigError("data_parallel_size_local", "--headless needs at least one local engine")
    start = config.data_parallel_start_rank
    if start is None:  # (the group's last ranks: the usual two machines, the server's engines first)
        start = config.data_parallel_size - local
    address, port = config.data_parallel_address, config.data_parallel_rpc_port
    processes: list = []
    shares = device_shares(config, local)
    connecting = trio.CancelScope()

    def stop_engines() -> None:
        for process in processes:
            if process.returncode is None:
                process.terminate()

    def stop(sig: signal.Signals) -> None:
        log.info("received %s: stopping the engines", sig.name)
        connecting.cancel()  # (a node still waiting for its front stops waiting)
        stop_engines()

    unanswered = False
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(on_stop_signals, stop)
            log.info("waiting for the API server at %s:%d", address, port)
            with connecting:
                for rank, share in enumerate(shares, start):
                    stream = await _connect(address, port, connect_timeout)
                    if stream is None:
                        unanswered = True
                        break
                    processes.append(await _start_engine(config, rank, [socket.socket(fileno=stream.socket.detach())],
                                                         share))
                    log.info("engine process %d joining %s:%d", processes[-1].pid, address, port)
            if unanswered or connecting.cancel_called:  # (engines already started do not serve alone,
                stop_engines()  # and one started while a signal came is stopped here)
            for process in processes:
                await process.wait()
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            for process in processes:
                await reap(process, EXIT_TIMEOUT)
    if unanswered:
        raise ConfigError("data_parallel_address", f"no API server took this node's engines at {address}:{port} "
                                                   f"within {connect_timeout:.0f} s (--data-parallel-address, "
                                                   "--data-parallel-rpc-port)")
    return 0 if all(p.returncode == 0 for p in processes) else 1


async def _connect(address: str, port: int, timeout: float) -> trio.SocketStream | None:
    """A TCP link to the front, which may not be listening yet: tried every half second; None
    when none is made within ``timeout``."""
    with trio.move_on_after(timeout):
        while True:
            try:
                stream = await trio.open_tcp_stream(address, port)
            except OSError:
                await trio.sleep(0.5)
                continue
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return stream
    return None


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
        await reap(process, 1.0)
        return EngineFailed(EngineDeadError(f"the engine process exited ({_status(process)}) before it was ready: "
                                            f"{exc}"))


async def _join_engines(config: EngineConfig, count: int, links: AsyncExitStack) -> list[tuple]:
    """Links (entered into ``links``) to ``count`` headless engines that connect to
    ``data_parallel_address:data_parallel_rpc_port``, on every address that resolves to.

    A connection whose peer is not an engine of this version (a port scan, a health probe,
    another program) is dropped with a warning, and the wait goes on; one that says nothing
    holds the joins up for the link's handshake timeout (an engine waits longer for the
    front's Hello: ``ENGINE_HANDSHAKE_TIMEOUT_S``). The port has no other check of who joins:
    keep it on a trusted network (as vLLM's data-parallel port)."""
    address, port = config.data_parallel_address, config.data_parallel_rpc_port
    with listening_at(f"--data-parallel-address {address} --data-parallel-rpc-port {port}"):
        listeners = await trio.open_tcp_listeners(port, host=address)
    joined = []
    try:
        log.info("waiting for %d engine(s) to join at %s:%d (python -m engine.api --headless ...)", count, address, port)
        while len(joined) < count:
            for stream in await _accept(listeners):
                if len(joined) == count:  # (two came at once for the last place)
                    log.warning("dropped a connection: every engine has joined")
                    await trio.aclose_forcefully(stream)
                elif (linked := await _link_to_engine(stream, links)) is not None:
                    ends, peer = linked
                    joined.append(ends)
                    log.info("engine %d of %d joined from %s", len(joined), count, peer)
    finally:
        for listener in listeners:
            listener.socket.close()  # (at once: an awaited close stops at the first under a cancel)
    return joined


async def _link_to_engine(stream: trio.SocketStream, links: AsyncExitStack) -> tuple[tuple, Any] | None:
    """A link over ``stream`` (entered into ``links``) and the peer's address, once its Hello
    says it is an engine of this version; else None, the connection dropped with a warning."""
    try:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = stream.socket.getpeername()
    except OSError as exc:  # (reset before it was taken)
        log.warning("dropped a connection: %s", exc)
        await trio.aclose_forcefully(stream)
        return None
    async with AsyncExitStack() as link:  # (closed here unless the handshake passes)
        ends = await link.enter_async_context(open_link(stream, CODEC, role="front"))
        try:
            await ends[1].handshake()
        except trio.BrokenResourceError as exc:
            log.warning("dropped a connection from %s: not an engine of this version (%s)", peer, exc.__cause__ or exc)
            return None
        links.push_async_exit(link.pop_all())
    return ends, peer


async def _accept(listeners: list[trio.SocketListener]) -> list[trio.SocketStream]:
    """The next connection on any of ``listeners`` (two, if two came at once)."""
    accepted = []
    async with trio.open_nursery() as nursery:
        async def take(listener: trio.SocketListener) -> None:
            accepted.append(await listener.accept())
            nursery.cancel_scope.cancel()

        for listener in listeners:
            nursery.start_soon(take, listener)
    return accepted


async def reap(process, timeout: float) -> None:
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
