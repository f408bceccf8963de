"""Serving latency under load: streams completions from a running server (or one it starts)
and reports throughput, time to first token, inter-token latency and end-to-end latency.

    python bench/serving.py --num-requests 64 --concurrency 16            # starts a server
    python bench/serving.py --url http://127.0.0.1:8000 --num-requests 64  # uses yours

Requests: random token-id prompts of --prompt-len tokens, --max-tokens each, ignore_eos.
Only loopback servers are meant here.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx

from local_server import start_server
import trio


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return f"p50 {pick(0.5) * 1e3:7.1f} ms  p90 {pick(0.9) * 1e3:7.1f} ms  p99 {pick(0.99) * 1e3:7.1f} ms"


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, results: list) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    start = time.perf_counter()
    arrivals = []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0]["text"]:
                    arrivals.append(time.perf_counter())
    results.append((start, arrivals, time.perf_counter()))


async def run(args, url: str) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 49000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    results: list = []
    limiter = trio.CapacityLimiter(args.concurrency)

    async def limited(client, prompt):
        async with limiter:
            await one_request(client, url, prompt, args.max_tokens, results)

    start = time.perf_counter()
    async with httpx.AsyncClient() as client:
        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(limited, client, prompt)
    elapsed = time.perf_counter() - start
    ttft = [arrivals[0] - s for s, arrivals, _ in results if arrivals]
    itl = [b - a for _, arrivals, _ in results for a, b in zip(arrivals, arrivals[1:])]
    e2e = [end - s for s, _, end in results]
    tokens = args.num_requests * args.max_tokens
    print(f"{args.num_requests} requests, concurrency {args.concurrency}, {args.prompt_len} prompt + "
          f"{args.max_tokens} output tokens each: {elapsed:.1f} s, {tokens / elapsed:.1f} output tok/s, "
          f"{args.num_requests / elapsed:.2f} req/s")
    print(f"  time to first token  {percentiles(ttft)}")
    print(f"  inter-token latency  {percentiles(itl)}")
    print(f"  end-to-end latency   {percentiles(e2e)}  (mean {statistics.mean(e2e):.2f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(["--backend", args.backend, "--load-format", args.load_format])
    try:
        trio.run(run, args, url)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
