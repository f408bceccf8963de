"""The one thread that does the process's device work: loading weights, building KV caches,
and every forward pass, of every engine in the process.

Why one thread: OpenMP (torch's CPU kernels and the native libraries both use libgomp) keeps
a pool of worker threads for each thread that opens parallel regions. Once the process holds
more pool threads than cores, libgomp cuts its spin-wait short, so every parallel region
has to wake sleeping workers. On a 2-core VM a batch-1 decode step then lost more to waking
a worker than a second core gained: splitting the small products over both cores made the
step 20% slower. With the weights loaded on one thread and the steps run on another (trio's
thread cache), there were two pools; with two engines in a process (a benchmark comparing
two), four. One device thread for the process keeps one pool; engines in one process take
turns on it, as they would take turns on the cores anyway. (A kernel that hangs holds up
every engine of the process: the watchdog declares its engine dead, and the process should
be restarted.)

A program that embeds the engine opens pools of its own when it runs torch's CPU work on its
threads (one ``torch.randn(2000, 2000) @ ...`` on the main thread is enough), and the engine's
steps pay for it: a batch-1 decode of the default model 7.5-11 -> 17-24 ms on a 2-core AMD EPYC
(Zen 3); expected wherever the pools' threads outnumber the cores. ``serial_openmp_here()``
keeps a thread's own torch work on that thread, so that it opens no pool (the test suite's main
thread; bench/ loads models on the device thread instead).
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")

# How long ``DeviceThread.run`` blocks the event loop at most for a job to start (a busy device
# thread, with a job already queued, is not waited for longer than this).
HANDOVER_WAIT_S = 0.002


class _Job:
    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args
        self.result: Any = None
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.done = threading.Event()
        self.on_done: Callable[[], None] | None = None

    def run(self) -> None:
        self.started.set()
        try:
            self.result = self.fn(*self.args)
        except BaseException as error:  # handed to the caller, who re-raises it
            self.error = error
        self.fn = self.args = None  # the thread must not keep the caller's objects alive
        self.done.set()
        if self.on_done is not None:
            self.on_done()

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


def serial_openmp_here() -> bool:
    """Run the calling thread's OpenMP work (torch's CPU kernels on it) on this thread alone, so
    that it keeps no pool of worker threads beside the device thread's (see the module docstring).
    Other threads keep their own setting; the device thread's stays as it was. (Not
    ``torch.set_num_threads(1)``: torch hands that number to every thread that has not yet run
    a parallel kernel, the device thread included.) False where torch runs no GNU OpenMP."""
    import torch  # noqa: F401  (its OpenMP runtime loaded first: the one to set)

    try:  # (the copy already loaded under that name, torch's; none is loaded anew)
        libgomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return False
    libgomp.omp_set_num_threads(1)
    return True


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job.run()
        del job


class DeviceThread:
    """Runs calls one at a time on a daemon thread of its own (daemon: a hung kernel that the
    step watchdog abandoned must not hold up the interpreter's exit). ``shared()`` is the
    process's one."""

    _shared: DeviceThread | None = None
    _shared_lock = threading.Lock()

    def __init__(self, name: str = "engine-device") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # The last queued job's done event: once set, the thread is idle (or about to be)
        self._last_done: threading.Event | None = None
        self._thread = threading.Thread(target=_serve, args=(self._jobs,), name=name, daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> DeviceThread:
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def close(self) -> None:
        """Ends the thread after the calls already queued."""
        self._jobs.put(None)

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the device thread; blocks until it returns (or raises)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        job = _Job(fn, args)
        self._last_done = job.done
        self._jobs.put(job)
        job.done.wait()
        return job.outcome()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the device thread, awaited from trio. The event loop blocks only
        while an idle device thread takes the call up (at most ``HANDOVER_WAIT_S``). Cancelling
        the wait abandons the call: it still finishes on the device thread."""
        token = trio.lowlevel.current_trio_token()
        finished = trio.Event()

        def wake() -> None:
            try:
                token.run_sync_soon(finished.set)
            except trio.RunFinishedError:  # the caller's trio.run is gone (an abandoned call)
                pass

        job = _Job(fn, args)
        job.on_done = wake
        idle = self._last_done is None or self._last_done.is_set()
        self._last_done = job.done
        self._jobs.put(job)
        if idle:
            # Hand the GIL over until the job has started. Otherwise the event loop keeps it for
            # what it has queued (the last step's outputs, SSE writes: ~0.5 ms at one stream)
            # while the device thread waits to run the step's first Python; once the step is in
            # native code (which releases the GIL) the two run side by side. (A busy thread, say
            # with another engine's step, is not waited for.)
            job.started.wait(HANDOVER_WAIT_S)
        await finished.wait()
        return job.outcome()
