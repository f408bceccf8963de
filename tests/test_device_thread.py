"""The device thread: every engine's device work (load, KV cache, forward passes) runs on one
thread per process, so OpenMP keeps one worker pool (engine/core/device_thread.py says why)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trio

from engine.core.device_thread import DeviceThread
from engine.sampling_params import SamplingParams
from tests.conftest import tiny_engine_core


def test_run_sync_returns_raises_and_runs_nested_calls_in_place():
    device = DeviceThread(name="test-device")
    try:
        assert device.run_sync(threading.current_thread) is not threading.current_thread()
        assert device.run_sync(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ZeroDivisionError):
            device.run_sync(lambda: 1 / 0)
        # A call made from the device thread itself runs there at once (no deadlock).
        inner = device.run_sync(lambda: device.run_sync(threading.current_thread))
        assert inner is device.run_sync(threading.current_thread)
    finally:
        device.close()


async def test_run_awaits_without_blocking_the_event_loop_and_a_cancelled_wait_abandons_the_call():
    device = DeviceThread(name="test-device")
    release, finished, ticks = threading.Event(), threading.Event(), []

    def slow() -> str:
        release.wait(10)
        finished.set()
        return "done"

    async def tick():
        while True:
            ticks.append(1)
            await trio.sleep(0.001)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            with trio.move_on_after(0.2) as scope:
                await device.run(slow)
            # (the loop ticked meanwhile: a few times is proof enough on a loaded machine)
            assert scope.cancelled_caught and not finished.is_set() and len(ticks) > 2
            release.set()
            assert await device.run(lambda: "next") == "next"  # queued behind the abandoned call
            assert finished.is_set()
            with pytest.raises(KeyError):
                await device.run(lambda: {}["missing"])
            nursery.cancel_scope.cancel()
    finally:
        device.close()


def test_every_engine_in_the_process_loads_and_steps_on_the_one_device_thread(tiny_model, monkeypatch):
    device = DeviceThread.shared()
    first, second = tiny_engine_core(tiny_model), tiny_engine_core(tiny_model)
    assert first.device_thread is second.device_thread is device
    seen = set()
    real = first.runner.execute

    def execute(*args):
        seen.add(threading.current_thread())
        return real(*args)

    monkeypatch.setattr(first.runner, "execute", execute)
    first.add_request("r", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    while first.has_unfinished_requests:
        first.step()
    assert seen == {device.run_sync(threading.current_thread)}


_POOL_PROBE = """
import os, sys, torch
from engine.core.device_thread import DeviceThread, serial_openmp_here
if sys.argv[1] == "serial":
    assert serial_openmp_here()
threads = len(os.listdir("/proc/self/task"))
torch.randn(1024, 1024) @ torch.randn(1024, 1024)  # a parallel kernel on the main thread
print(len(os.listdir("/proc/self/task")) - threads, DeviceThread.shared().run_sync(torch.get_num_threads))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="needs Linux's /proc and two cores (one core opens no OpenMP pool)")
@pytest.mark.parametrize("mode", ["serial", "default"])
def test_serial_openmp_here_keeps_the_calling_threads_torch_work_from_opening_a_pool(mode):
    """A fresh process (the suite's main thread is serial already): after serial_openmp_here()
    a parallel torch kernel on the main thread starts no worker thread, while the device thread
    keeps every core; without it, the same kernel opens a pool (what the helper prevents)."""
    done = subprocess.run([sys.executable, "-c", _POOL_PROBE, mode], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "2"}, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr
    new_threads, device_threads = map(int, done.stdout.split())
    assert device_threads == 2
    assert (new_threads == 0) == (mode == "serial"), done.stdout
