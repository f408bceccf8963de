"""Soak test: thousands of mixed requests against the real server, watching for failures,
memory growth and leaked KV blocks.

Requests mix chat and text completions, streamed and not, n in 1..3, stop strings, logprobs,
seeds, greedy and sampled; some clients cancel mid-stream on purpose and some requests are
invalid on purpose (they must get a 400). It reports failures among the requests that were
neither (target 0), the server's peak RSS and its RSS at the end against the value after
warm-up (target: within 10%), p50/p99 time to first token of streams, and what the engine
holds at the end (target: nothing).

    python bench/soak.py                      # starts `python -m engine.api` itself
    python bench/soak.py --base-url http://127.0.0.1:8000 --server-pid 1234
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from pathlib import Path

import httpx
import trio
from local_server import start_server

TOPICS = ["the sea", "a robot", "mountains", "coffee", "the moon", "a library", "trains", "winter", "bees", "rain"]
INVALID = [{"temperature": -1}, {"n": 0}, {"max_tokens": "ten"}, {"top_p": 7}, {"logit_bias": {"x": 1}},
           {"stop": [""]}, {"seed": 2**64}, {"stream_options": {"include_usage": True}}]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def make_request(rng: random.Random, i: int) -> tuple[str, dict, str]:
    """(endpoint, body, kind) with kind 'ok', 'cancel' or 'invalid'."""
    chat = rng.random() < 0.5
    topic = TOPICS[i % len(TOPICS)]
    body: dict = {"max_tokens": rng.randint(4, 48), "n": rng.choice([1, 1, 1, 2, 3]),
                  "temperature": rng.choice([0.0, 0.8]), "stream": rng.random() < 0.6}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Write two sentences about {topic} (#{i})."}]
    else:
        body["prompt"] = f"A short note about {topic} (#{i}):"
    if rng.random() < 0.2:
        body["stop"] = [rng.choice([".", "\n", " the"])]
    if rng.random() < 0.2:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 2**31)
    kind = "ok"
    roll = rng.random()
    if roll < 0.05:
        kind = "invalid"
        body.update(rng.choice(INVALID))
        if "stream_options" in body:
            body["stream"] = False  # stream_options is invalid only without stream
    elif roll < 0.15 and body["stream"]:
        kind = "cancel"
        body["max_tokens"] = 200
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, kind


class Soak:
    def __init__(self, base_url: str, pid: int | None) -> None:
        self.base_url = base_url
        self.pid = pid
        self.outcomes: dict[str, int] = {"ok": 0, "cancelled": 0, "rejected as expected": 0, "failed": 0}
        self.failures: list[str] = []
        self.ttfts: list[float] = []
        self.rss_peak = 0
        self.rss_after_warmup: int | None = None
        self.done = 0

    async def one(self, http: httpx.AsyncClient, endpoint: str, body: dict, kind: str, rng: random.Random) -> None:
        start = time.perf_counter()
        try:
            if body.get("stream"):
                await self._stream(http, endpoint, body, kind, rng, start)
            else:
                response = await http.post(endpoint, json=body)
                self._judge(kind, response.status_code, response.text)
        except httpx.HTTPError as exc:
            self._fail(f"{endpoint}: {type(exc).__name__}: {exc}")
        self.done += 1

    async def _stream(self, http, endpoint, body, kind, rng, start) -> None:
        async with http.stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                self._judge(kind, response.status_code, (await response.aread()).decode())
                return
            leave_after = rng.randint(1, 5) if kind == "cancel" else None
            events, last, first_token = 0, "", True
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if first_token and carries_text(line):
                    self.ttfts.append(time.perf_counter() - start)
                    first_token = False
                events += 1
                last = line
                if '"error"' in line:
                    self._fail(f"{endpoint}: error event {line[:200]}")
                    return
                if events == leave_after:
                    self.outcomes["cancelled"] += 1
                    return
            self._judge(kind, 200 if last == "data: [DONE]" else 599, last)

    def _judge(self, kind: str, status: int, text: str) -> None:
        if kind == "invalid":
            if status == 400:
                self.outcomes["rejected as expected"] += 1
            else:
                self._fail(f"an invalid request got {status}: {text[:200]}")
        elif status == 200:
            self.outcomes["ok"] += 1
        else:
            self._fail(f"{status}: {text[:200]}")

    def _fail(self, message: str) -> None:
        self.outcomes["failed"] += 1
        if len(self.failures) < 20:
            self.failures.append(message)

    async def watch_rss(self, warmup: int) -> None:
        while self.pid is not None:
            rss = rss_kib(self.pid)
            self.rss_peak = max(self.rss_peak, rss)
            if self.rss_after_warmup is None and self.done >= warmup:
                self.rss_after_warmup = rss
            await trio.sleep(0.25)

    async def run(self, num_requests: int, concurrency: int, warmup: int, seed: int) -> None:
        rng = random.Random(seed)
        slots = trio.Semaphore(concurrency)  # acquired here, released by the request's task
        async with httpx.AsyncClient(base_url=self.base_url, timeout=300,
                                     limits=httpx.Limits(max_connections=concurrency + 8)) as http:
            async with trio.open_nursery() as watchers:
                watchers.start_soon(self.watch_rss, warmup)
                async with trio.open_nursery() as nursery:
                    for i in range(num_requests):
                        endpoint, body, kind = make_request(rng, i)
                        await slots.acquire()

                        async def task(endpoint=endpoint, body=body, kind=kind, r=random.Random(rng.random())):
                            try:
                                await self.one(http, endpoint, body, kind, r)
                            finally:
                                slots.release()

                        nursery.start_soon(task)
                watchers.cancel_scope.cancel()
            await self.settle(http)

    async def settle(self, http: httpx.AsyncClient) -> None:
        """Wait for the engine to drain (cancelled requests are aborted within a step)."""
        deadline = trio.current_time() + 30
        while trio.current_time() < deadline:
            self.engine = metrics(await http.get("/metrics"))
            if not (self.engine["vllm:num_requests_running"] or self.engine["vllm:num_requests_waiting"]):
                break
            await trio.sleep(0.2)
        await trio.sleep(1.0)  # let freed memory settle before the last reading
        self.rss_final = rss_kib(self.pid) if self.pid else 0


def carries_text(line: str) -> bool:
    """An event with generated text (not chat's opening role chunk, not [DONE])."""
    if line == "data: [DONE]":
        return False
    choices = json.loads(line[6:]).get("choices") or []
    return any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices)


def metrics(response: httpx.Response) -> dict[str, float]:
    values = {}
    for line in response.text.splitlines():
        if line.startswith("vllm:") and "{" in line:
            values[line.split("{", 1)[0]] = values.get(line.split("{", 1)[0], 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="a running server (default: start one)")
    parser.add_argument("--server-pid", type=int, default=None, help="its pid, to read its memory")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=200, help="requests after which the baseline RSS is read")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-result", default=None, help="write the figures as JSON to this file")
    parser.add_argument("server_args", nargs="*", help="flags for the started server (after --)")
    args = parser.parse_args()
    proc = None
    if args.base_url is None:
        proc, base_url = start_server(args.server_args)
        pid = proc.pid
    else:
        base_url, pid = args.base_url, args.server_pid
    soak = Soak(base_url, pid)
    started = time.perf_counter()
    try:
        trio.run(soak.run, args.num_requests, args.concurrency, args.warmup, args.seed)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    report(soak, time.perf_counter() - started, args, proc.returncode if proc else None)


def report(soak: Soak, duration: float, args, exit_code: int | None) -> None:
    engine = soak.engine
    growth = (soak.rss_final / soak.rss_after_warmup - 1) if soak.rss_after_warmup else float("nan")
    result = {
        "requests": args.num_requests, "concurrency": args.concurrency, "duration_s": round(duration, 1),
        **soak.outcomes,
        "ttft_p50_ms": round(percentile(soak.ttfts, 50) * 1e3, 1), "ttft_p99_ms": round(percentile(soak.ttfts, 99) * 1e3, 1),
        "rss_after_warmup_mib": round((soak.rss_after_warmup or 0) / 1024, 1),
        "rss_peak_mib": round(soak.rss_peak / 1024, 1), "rss_final_mib": round(soak.rss_final / 1024, 1),
        "rss_final_vs_warmup": f"{growth:+.1%}",
        "running_at_end": engine.get("vllm:num_requests_running"), "waiting_at_end": engine.get("vllm:num_requests_waiting"),
        "kv_cache_usage_at_end": engine.get("vllm:kv_cache_usage_perc"), "server_exit_code": exit_code,
    }
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    for failure in soak.failures:
        print("failure:", failure)
    if args.save_result:
        Path(args.save_result).write_text(json.dumps({**result, "failures": soak.failures}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
