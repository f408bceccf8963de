"""Tensor-parallel ranks (``--tensor-parallel-size N``): the engine core is rank 0; ranks 1..N-1
are processes of their own (``python -m engine.core.tensor_parallel``), each with its shard of the
model (engine/models/parallel.py) and its own KV cache for its KV heads.

Every step, rank 0 hands the step's ``StepPlan`` to the other ranks (msgpack-encoded by msgspec,
through the group's TCPStore) and every rank runs it: the same rows through the same
forward pass, whose row-split products all-reduce and whose LM head all-gathers, and the same
sampling from the same logits with the same seeds, so every rank draws the same tokens; rank 0's
result is the step's. No scheduler state crosses a process: a rank knows only the plans.

Start-up: rank 0 serves the group's store before it loads its own shard, so every rank loads
beside it (other nodes' too, whenever they start, within ``_LOADING``); a rank reports its
shard loaded (or why it failed: a missing model, settings other than node 0's), and once all
have, they join the process group together (within ``distributed_timeout``), build their KV
caches and say so.

A rank that stops answering (hung or gone) makes the next collective fail after
``distributed_timeout`` seconds, and the engine fails with it (its streams end with an error).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import signal
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
from engine.errors import ConfigError, EngineDeadError
from engine.plan import StepPlan

log = logging.getLogger(__name__)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StepPlan)


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


# Plans travel through the group's store (torch.distributed's TCPStore, served by rank 0): writing
# one never waits for a rank, and a rank waits for the next as long as the engine idles. The
# forward pass's collectives are what a hung or lost rank fails, after distributed_timeout.
_IDLE = timedelta(days=365)
_KEPT_PLANS = 64  # (a plan's key is deleted this many steps later: every rank has read it by then)
_LOADING = 900.0  # seconds the ranks may take to load their shards (not a hang: no collective runs yet)
_POLL = 0.25  # seconds between rank 0's looks at the ranks' start-up (store.check: no waits to time out)

# What every rank must hold as rank 0 does (other nodes' ranks read theirs from their own flags):
# these as given, and the model's and KV cache's dtypes resolved (``auto`` may differ between
# machines). (KV sizes come from rank 0.)
_SHARED = ("tensor_parallel_size", "nnodes", "load_format", "quantization", "activation_quantization", "block_size",
           "seed", "batch_invariant", "disable_hybrid_kv_cache_manager", "calculate_kv_scales")


def shared_settings(config: EngineConfig, dtype: torch.dtype, kv_cache_dtype: str) -> dict[str, object]:
    """The settings a rank must share with rank 0 (``_SHARED``, the model's dtype, the KV cache's)."""
    return {**{name: getattr(config, name) for name in _SHARED}, "dtype": str(dtype).removeprefix("torch."),
            "kv_cache_dtype": kv_cache_dtype}


def _differences(theirs: dict[str, object], ours: dict[str, object]) -> list[str]:
    return [f"--{name.replace('_', '-')} {ours.get(name)!r} here, {value!r} on node 0"
            for name, value in theirs.items() if ours.get(name) != value]


def _serve_store(address: str, port: int, size: int, timeout: float) -> dist.TCPStore:
    """Rank 0's side of the group's store, listening on ``port`` (0: a free one, read back as the
    store's ``port``, so no other process can take it between a probe and the bind)."""
    try:
        return dist.TCPStore(address, port, size, is_master=True, timeout=timedelta(seconds=timeout),
                             wait_for_workers=False)
    except dist.DistNetworkError as exc:
        where = f"--master-port {port}: rank 0 cannot listen there" if port else f"rank 0 cannot listen on {address}"
        raise ConfigError("master_port", f"{where} for the other tensor-parallel ranks ({exc})") from None


def _join(rank: int, size: int, store: dist.TCPStore, device: str, timeout: float) -> None:
    """Join the group, whose store ``store`` is (rank 0 serves it)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
    dist.init_process_group(_backend(device), store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout))


def _rank_command(rank: int, address: str, port: int, config: EngineConfig) -> list[str]:
    return [sys.executable, "-m", "engine.core.tensor_parallel", "--rank", str(rank), "--address", address,
            "--port", str(port), "--config", json.dumps(attrs.asdict(config))]


def ranks_per_node(config: EngineConfig) -> int:
    return config.tensor_parallel_size // config.nnodes


def threads_per_rank(config: EngineConfig) -> int:
    """Each of this machine's ranks' share of the engine's cores: of ``OMP_NUM_THREADS`` where
    it is set (a data-parallel engine's share of the machine, ``device_shares``, or the user's),
    else of the cores this process may run on (its affinity, not the machine's count)."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    cores = int(given) if given.isdigit() and int(given) > 0 else len(os.sched_getaffinity(0))
    return max(1, cores // ranks_per_node(config))


class TensorParallelDriver:
    """Rank 0's side: starts the other ranks, joins the process group with them, and sends them
    what to do. Resource handling: ``stop`` (also at exit) ends the ranks and leaves the group."""

    def __init__(self, config: EngineConfig, device: str, shared: dict[str, object]) -> None:
        """Serve the group's store and start this machine's other ranks (they load their shards
        beside rank 0's); ``shared``: ``shared_settings``, which other nodes' ranks must hold."""
        self.config, self.device, self.size = config, device, config.tensor_parallel_size
        # The group's store first (other nodes' ranks meet this one at master_addr:master_port;
        # on one machine a free port of the loopback): a port in use ends the start here.
        self.address = config.master_addr if config.nnodes > 1 else "127.0.0.1"
        self._store = _serve_store(self.address, config.master_port if config.nnodes > 1 else 0, self.size,
                                   config.distributed_timeout)
        self.port = self._store.port
        self._store.set("settings", json.dumps(shared))
        self._joined = False
        self._abandoned = threading.Event()  # (``abandon``: a start that waits for ranks gives up)
        self.processes = [subprocess.Popen(_rank_command(rank, self.address, self.port, config))
                          for rank in range(1, ranks_per_node(config))]
        self._stopped = False
        self._step = 0
        atexit.register(self._kill)

    def join(self, num_blocks: int) -> None:
        """Once every rank has loaded its shard, tell them the KV cache's size and join the group
        with them (on the device thread, as every later collective); return once they have
        built their caches.

        Raises:
            EngineDeadError: a rank failed to start (its reason), or did not start within ``_LOADING``.
        """
        torch.set_num_threads(threads_per_rank(self.config))
        self._wait_for("loaded", "loaded their shards")
        self._store.set("num_blocks", str(num_blocks))  # (the ranks' word to join)
        _join(0, self.size, self._store, self.device, self.config.distributed_timeout)
        self._joined = True
        self._wait_for("ready", "built their KV caches")
        log.info("tensor parallel: %d ranks (%s), every step's plan broadcast from rank 0", self.size,
                 _backend(self.device))

    def _wait_for(self, stage: str, done: str) -> None:
        """Until every rank has reached ``stage``; a rank that failed (it says why in the store;
        one of this machine's may just exit) fails the start at once."""
        ranks = range(1, self.size)
        deadline = time.monotonic() + _LOADING
        while not self._store.check([f"{stage}/{rank}" for rank in ranks]):
            if lost := self._lost():
                raise EngineDeadError(f"tensor-parallel rank {lost[0]} failed to start: {lost[1]}")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"the tensor-parallel ranks had not {done} after {_LOADING:.0f} s")
            if self._abandoned.wait(_POLL):
                raise EngineDeadError("the engine's start was abandoned while it waited for its tensor-parallel ranks")

    def abandon(self) -> None:
        """Give up a start that waits for the ranks (from any thread: ``join`` holds the device
        thread, where ``stop`` runs, for as long as it waits)."""
        self._abandoned.set()

    def check(self) -> None:
        """Raise if a rank is gone (between steps: the next collective would wait
        ``distributed_timeout`` for it, and an idle server would not know).

        Raises:
            EngineDeadError: one of this machine's ranks exited, or another node's did (its
                node says so in the store: ``run_node``).
        """
        if not self._stopped and (lost := self._lost()):
            raise EngineDeadError(f"tensor-parallel rank {lost[0]} failed: {lost[1]}")

    def _lost(self) -> tuple[int, str] | None:
        """A rank that is gone, and why: what it (or its node: ``run_node``) said in the store,
        or the exit of one of this machine's (which may have had no time to say)."""
        for rank in range(1, self.size):
            if self._store.check([f"failed/{rank}"]):
                return rank, self._store.get(f"failed/{rank}").decode(errors="replace")
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                return rank, f"it exited with status {process.returncode} (its log is above)"
        return None

    def send(self, plan: StepPlan) -> None:
        """The step's plan to every rank (before rank 0 runs it)."""
        self._put(_ENCODER.encode(plan))

    def _put(self, payload: bytes) -> None:
        self._store.set(f"plan/{self._step}", payload)
        if self._step >= _KEPT_PLANS:
            self._store.delete_key(f"plan/{self._step - _KEPT_PLANS}")
        self._step += 1

    def stop(self) -> None:
        """End the other ranks (an empty plan) and leave the group."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if not self._joined:
                raise RuntimeError("never joined")
            self._put(b"")  # (the end)
            dist.destroy_process_group()
        except Exception:  # (a rank already gone, or never joined: nothing to tell)
            pass
        self._kill(wait=10.0 if self._joined else 0.0)
        atexit.unregister(self._kill)
        # The store's server goes with its last reference: --master-port is free again, and other
        # nodes' ranks still waiting to join see it gone.
        self._store = None

    def _kill(self, wait: float = 0.0) -> None:
        deadline = time.monotonic() + wait
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _plans(store: dist.TCPStore):
    """The plans rank 0 writes, in order, until the empty one."""
    step = 0
    while payload := store.get(f"plan/{step}"):
        yield _DECODER.decode(payload)
        step += 1


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
    from engine.models.llama import fix_summation_order
    from engine.models.loader import load_model, resolve_model
    from engine.models.parallel import TensorParallel
    from engine.runner.model_runner import ModelRunner

    parser = argparse.ArgumentParser(description="one tensor-parallel rank of an engine (started by the engine)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--address", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"rank {args.rank}: %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    config = EngineConfig(**json.loads(args.config))
    size = config.tensor_parallel_size
    torch.set_num_threads(threads_per_rank(config))
    device = resolve_device(config)
    backend = get_backend(config.backend, device)
    dtype = resolve_dtype(config, device)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, backend, dtype)
    # (rank 0 serves the store before it loads: waiting for it, as for its word to join, is loading time)
    store = dist.TCPStore(args.address, args.port, size, is_master=False, timeout=timedelta(seconds=_LOADING))
    try:
        theirs = json.loads(store.get("settings"))
        if wrong := _differences(theirs, shared_settings(config, dtype, kv_dtype.name)):
            raise ConfigError("tensor_parallel_size", f"node {config.node_rank}'s settings are not node 0's: "
                                                      + "; ".join(wrong))
        source = resolve_model(config.model, allow_missing_default=config.load_format == "dummy")
        model = load_model(source, config.load_format, dtype, device, config.seed, config.quantization,
                           config.activations, TensorParallel(args.rank, size))
        if config.batch_invariant:
            fix_summation_order(model, backend, device)
        store.set(f"loaded/{args.rank}", "1")
        num_blocks = int(store.get("num_blocks"))
        _join(args.rank, size, store, device, config.distributed_timeout)
        runner = ModelRunner(model, backend, num_blocks, config.block_size, device, config.sampling_seed, kv_dtype,
                             config.calculate_kv_scales, hybrid_kv=not config.disable_hybrid_kv_cache_manager)
    except BaseException as exc:
        with contextlib.suppress(Exception):  # (rank 0 says it, and ends the start; unless it is gone)
            store.set(f"failed/{args.rank}", f"{type(exc).__name__}: {exc}")
        if isinstance(exc, ConfigError):  # (a wrong flag or file: one line, as the server's own)
            raise SystemExit(f"rank {args.rank}: error: {exc}") from None
        raise
    store.set(f"ready/{args.rank}", "1")
    store.set_timeout(_IDLE)  # (waiting for the next plan: as long as the engine idles)
    with torch.inference_mode():
        for plan in _plans(store):
            runner.execute(plan)
    dist.destroy_process_group()


def run_node(config: EngineConfig) -> int:
    """``python -m engine.api --headless --nnodes N --node-rank R``: this machine's ranks of a
    tensor-parallel engine whose rank 0 runs on node 0; returns when they end (non-zero when
    one failed). Ends them if it is ended itself."""
    if config.nnodes < 2 or config.node_rank == 0:
        raise ConfigError("node_rank", "a headless tensor-parallel node has --nnodes 2 or more and a --node-rank "
                                       "other than 0 (node 0 runs the engine itself)")
    per_node = ranks_per_node(config)
    first = config.node_rank * per_node
    processes = [subprocess.Popen(_rank_command(rank, config.master_addr, config.master_port, config))
                 for rank in range(first, first + per_node)]
    log.info("node %d: tensor-parallel ranks %d..%d joining %s:%d", config.node_rank, first, first + per_node - 1,
             config.master_addr, config.master_port)

    def end(*_) -> None:
        for process in processes:
            process.kill()
        raise SystemExit(1)

    signal.signal(signal.SIGTERM, end)
    left = dict(enumerate(processes, start=first))
    while left:
        time.sleep(_POLL)
        for rank, process in list(left.items()):
            if (code := process.poll()) is None:
                continue
            del left[rank]
            if code:  # (an idle engine would not know until its next step: node 0 hears it now)
                _tell_node_0(config, rank, f"it exited with status {code} on node {config.node_rank}")
    return next((code for code in (p.returncode for p in processes) if code), 0)


def _tell_node_0(config: EngineConfig, rank: int, why: str) -> None:
    """Say in node 0's store that ``rank`` failed (unless it said so itself); nothing if node 0
    is gone too (its ranks' exit is then what ends this node)."""
    with contextlib.suppress(Exception):
        store = dist.TCPStore(config.master_addr, config.master_port, config.tensor_parallel_size, is_master=False,
                              timeout=timedelta(seconds=5))
        if not store.check([f"failed/{rank}"]):
            store.set(f"failed/{rank}", why)


if __name__ == "__main__":
    main()
