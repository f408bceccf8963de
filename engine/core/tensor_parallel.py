"""Tensor-parallel ranks (``--tensor-parallel-size N``): the engine core is rank 0; ranks 1..N-1
are processes of their own (``python -m engine.core.tensor_parallel``), each with its shard of the
model (engine/models/parallel.py) and its own KV cache for its KV heads.

Every step, rank 0 broadcasts the step's ``StepPlan`` (msgpack-encoded by msgspec, carried as a
uint8 tensor by torch.distributed) and every rank runs it: the same rows through the same
forward pass, whose row-split products all-reduce and whose LM head all-gathers, and the same
sampling from the same logits with the same seeds, so every rank draws the same tokens; rank 0's
result is the step's. No scheduler state crosses a process: a rank knows only the plans.

A rank that stops answering (hung or gone) makes the next collective fail after
``distributed_timeout`` seconds, and the engine fails with it (its streams end with an error).
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import attrs
import msgspec
import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.plan import StepPlan

log = logging.getLogger(__name__)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StepPlan)


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _join(rank: int, size: int, port: int, device: str, timeout: float) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
    dist.init_process_group(_backend(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout))


def _threads(size: int) -> int:
    return max(1, (os.cpu_count() or 1) // size)


class TensorParallelDriver:
    """Rank 0's side: starts the other ranks, joins the process group with them, and sends them
    what to do. Resource handling: ``stop`` (also at exit) ends the ranks and leaves the group."""

    def __init__(self, config: EngineConfig, device: str) -> None:
        self.config, self.device, self.size = config, device, config.tensor_parallel_size
        with socket.socket() as probe:  # (a free port for the group's rendezvous)
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        fields = json.dumps(attrs.asdict(config))
        self.processes = [subprocess.Popen([sys.executable, "-m", "engine.core.tensor_parallel", "--rank", str(rank),
                                            "--port", str(self.port), "--config", fields])
                          for rank in range(1, self.size)]
        self._stopped = False
        atexit.register(self._kill)

    def join(self, num_blocks: int) -> None:
        """Join the group (on the device thread, as every later collective) and tell every rank
        the KV cache's size."""
        torch.set_num_threads(_threads(self.size))
        _join(0, self.size, self.port, self.device, self.config.distributed_timeout)
        dist.broadcast(torch.tensor([num_blocks], dtype=torch.int64), 0)
        log.info("tensor parallel: %d ranks (%s), every step's plan broadcast from rank 0", self.size,
                 _backend(self.device))

    def send(self, plan: StepPlan) -> None:
        """The step's plan to every rank (before rank 0 runs it)."""
        payload = _ENCODER.encode(plan)
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), 0)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0)

    def stop(self) -> None:
        """End the other ranks (an empty plan) and leave the group."""
        if self._stopped:
            return
        self._stopped = True
        try:
            dist.broadcast(torch.tensor([0], dtype=torch.int64), 0)
            dist.destroy_process_group()
        except Exception:  # (a rank already gone: nothing to tell)
            pass
        self._kill(wait=10.0)

    def _kill(self, wait: float = 0.0) -> None:
        deadline = time.monotonic() + wait
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _receive() -> StepPlan | None:
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, 0)
    if int(size) == 0:
        return None
    payload = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(payload, 0)
    return _DECODER.decode(payload.numpy().tobytes())


def _exit_with_parent() -> None:
    """A rank ends when the engine that started it is gone, however it went."""
    parent = os.getppid()
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def main(argv: list[str] | None = None) -> None:
    from backends import get_backend
    from backends.kv_cache import resolve_kv_cache_dtype
    from engine.config import resolve_device, resolve_dtype
    from engine.models.loader import load_model, resolve_model
    from engine.models.parallel import TensorParallel
    from engine.runner.model_runner import ModelRunner

    parser = argparse.ArgumentParser(description="one tensor-parallel rank of an engine (started by the engine)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"rank {args.rank}: %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    config = EngineConfig(**json.loads(args.config))
    size = config.tensor_parallel_size
    torch.set_num_threads(_threads(size))
    device = resolve_device(config)
    backend = get_backend(config.backend, device)
    dtype = resolve_dtype(config, device)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, backend, dtype)
    source = resolve_model(config.model, allow_missing_default=config.load_format == "dummy")
    model = load_model(source, config.load_format, dtype, device, config.seed, config.quantization,
                       config.activation_quantization, TensorParallel(args.rank, size))
    if config.batch_invariant and hasattr(backend, "batch_invariant") and device == "cpu":
        model.fix_summation_order()
        backend.batch_invariant = True
    _join(args.rank, size, args.port, device, config.distributed_timeout)
    num_blocks = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(num_blocks, 0)
    runner = ModelRunner(model, backend, int(num_blocks), config.block_size, device, config.seed, kv_dtype,
                         config.calculate_kv_scales)
    with torch.inference_mode():
        while (plan := _receive()) is not None:
            runner.execute(plan)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
