"""Engine overhead without a model, and event-loop responsiveness with one.

1. A null model (the runner returns a fixed token at once) at 1, 64 and 256 running
   requests: steps per second and the per-step cost of scheduler + core actor +
   output actor + output channels + consumers; at 256 also non-streaming, and streaming
   with a ``--stream-interval`` (consumers woken every few tokens). Then behind the HTTP
   server, with streaming clients in a second process (``--http-streams``): SSE and HTTP
   included.
2. Event-loop lag while the real model (shape; dummy weights unless --real-weights) decodes
   64 requests: the largest delay seen by a ``trio.sleep(0)`` probe.

    python bench/engine_overhead.py
    python bench/engine_overhead.py --profile   # where the 256-request case spends its time (py-spy)
    python bench/engine_overhead.py --instructions   # its instructions per step (callgrind)

Timings on the shared development VMs swing by up to 2x from run to run; compare two trees
by alternating runs and reading the minimum (``--repeat``), or by their instruction counts
(``--instructions``, deterministic within ~2%).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.frontend.async_engine import Engine  # noqa: E402
from engine.frontend.output_actor import OutputActor  # noqa: E402
from engine.models.llama import LlamaConfig, LlamaModel  # noqa: E402
from engine.models.loader import dummy_weights, resolve_model  # noqa: E402
from engine.plan import RunnerOutput, StepPlan  # noqa: E402
from engine.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from engine.tokenizer import load_tokenizer  # noqa: E402

TOKEN = 1000  # the null model's every token (decodes to ordinary text)


def null_core(num_requests: int, stream_interval: int = 1) -> EngineCore:
    tiny = LlamaConfig(vocab_size=49152, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                       num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=4096,
                       tie_word_embeddings=True, eos_token_id=2)
    model = LlamaModel.from_state_dict(tiny, dict(dummy_weights(tiny, 0)), torch.float32, "cpu")
    config = EngineConfig(backend="torch", num_kv_blocks=max(num_requests, 8) * 40, max_model_len=512,
                          max_num_seqs=max(num_requests, 1), max_num_batched_tokens=max(4096, num_requests * 16),
                          stream_interval=stream_interval)
    core = EngineCore(config, model=model)

    def execute(plan: StepPlan) -> RunnerOutput:
        ids = plan.request_ids
        return RunnerOutput({ids[row]: TOKEN for row in plan.sample_rows}, {}, {})

    core.runner.execute = execute
    return core


class TimedOutputActor(OutputActor):
    """The output actor, timing its own work per step."""

    times: list[float] = []

    def process(self, step) -> None:
        start = time.perf_counter()
        super().process(step)
        self.times.append(time.perf_counter() - start)


async def null_stream(client, i: int, params: SamplingParams) -> None:
    """Stream ``i`` of a null-model run: a 16-token prompt (one of 500), read to its end."""
    async for _ in client.generate([100 + i % 500] * 16, params):
        pass


async def measure_overhead(tokenizer, num_requests: int, num_steps: int,
                           kind: RequestOutputKind = RequestOutputKind.DELTA,
                           stream_interval: int = 1) -> tuple[float, float, float]:
    """(median wall time per step, steps/s, median engine-side time per step: schedule + update + detokenize).

    ``kind`` DELTA is a streaming client (woken every ``stream_interval`` steps); FINAL_ONLY a
    non-streaming one.
    """
    core = null_core(num_requests, stream_interval)
    params = SamplingParams(max_tokens=num_steps + 20, ignore_eos=True, output_kind=kind)
    step_times: list[float] = []
    engine_times: list[float] = []
    TimedOutputActor.times = []

    async def watch(client):
        last = None
        async for step in client.steps():
            now = time.perf_counter()
            if step.timings is not None:
                engine_times.append(step.timings.schedule_s + step.timings.update_s + TimedOutputActor.times[-1])
            if last is not None:
                step_times.append(now - last)
            last = now
            if len(step_times) >= num_steps:
                return

    async with Engine(core, tokenizer).serve() as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, client)
            for i in range(num_requests):
                nursery.start_soon(null_stream, client, i, params)
            while len(step_times) < num_steps:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    steady = step_times[10:]  # skip the admission steps
    return statistics.median(steady), 1 / statistics.mean(steady), statistics.median(engine_times[10:])


async def measure_lag(args, tokenizer) -> tuple[float, float, int]:
    config = EngineConfig(model=args.model, backend="torch", load_format="auto" if args.real_weights else "dummy",
                          max_num_seqs=64)
    core = await trio.to_thread.run_sync(EngineCore, config)
    params = SamplingParams(max_tokens=args.lag_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    lags: list[float] = []

    async def consume(client, i):
        async for _ in client.generate([200 + i] * 64, params):
            pass

    async def probe():
        while True:
            t = time.perf_counter()
            await trio.sleep(0)
            lags.append(time.perf_counter() - t)
            await trio.sleep(0.001)

    async with Engine(core, tokenizer).serve() as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe)
            async with trio.open_nursery() as requests:
                for i in range(64):
                    requests.start_soon(consume, client, i)
            nursery.cancel_scope.cancel()
        steps = client.stats().num_steps
    return max(lags), statistics.median(lags), steps


# The streaming clients of measure_http, in a process of their own (this one is the server's).
_HTTP_CLIENTS = """
import sys, httpx, trio

async def main(url, count, max_tokens):
    limits = httpx.Limits(max_connections=count + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def stream(i):
            body = {"prompt": [100 + i % 500] * 16, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for _ in response.aiter_raw():
                    pass
        async with trio.open_nursery() as nursery:
            for i in range(count):
                nursery.start_soon(stream, i)

trio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
"""


async def measure_http(tokenizer, num_streams: int, num_steps: int, stream_interval: int) -> tuple[float, float]:
    """(median, mean) step time of the null model behind the HTTP server (hypercorn + the app, in
    this process) while ``num_streams`` streaming completions read it from another process: the
    per-stream cost of a served step, SSE events and HTTP included."""
    import subprocess

    from hypercorn.config import Config
    from hypercorn.trio import serve

    from api.app import ServerState, create_app

    core = null_core(num_streams, stream_interval)
    state = ServerState("null")
    app = create_app(state)
    config = Config()
    config.bind, config.accesslog = ["127.0.0.1:0"], None
    times: list[float] = []
    async with Engine(core, tokenizer).serve() as client, trio.open_nursery() as nursery:
        state.attach(client)
        binds = await nursery.start(serve, app, config)
        clients = subprocess.Popen([sys.executable, "-c", _HTTP_CLIENTS, binds[0], str(num_streams),
                                    str(core.max_model_len - 32)])
        try:
            last = None
            async for step in client.steps():
                now = time.perf_counter()
                if len(step.decodes) >= 0.9 * num_streams:  # (the last streams connect late)
                    if last is not None:
                        times.append(now - last)
                    last = now
                if len(times) >= num_steps:
                    break
        finally:
            clients.kill()
            clients.wait()
        nursery.cancel_scope.cancel()
    steady = times[10:]
    return statistics.median(steady), statistics.mean(steady)


def profile(args) -> None:
    """Where the per-step time goes at 256 streaming requests: the functions with the most own time.

    py-spy samples this script from outside (``pip install py-spy``), so the figures are the
    real ones: cProfile's per-call cost inflated this workload of many tiny calls about 4x
    and shifted the shares towards them. Everything runs on the event loop's thread.
    """
    import shutil
    import subprocess
    import tempfile

    py_spy = shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    with tempfile.NamedTemporaryFile(suffix=".txt") as raw:
        command = [py_spy, "record", "--rate", "500", "--function", "--format", "raw", "--output", raw.name, "--",
                   sys.executable, __file__, "--profiled", "--steps", str(args.steps),
                   "--repeat", str(args.repeat)]
        subprocess.run(command + (["--model", args.model] if args.model else []), check=True)
        own: Counter = Counter()
        inclusive: Counter = Counter()
        total = 0
        for line in Path(raw.name).read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            # The event loop's samples, less its start-up (imports, the null model's set-up).
            if not any("unrolled_run" in f for f in frames) or any(
                    "null_core" in f or "importlib" in f or "load_tokenizer" in f for f in frames):
                continue
            total += int(count)
            own[frames[-1]] += int(count)
            for frame in set(frames):
                inclusive[frame] += int(count)
    if total < 100:
        raise SystemExit(f"only {total} samples of the steps: did the profiled run fail?")
    print(f"256 running: {total} samples of the steps; top 20 functions by own time")
    for frame, count in own.most_common(20):
        print(f"  {100 * count / total:5.1f}% own {100 * inclusive[frame] / total:5.1f}% incl  {frame}")


async def counted_steps(tokenizer, num_requests: int, num_steps: int) -> None:
    """The run that --instructions counts: callgrind's instrumentation is switched on for
    ``num_steps`` steps once ``num_requests`` streams decode (from the 20th step), and off after."""
    import os
    import subprocess

    def instrument(state: str) -> None:
        subprocess.run(["callgrind_control", "--instr=" + state, str(os.getpid())], check=True,
                       capture_output=True)

    core = null_core(num_requests)
    params = SamplingParams(max_tokens=num_steps + 60, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async with Engine(core, tokenizer).serve() as client, trio.open_nursery() as nursery:
        for i in range(num_requests):
            nursery.start_soon(null_stream, client, i, params)
        seen = 0
        async for _ in client.steps():
            seen += 1
            if seen == 20:
                instrument("on")
            elif seen == 20 + num_steps:
                instrument("off")
                break
        nursery.cancel_scope.cancel()


def count_instructions(args) -> None:
    """Instructions per step at 256 streams, counted by callgrind (valgrind): unlike the wall
    clock of a shared VM, the same from run to run within ~2% (how the streams' wake-ups
    coalesce varies a little), so two trees compare in one run each. Slow: ~50x under valgrind."""
    import re
    import shutil
    import subprocess
    import tempfile

    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("--instructions needs valgrind (callgrind)")
    steps = min(args.steps, 60)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                        sys.executable, __file__, "--counted", "--steps", str(steps)]
                       + (["--model", args.model] if args.model else []), check=True, capture_output=True)
        totals = re.search(r"^totals:\s+(\d+)", out.read_text(), re.MULTILINE)
    if totals is None:
        raise SystemExit("callgrind wrote no totals: did the counted run fail?")
    print(f"256 running: {int(totals.group(1)) / steps / 1e6:.2f} M instructions per step "
          f"(callgrind, {steps} steps)")


async def main(args) -> None:
    import engine.frontend.async_engine

    engine.frontend.async_engine.OutputActor = TimedOutputActor
    tokenizer = load_tokenizer(resolve_model(args.model))
    if args.counted:  # the run that --instructions counts
        await counted_steps(tokenizer, 256, args.steps)
        return
    if args.profiled:  # the run that --profile samples
        for _ in range(args.repeat):
            median, _, _ = await measure_overhead(tokenizer, 256, args.steps)
            print(f"256 running: {median * 1e3:.3f} ms/step (median) while sampled")
        return
    print("null model: per-step overhead of scheduler + actors + output actor + consumers"
          + (f" (the lowest of {args.repeat} runs)" if args.repeat > 1 else ""))
    for n in (1, 64, 256):
        runs = [await measure_overhead(tokenizer, n, args.steps) for _ in range(args.repeat)]
        median, rate, engine_side = min(runs)
        print(f"  {n:4d} running: {median * 1e3:7.3f} ms/step with {n} consumer tasks (median), {rate:8.1f} steps/s; "
              f"engine side (schedule + update + detokenize) {engine_side * 1e3:.3f} ms/step")
    runs = [await measure_overhead(tokenizer, 256, args.steps, RequestOutputKind.FINAL_ONLY)
            for _ in range(args.repeat)]
    median, rate, engine_side = min(runs)
    print(f"   256 non-streaming (final-only) requests: {median * 1e3:7.3f} ms/step, {rate:8.1f} steps/s; "
          f"engine side {engine_side * 1e3:.3f} ms/step")
    for interval in args.stream_intervals:
        runs = [await measure_overhead(tokenizer, 256, args.steps, stream_interval=interval)
                for _ in range(args.repeat)]
        _, rate, engine_side = max(runs, key=lambda run: run[1])
        # The streams wake together every few steps here (they started together), so the mean.
        print(f"   256 streaming with --stream-interval {interval}: {1e3 / rate:7.3f} ms/step (mean), "
              f"{rate:8.1f} steps/s; engine side {engine_side * 1e3:.3f} ms/step")
    for streams in args.http_streams:
        for interval in [1, *args.stream_intervals]:
            median, mean = await measure_http(tokenizer, streams, min(args.steps, 150), interval)
            print(f"  {streams:4d} HTTP streams (the server, clients in another process), --stream-interval "
                  f"{interval}: {median * 1e3:7.3f} ms/step (median), {mean * 1e3:7.3f} (mean)")
    max_lag, median_lag, steps = await measure_lag(args, tokenizer)
    print(f"event-loop lag while the model decodes 64 requests ({steps} steps): "
          f"max {max_lag * 1e3:.2f} ms, median {median_lag * 1e3:.3f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lag-tokens", type=int, default=32)
    parser.add_argument("--real-weights", action="store_true")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case; the lowest is printed")
    parser.add_argument("--stream-intervals", type=lambda text: [int(v) for v in text.split(",") if v], default=[4, 16],
                        help="also measure 256 streams with these --stream-interval values (comma-separated)")
    parser.add_argument("--http-streams", type=lambda text: [int(v) for v in text.split(",") if v], default=[64],
                        help="also measure the null model behind the HTTP server with this many streaming "
                             "clients (comma-separated; '' for none)")
    parser.add_argument("--profile", action="store_true", help="profile the 256-request case instead (py-spy)")
    parser.add_argument("--profiled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--instructions", action="store_true",
                        help="count the 256-request case's instructions per step instead (callgrind)")
    parser.add_argument("--counted", action="store_true", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.profile:
        profile(cli)
    elif cli.instructions:
        count_instructions(cli)
    else:
        trio.run(main, cli)
