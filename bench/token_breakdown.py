"""Where one stream's time per output token goes (or many streams' time per step), HTTP request to the last SSE event.

The server runs in this process with its functions timed (a thread-local stack, so each part
is counted once: a matrix product inside the forward pass is not forward "other"); a client in
another process streams ``/v1/completions`` (128 tokens after a ~96-word prompt, one request
at a time) and times the events. Printed per output token (with ``--streams N``, N clients at
once, each prompt its own first words so that none is another's cached prefix: per engine step,
of the wall time per step, since the streams' tokens come out of a step together):

- the client's inter-token time (TPOT);
- the device work of a step (the runner): the decoder layers (on the cpu backend one native
  call; with ``--layer-loop`` op by op: matrix products, attention, rotary + KV write, norms),
  the rest of the forward pass, the LM head (its product included), sampling, input preparation;
- the core actor's step around it: scheduling, updating, and the hop to the device thread and
  back (the wait for the step minus the step's own time);
- the output actor (detokenization, request state), SSE chunk encoding;
- what is left: the event loop between steps, HTTP, the socket, the client.

    python bench/token_breakdown.py                      # the default model, --backend cpu
    python bench/token_breakdown.py --requests 8 --max-tokens 256 -- --activation-quantization int16
    python bench/token_breakdown.py --layer-loop         # the layers op by op (their parts one by one)
    python bench/token_breakdown.py --streams 64 --requests 2 --layer-loop   # a 64-stream step

Flags after ``--`` go to the server (``python -m engine.api``'s).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. The keeper has lived "
          "alone on the rock for twenty years, tending the lamp through storms and calm nights, and has long "
          "stopped expecting anything from the sea. One morning after a gale, a green bottle lies among the "
          "kelp at the foot of the stairs. Inside is a letter written in a hand the keeper seems to recognise, "
          "dated thirty years ago, addressed to nobody in particular. Tell what the letter says.")

CLIENT = r"""
import json, sys, threading, time, httpx
url, n, max_tokens, prompt, streams = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
gaps, counts, errors, lock = [], [], [], threading.Lock()


def run(count, keep, stream="warm-up"):
    # each stream its own first words: no stream's prompt is a cached prefix of another's
    body = {"prompt": f"({stream}) {prompt}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    try:
        stream_requests(body, count, keep)
    except Exception as exc:
        with lock:
            errors.append(repr(exc))


def stream_requests(body, count, keep):
    with httpx.Client(timeout=600) as client:
        for _ in range(count):
            times = []
            with client.stream("POST", url + "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())
            if keep:
                with lock:
                    gaps.extend(b - a for a, b in zip(times, times[1:]))
                    counts.append(len(times))


run(1, False)  # the first request warms up and is not counted
if errors:
    sys.exit(f"the warm-up failed: {errors[0]}")
print(json.dumps({"warm": True}), flush=True)
threads = [threading.Thread(target=run, args=(n, True, i)) for i in range(streams)]
for t in threads:
    t.start()
for t in threads:
    t.join()
if errors:
    sys.exit(f"{len(errors)} streams failed: {errors[0]}")
print(json.dumps({"gaps": gaps, "tokens": sum(counts)}), flush=True)
"""


class Timers:
    """Exclusive time per part: a part's time excludes the timed parts it calls (per thread)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._local = threading.local()
        self.enabled = False
        self.wall = 0.0  # seconds measured (set by measure)

    def wrap(self, owner, name: str, part: str, inside: dict[str, str] | None = None) -> None:
        """Time ``owner.name`` as ``part`` (or as ``inside[caller's part]`` when called from a
        part named there: the LM head's matrix product is the LM head's)."""
        real = owner.__dict__[name]
        timers = self

        def timed(*args, **kwargs):
            if not timers.enabled:
                return real(*args, **kwargs)
            stack = timers._local.__dict__.setdefault("stack", [])
            mine = inside.get(stack[-1][0], part) if inside and stack else part
            stack.append([mine, 0.0])  # time spent in timed children
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                _, children = stack.pop()
                timers.total[mine] += elapsed - children
                timers.calls[mine] += 1
                if stack:
                    stack[-1][1] += elapsed

        setattr(owner, name, timed)

    def wrap_hop(self, actor_owner, actor_name: str, job_owner, job_name: str) -> None:
        """The step's trip to the device thread: from the core actor handing the step over
        (``actor_owner.actor_name``, a coroutine) to the job starting on the device thread
        (``job_owner.job_name``), and from the job's end to the actor running again."""
        real_actor, real_job = actor_owner.__dict__[actor_name], job_owner.__dict__[job_name]
        timers, marks = self, {}

        def job(*args, **kwargs):
            marks["start"] = time.perf_counter()
            try:
                return real_job(*args, **kwargs)
            finally:
                marks["end"] = time.perf_counter()

        async def actor(*args, **kwargs):
            submit = time.perf_counter()
            try:
                return await real_actor(*args, **kwargs)
            finally:
                resume = time.perf_counter()
                if timers.enabled and "end" in marks:
                    timers.total["step: hop to the device thread"] += marks["start"] - submit
                    timers.total["step: hop back to the event loop"] += resume - marks["end"]
                    timers.total["step: wait for the device"] += resume - submit
                marks.clear()

        setattr(job_owner, job_name, job)
        setattr(actor_owner, actor_name, actor)


def instrument(timers: Timers) -> None:
    from api import serving
    from backends import layer_ops, reference
    from engine.core import core_actor, engine_core
    from engine.frontend import output_actor
    from engine.models import linear, llama
    from engine.runner import model_runner, sampler

    timers.wrap(model_runner.ModelRunner, "execute", "device: runner other")
    timers.wrap(model_runner.ModelRunner, "_prepare", "device: input preparation")
    timers.wrap(model_runner.ModelRunner, "_prompt_logprobs", "device: runner other")
    timers.wrap(llama.LlamaModel, "forward", "device: forward, other")
    timers.wrap(llama.LlamaModel, "compute_logits", "device: LM head")
    for cls in (linear.DenseLinear, linear.PackedLinear, linear.CudaPackedLinear):
        timers.wrap(cls, "__call__", "device: matrix products", inside={"device: LM head": "device: LM head"})
    for cls in {layer_ops.TorchLayerOps, *layer_ops.TorchLayerOps.__subclasses__(), *_cpu_layer_ops()}:
        for name, part in (("rope_write_kv", "device: rotary + KV write"), ("add_rms_norm", "device: norms"),
                           ("silu_mul", "device: forward, other"),
                           ("decoder_layers", "device: decoder layers (one native call)")):
            if name in cls.__dict__:
                timers.wrap(cls, name, part)
    for cls in [reference.TorchAttentionBackend, *_cpu_backend()]:
        timers.wrap(cls, "attend", "device: attention")
    timers.wrap(sampler.Sampler, "__call__", "device: sampling")
    timers.wrap(engine_core.EngineCore, "schedule", "step: schedule")
    timers.wrap(engine_core.EngineCore, "update", "step: update")
    timers.wrap_hop(core_actor.CoreActor, "_execute", engine_core.EngineCore, "execute")
    timers.wrap(output_actor.OutputActor, "process", "output actor")
    timers.wrap(serving.ChunkWriter, "__call__", "SSE chunk encoding")


def _cpu_layer_ops() -> list[type]:
    try:
        from backends.cpu import CpuLayerOps
    except Exception:  # noqa: BLE001 - the native library may be missing: the torch ops remain
        return []
    return [CpuLayerOps]


def _cpu_backend() -> list[type]:
    try:
        from backends.cpu import CpuAttentionBackend
    except Exception:  # noqa: BLE001
        return []
    return [CpuAttentionBackend]


async def measure(args, server_flags: list[str]) -> tuple[Timers, dict]:
    from api.cli import build_parser
    from api.server import run_server

    timers = Timers()
    instrument(timers)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server_args = build_parser().parse_args(["--port", str(port), "--log-level", "warning", *server_flags])
    async with trio.open_nursery() as nursery:
        await nursery.start(run_server, server_args)
        client = await trio.lowlevel.open_process(
            [sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}", str(args.requests), str(args.max_tokens),
             PROMPT, str(args.streams)], stdout=subprocess.PIPE)
        lines = []
        buffer = b""
        started = time.perf_counter()  # (from the warm-up's end, below)
        async for chunk in client.stdout:
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                message = json.loads(line)
                if message.get("warm"):
                    timers.enabled = True  # count from the first measured request on
                    started = time.perf_counter()
                else:
                    lines.append(message)
        await client.wait()
        timers.enabled = False
        timers.wall = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    if client.returncode != 0 or not lines:
        raise SystemExit("the client failed")
    return timers, lines[-1]


def call_overhead() -> float:
    """Seconds one timed call adds (its wrapper's own work), measured on a no-op."""
    class Probe:
        def noop(self):
            return None

    timers = Timers()
    timers.wrap(Probe, "noop", "probe")
    timers.enabled = True
    probe, n = Probe(), 20000
    start = time.perf_counter()
    for _ in range(n):
        probe.noop()
    timed = time.perf_counter() - start
    timers.enabled = False
    start = time.perf_counter()
    for _ in range(n):
        probe.noop()
    return max(0.0, (timed - (time.perf_counter() - start)) / n)


def report(timers: Timers, client: dict, streams: int) -> None:
    """Per output token for one stream (of the client's mean inter-token time); per engine step
    for several (of the wall time per step: the streams' tokens come out together)."""
    tokens = client["tokens"]
    gaps = sorted(client["gaps"])
    tpot = sum(gaps) / len(gaps)
    steps = timers.calls["step: schedule"]
    count, unit = (tokens, "token") if streams == 1 else (steps, "step")
    whole = tpot * 1e3 if streams == 1 else timers.wall / steps * 1e3
    per = {part: seconds / count * 1e3 for part, seconds in timers.total.items()}
    device = sum(v for k, v in per.items() if k.startswith("device:"))
    wait = per.pop("step: wait for the device", 0.0)
    hop = wait - device
    to_device, back = per.pop("step: hop to the device thread", 0.0), per.pop("step: hop back to the event loop", 0.0)
    rows = [(part, per[part]) for part in sorted(per) if part.startswith("device:")]
    rows += [("step: thread hop (wait - device)", hop), ("  of which: to the device thread", to_device),
             ("  of which: back to the event loop", back),
             ("  of which: on the device thread, untimed", hop - to_device - back),
             ("step: schedule", per.get("step: schedule", 0.0)),
             ("step: update", per.get("step: update", 0.0)), ("output actor", per.get("output actor", 0.0)),
             ("SSE chunk encoding", per.get("SSE chunk encoding", 0.0))]
    accounted = device + hop + sum(per.get(k, 0.0) for k in ("step: schedule", "step: update", "output actor",
                                                             "SSE chunk encoding"))
    rows.append(("rest: event loop, HTTP, socket, client", whole - accounted))
    percentiles = (f"p50 {gaps[len(gaps) // 2] * 1e3:.2f}, p90 {gaps[int(len(gaps) * 0.9)] * 1e3:.2f}, "
                   f"p99 {gaps[int(len(gaps) * 0.99)] * 1e3:.2f}")
    if streams == 1:
        print(f"one stream, {tokens} output tokens measured; client TPOT mean {tpot * 1e3:.2f} ms ({percentiles})")
    else:
        print(f"{streams} streams, {tokens} output tokens in {steps} steps ({tokens / steps:.1f} a step), "
              f"{tokens / timers.wall:.1f} tok/s; wall time a step {whole:.2f} ms; client ITL mean "
              f"{tpot * 1e3:.2f} ms ({percentiles})")
    print(f"{'part':44s} {'ms/' + unit:>9s} {'share':>7s}")
    for part, ms in rows:
        print(f"{part:44s} {ms:9.3f} {ms / whole:7.1%}")
    host = whole - device
    print(f"{'device work (the runner)':44s} {device:9.3f} {device / whole:7.1%}")
    print(f"{'host (everything but the device work)':44s} {host:9.3f} {host / whole:7.1%}")
    calls = sum(timers.calls.values()) / count
    overhead = calls * call_overhead() * 1e3
    print(f"(the timing itself: {calls:.0f} timed calls a {unit}, ~{overhead:.3f} ms a {unit}, inside the parts "
          "above; the output actor and SSE run while the device computes the next step)")


def main() -> None:
    argv = sys.argv[1:]
    server_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4,
                        help="measured requests of each stream, one at a time (after a warm-up)")
    parser.add_argument("--streams", type=int, default=1,
                        help="concurrent streams (each its own prompt); above one, parts are shown per engine step")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for the server (seconds; Python's default 0.005): how long a "
                             "thread that wants the GIL waits for the holder to give it up")
    parser.add_argument("--layer-loop", action="store_true",
                        help="run the decoder layers op by op (as other backends and models do) instead of the cpu "
                             "backend's one native call, so that their parts show one by one")
    args = parser.parse_args(argv)
    if args.layer_loop:
        from engine.models.llama import LlamaModel

        LlamaModel._layer_stack = lambda self, ops, rows: None
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if not any(f.startswith("--backend") for f in server_flags):
        server_flags = ["--backend", args.backend, *server_flags]
    timers, client = trio.run(measure, args, server_flags)
    report(timers, client, args.streams)


if __name__ == "__main__":
    main()
