"""``--api-server-count N``: N HTTP front processes over shared engine processes.

The launcher binds the listening socket once and hands it to every front (each accepts on
it; the kernel spreads the connections). It starts the engine processes
(``--data-parallel-size`` of them) with one link per front, so each engine sends each front
only its own requests' outputs (``engine.transport.engine_process.Fronts``). The fronts share one
prometheus_client multiprocess directory, so any front's ``/metrics`` shows the whole server.

    launcher --(listening socket, one engine link each)--> front 1 .. front N
    launcher --(N links each)--> engine 1 .. engine D

Shutdown: SIGTERM / SIGINT go to every front, which drain as one server does; the engines
exit when their last front has ended its link; the launcher exits with the worst status.
A front that exits on its own (its engine died: --on-engine-failure exit) stops the others.
A launcher that dies without stopping them (SIGKILL) takes them along: each front holds the
read end of a pipe only the launcher writes to, and shuts down when it closes (otherwise the
fronts would serve on, holding the port).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import tempfile

import trio

from api.cli import engine_config
from engine.errors import ConfigError, listening_at
from engine.signals import on_stop_signals
from engine.transport.processes import EXIT_TIMEOUT, reap, start_engines_for_fronts

log = logging.getLogger("api.launcher")


def front_command(argv: list[str], index: int, listen_fd: int, engine_fds: list[int],
                  launcher_fd: int | None = None) -> list[str]:
    """Front ``index``'s command line: the server's own flags, one front on the shared socket,
    its links to the engines, the pipe that tells it the launcher is gone. Each front sees the
    engines' whole counters, so only the first logs the activity line (N fronts would print N
    copies)."""
    own = ["--api-server-count", "1", "--listen-fd", str(listen_fd)]
    if launcher_fd is not None:
        own += ["--launcher-fd", str(launcher_fd)]
    for fd in engine_fds:
        own += ["--engine-fd", str(fd)]
    if index > 0 and "--disable-log-stats" not in argv:
        own.append("--disable-log-stats")
    # (after the server's flags, which they override, but before a "--": what follows it is positional)
    end = argv.index("--") if "--" in argv else len(argv)
    return [sys.executable, "-m", "engine.api", *argv[:end], *own, *argv[end:]]


async def run_launcher(args: argparse.Namespace, argv: list[str]) -> int:
    config = engine_config(args)
    if config.data_parallel_size_local is not None and config.data_parallel_size_local < config.data_parallel_size:
        raise ConfigError("api_server_count", "--api-server-count does not combine with engines on other machines "
                                              "(--data-parallel-size-local) yet")
    # (not SO_REUSEPORT: the fronts inherit this socket, and another server must not share the port)
    with listening_at(f"--host {args.host} --port {args.port}"):
        listener = socket.create_server((args.host, args.port))
    host, port = listener.getsockname()[:2]  # (the port bound: --port 0 too)
    engines, per_front = await start_engines_for_fronts(config, config.data_parallel_size, args.api_server_count)
    fronts, lifelines = [], []
    with tempfile.TemporaryDirectory(prefix="engine-metrics-") as metrics_dir:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
        try:
            for index, sockets in enumerate(per_front):
                # A pipe whose write end only this process holds: when it dies, even of SIGKILL,
                # the kernel closes it and the front shuts down (its engines follow it).
                lifeline, held = os.pipe()
                lifelines.append(held)
                fronts.append(await trio.lowlevel.open_process(
                    front_command(argv, index, listener.fileno(), [s.fileno() for s in sockets], lifeline),
                    pass_fds=(listener.fileno(), lifeline, *(s.fileno() for s in sockets)), env=env))
                os.close(lifeline)
                for s in sockets:
                    s.close()
            listener.close()
            log.info("%d API servers on %s:%d, %d engine process(es)", len(fronts), host, port, len(engines))
            stopping = _Stop(fronts)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stopping.on_signals)
                async with trio.open_nursery() as watchers:
                    for front in fronts:
                        watchers.start_soon(stopping.when_exits, front)
                nursery.cancel_scope.cancel()
        finally:
            for fd in lifelines:  # (however this ends, the fronts shut down as on SIGTERM)
                os.close(fd)
            with trio.CancelScope(shield=True):
                for process in fronts + engines:
                    await reap(process, EXIT_TIMEOUT)
    codes = [p.returncode for p in fronts]
    log.info("API servers exited with %s; engine processes with %s", codes, [p.returncode for p in engines])
    return max((c if c >= 0 else 1) for c in codes) if codes else 1


class _Stop:
    """Stops every front once: on SIGTERM / SIGINT, or when one front exits on its own (its
    engine died: --on-engine-failure exit; or a crash). Never twice: a front that has left its
    signal handling behind while it drains would die of a second SIGTERM."""

    def __init__(self, fronts) -> None:
        self._fronts = fronts
        self._stopped = False

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            for front in self._fronts:
                if front.returncode is None:
                    front.send_signal(signal.SIGTERM)

    async def when_exits(self, front) -> None:
        await front.wait()
        self.stop()

    async def on_signals(self) -> None:
        """(A terminal's Ctrl-C reaches the fronts as well, being in this process group.)"""
        await on_stop_signals(lambda sig: self.stop())
