"""Stop signals, for the processes that serve: one shape for the server, the launcher of its API
servers and a headless node."""

from __future__ import annotations

import signal
from collections.abc import Callable

import trio


async def on_stop_signals(handle: Callable[[signal.Signals], None], *,
                          task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Call ``handle`` with each SIGINT or SIGTERM the process receives, until cancelled (started,
    with ``nursery.start``, once the signals are caught). (trio's signal receiver: ``handle`` runs
    in the event loop, not in the signal handler's context.)"""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for number in signals:
            handle(signal.Signals(number))
