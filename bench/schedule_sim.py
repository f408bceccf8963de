"""Replays ``bench/serve.py``'s random workload against the real scheduler, in simulated time.

Each step costs what a measured curve says for its number of tokens (``--curve``: points
``tokens:ms``, joined by straight lines; ``bench/step_cost.py`` measures them), so a
scheduling policy's inter-token latency, time to first token and throughput at 32 or 64
streams come out in a second instead of a ten-minute serving run. Closed loop as
``--max-concurrency``: all streams start at once, and each finished request is replaced by
the next. Nothing here models the HTTP front or the client's own CPU, so treat the figures
as the scheduler's share of a real run. ``--request-rate`` sends requests as a Poisson process
instead (at most ``--max-concurrency`` in flight), as serve.py does.

    python bench/schedule_sim.py --max-concurrency 32
    python bench/schedule_sim.py --max-concurrency 64 --request-rate 1.6
    python bench/schedule_sim.py --max-concurrency 64 --mixed-prefill-per-decode 0 --max-num-mixed-prefill-tokens 128
"""

from __future__ import annotations

import argparse
import bisect
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine.sched.scheduler  # noqa: E402
from engine.config import SERVING_CPU_MIXED_PREFILL_PER_DECODE, EngineConfig  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sched.kv_cache import BlockManager  # noqa: E402
from engine.sched.request import Request  # noqa: E402
from engine.sched.scheduler import Scheduler  # noqa: E402

# bench/step_cost.py on the AMD EPYC family-23 VM of 2026-12-05 (packed Q4_1 weights, cpu
# backend, int8 KV cache): one decoding stream and a prompt of 0-1023 tokens joining it, so the
# curve is what prompt tokens cost; a decoding row costs ~0.7 ms more than a prompt token
# (DEFAULT_DECODE_ROW_MS: its LM head row and attention over its context; 64 decoding rows
# 173 ms, against 124 ms for 64 prompt tokens).
DEFAULT_CURVE = "1:9.4,8:24.2,16:40.1,32:68,64:124,128:257,256:519,512:1213,1024:2578,2048:5500"
DEFAULT_DECODE_ROW_MS = 0.7


def parse_curve(text: str) -> list[tuple[int, float]]:
    points = sorted((int(n), float(ms)) for n, ms in (p.split(":") for p in text.split(",")))
    if len(points) < 2:
        raise SystemExit("--curve needs at least two tokens:ms points")
    return points


def step_ms(curve: list[tuple[int, float]], tokens: int) -> float:
    """The curve at ``tokens``: between two points on the line joining them, beyond the ends on the nearest segment."""
    i = min(max(bisect.bisect_left([n for n, _ in curve], tokens), 1), len(curve) - 1)
    (n0, t0), (n1, t1) = curve[i - 1], curve[i]
    return t0 + (t1 - t0) * (tokens - n0) / (n1 - n0)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def random_request(index: int, rng: random.Random, input_len: int, output_len: int, range_ratio: float) -> Request:
    """Request ``index`` with lengths uniform within ``range_ratio`` of the means, as serve.py's
    random dataset draws them, and a prompt of its own (random ones in serve.py), so prefix
    caching finds nothing."""
    def length(mean: int) -> int:
        return max(1, rng.randint(max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))))

    prompt = [1000 + (index * 7919 + j * 31) % 40000 for j in range(length(input_len))]
    max_tokens = length(output_len)
    return Request(f"r{index}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens, None, index)


def send_times(num_prompts: int, request_rate: float, seed: int) -> list[float]:
    """When each request is due (ms): all at once, or a Poisson process at ``request_rate`` a
    second (drawn apart from the lengths, so both modes get the same prompts)."""
    due = [0.0] * num_prompts
    if request_rate != math.inf:
        rng = random.Random(seed + 1)
        for i in range(1, num_prompts):
            due[i] = due[i - 1] + rng.expovariate(request_rate) * 1e3
    return due


def simulate(config: EngineConfig, curve, concurrency: int, num_prompts: int, input_len: int,
             output_len: int, range_ratio: float = 0.0, seed: int = 0, decode_row_ms: float = 0.0,
             request_rate: float = math.inf) -> dict[str, float]:
    """Requests as ``random_request`` makes them, sent at ``send_times``. A step costs the curve at its tokens plus ``decode_row_ms`` per decoding row (the LM head and
    the attention over its context, which a prompt's tokens mostly do not have). With a
    ``request_rate``, requests arrive as a Poisson process (at most ``concurrency`` in flight, as
    serve.py's ``--request-rate`` with ``--max-concurrency``); else all at once."""
    scheduler = Scheduler(config, BlockManager(1 << 16, config.block_size, config.enable_prefix_caching), 1 << 16)
    now = 0.0
    arrival: dict[str, float] = {}
    last: dict[str, float] = {}
    ttft: list[float] = []
    itl: list[float] = []
    sent = generated = steps = 0
    rng = random.Random(seed)

    def send(at: float) -> None:
        nonlocal sent
        request = random_request(sent, rng, input_len, output_len, range_ratio)
        scheduler.add_request(request)
        arrival[request.request_id] = at
        sent += 1

    due = send_times(num_prompts, request_rate, seed)
    in_flight, step_start, free = 0, 0.0, concurrency  # free: slots that were free while the last step ran

    def send_due() -> None:
        nonlocal in_flight, free
        while sent < num_prompts and in_flight < concurrency and due[sent] <= now:
            # sent when due if a slot was free then, else when one freed (the step's end); the
            # scheduler sees it at its next step either way
            send(max(due[sent], step_start) if free > 0 else now)
            in_flight, free = in_flight + 1, free - 1

    send_due()
    while scheduler.num_unfinished or sent < num_prompts:
        if not scheduler.num_unfinished:  # idle until the next arrival
            now = step_start = max(now, due[sent])
            free = concurrency - in_flight
            send_due()
            continue
        plan = scheduler.schedule()
        decoding = sum(1 for c in plan.chunks if c.num_new_tokens == 1)
        step_start = now
        now += step_ms(curve, plan.num_batched_tokens) + decode_row_ms * decoding
        steps += 1
        sampled = {c.request.request_id: 5 for c in plan.chunks if c.samples}
        for request_id in sampled:
            if request_id in last:
                itl.append(now - last[request_id])
            else:
                ttft.append(now - arrival[request_id])
            last[request_id] = now
        generated += len(sampled)
        free = concurrency - in_flight
        in_flight -= len(scheduler.update(plan, sampled))
        send_due()
    return {"output_throughput": generated / now * 1e3, "steps": steps,
            "p50_itl_ms": percentile(itl, 50), "p99_itl_ms": percentile(itl, 99),
            "p50_ttft_ms": percentile(ttft, 50), "p99_ttft_ms": percentile(ttft, 99)}


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-concurrency", type=positive, default=32)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths uniform within this fraction of the means (serve.py's option)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-rate-margin", type=float, default=engine.sched.scheduler.PREFILL_RATE_MARGIN,
                        help="the per-decode ratio follows this many times the recent prompt tokens per output "
                             "token (the scheduler's PREFILL_RATE_MARGIN); 0: the configured ratio only")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--max-num-mixed-prefill-tokens", type=int, default=0, help="a fixed cap; 0: none")
    parser.add_argument("--mixed-prefill-per-decode", type=float, default=SERVING_CPU_MIXED_PREFILL_PER_DECODE,
                        help="the cap that follows the batch (the server's CPU default); 0: none")
    parser.add_argument("--curve", default=DEFAULT_CURVE, help="tokens:ms points of a step's cost")
    parser.add_argument("--decode-row-ms", type=float, default=DEFAULT_DECODE_ROW_MS,
                        help="what a decoding row adds to the curve's cost (its LM head row and attention)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson (default: all at once, a closed loop)")
    args = parser.parse_args()
    engine.sched.scheduler.PREFILL_RATE_MARGIN = args.prefill_rate_margin
    config = EngineConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_mixed_prefill_tokens=args.max_num_mixed_prefill_tokens or None,
                          mixed_prefill_per_decode=args.mixed_prefill_per_decode or None)
    r = simulate(config, parse_curve(args.curve), args.max_concurrency, args.num_prompts, args.random_input_len,
                 args.random_output_len, args.random_range_ratio, args.seed, args.decode_row_ms, args.request_rate)
    print(f"concurrency {args.max_concurrency}, cap {args.max_num_mixed_prefill_tokens or 'none'}, "
          f"per decode {args.mixed_prefill_per_decode or 'none'}: "
          f"{r['output_throughput']:.1f} output tok/s, ITL p50 {r['p50_itl_ms']:.0f} / p99 {r['p99_itl_ms']:.0f} ms "
          f"({r['p99_itl_ms'] / r['p50_itl_ms']:.2f}x), TTFT p50 {r['p50_ttft_ms']:.0f} / p99 {r['p99_ttft_ms']:.0f} ms, "
          f"{r['steps']} steps")


if __name__ == "__main__":
    main()
