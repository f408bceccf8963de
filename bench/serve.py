"""Serving benchmark for any OpenAI-compatible server, with the options and the printed table
of ``vllm bench serve``.

    python -m engine.api &                                   # or vLLM, or llama.cpp's server
    python bench/serve.py --dataset-name random --random-input-len 128 --random-output-len 128 \\
        --num-prompts 256 --max-concurrency 64 --ignore-eos
    python bench/serve.py --sweep 1,8,16,32,64 --tpot-bound-ms 200 --num-prompts 128 --ignore-eos \\
        --save-result --result-filename sweep.json --plot sweep.png
    python bench/serve.py --plot compare.png --plot-results ours.json theirs.json   # side by side

Requests stream (``stream_options.include_usage``), so token counts come from the server's
own ``usage``. TTFT is the time to the first chunk that answers a step (any chunk with choices,
text or not, as ``vllm bench serve`` counts them; a chat stream's opening role chunk aside); ITL the
gaps between later ones; TPOT (time per output token, first token excluded) is
``(latency - ttft) / (output_tokens - 1)`` per request; E2EL the whole latency.
Random prompts are random token ids of the default model's vocabulary (or ``--tokenizer``),
decoded to text and cut to length, as vLLM's random dataset does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


# ---- workload ----

@attrs.frozen
class Prompt:
    text: str
    input_len: int  # tokens, by the benchmark's tokenizer (the server's usage is what is reported)
    output_len: int


def load_tokenizer(path: str | None):
    """``--tokenizer`` (a HF directory or a .gguf file), else the default model's; None if neither loads."""
    try:
        from engine.models.loader import resolve_model
        from engine.tokenizer import load_tokenizer as load

        return load(resolve_model(path))
    except Exception as exc:  # a benchmark of another server may run where our model is not installed
        print(f"no tokenizer ({exc}); prompts are random words and their lengths approximate", file=sys.stderr)
        return None


def random_prompts(args, tokenizer, rng: random.Random) -> list[Prompt]:
    def length(mean: int) -> int:
        low, high = int(mean * (1 - args.random_range_ratio)), int(mean * (1 + args.random_range_ratio))
        return max(1, rng.randint(max(1, low), max(1, high)))

    prompts = []
    for _ in range(args.num_prompts):
        input_len, output_len = length(args.random_input_len), length(args.random_output_len)
        prompts.append(Prompt(random_text(tokenizer, input_len, rng), input_len, output_len))
    return prompts


def random_text(tokenizer, num_tokens: int, rng: random.Random) -> str:
    if tokenizer is None:
        return " ".join(rng.choice(("alpha", "bravo", "charlie", "delta", "echo", "golf")) for _ in range(num_tokens))
    vocab = len(tokenizer)
    ids = [rng.randrange(1000, vocab) for _ in range(num_tokens)]  # past the special and byte tokens
    text = tokenizer.decode(ids)
    ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]  # re-encoding can merge or split
    return tokenizer.decode(ids)


def sharegpt_prompts(args, tokenizer, rng: random.Random) -> list[Prompt]:
    """First human turn and the first reply's length of ShareGPT-style conversations."""
    conversations = json.loads(Path(args.dataset_path).read_text())
    rng.shuffle(conversations)
    prompts = []
    for conversation in conversations:
        turns = conversation.get("conversations") or conversation.get("conversation") or []
        if len(turns) < 2:
            continue
        text, reply = turns[0]["value"], turns[1]["value"]
        count = (lambda s: len(tokenizer.encode(s))) if tokenizer else (lambda s: len(s.split()))
        prompts.append(Prompt(text, count(text), max(1, count(reply))))
        if len(prompts) == args.num_prompts:
            break
    return prompts


# ---- requests ----

@attrs.define
class RequestResult:
    success: bool = False
    error: str = ""
    input_len: int = 0  # the server's usage.prompt_tokens
    output_len: int = 0  # the server's usage.completion_tokens
    ttft: float = 0.0
    itls: list[float] = attrs.field(factory=list)
    latency: float = 0.0
    start: float = 0.0


def request_body(args, model: str, prompt: Prompt) -> dict:
    body = {"model": model, "max_tokens": prompt.output_len, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    return body


def carries_tokens(event: dict) -> bool:
    """Whether a chunk is the server's answer to a step: any chunk with choices, as ``vllm bench
    serve`` times them, text or not (a token that ends no character, or text held back for a
    stop string, still comes as a chunk on time), except a chat stream's opening role
    announcement, which a server may send before it has computed anything."""
    return any(set(c.get("delta") or ()) != {"role", "content"} or c["delta"]["content"]
               for c in event.get("choices") or ())


async def send(http: httpx.AsyncClient, args, model: str, prompt: Prompt) -> RequestResult:
    result = RequestResult(start=time.perf_counter())
    last = result.start
    try:
        async with http.stream("POST", args.endpoint, json=request_body(args, model, prompt)) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300].decode(errors='replace')}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in event:
                    result.error = str(event["error"].get("message"))
                    return result
                if event.get("usage"):
                    result.input_len = event["usage"]["prompt_tokens"]
                    result.output_len = event["usage"]["completion_tokens"]
                if carries_tokens(event):
                    if result.ttft == 0.0:
                        result.ttft = now - result.start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.latency = time.perf_counter() - result.start
        result.success = result.output_len > 0
        result.error = "" if result.success else "no usage in the stream"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def arrivals(rate: float, burstiness: float, count: int, rng: random.Random):
    """Yield ``count`` times, spaced as a gamma process of ``rate`` per second (Poisson at
    burstiness 1); all at once for an infinite rate."""
    for _ in range(count):
        yield
        if rate != math.inf:
            await trio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))


async def run_benchmark(args, model: str, prompts: list[Prompt], concurrency: int | None) -> tuple[list, float]:
    results: list[RequestResult] = [None] * len(prompts)  # type: ignore[list-item]
    slots = trio.Semaphore(concurrency or len(prompts))
    progress = _progress(len(prompts), args.disable_tqdm)
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=(concurrency or len(prompts)) + 4)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=httpx.Timeout(None, connect=30), limits=limits,
                                 headers=_auth_headers(args)) as http:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            index = 0
            async for _ in arrivals(args.request_rate, args.burstiness, len(prompts), rng):
                await slots.acquire()

                async def one(i=index):
                    try:
                        results[i] = await send(http, args, model, prompts[i])
                    finally:
                        slots.release()
                        progress.update(1)

                nursery.start_soon(one)
                index += 1
        duration = time.perf_counter() - start
    progress.close()
    return results, duration


def _auth_headers(args) -> dict[str, str]:
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _progress(total: int, disabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=disabled, file=sys.stderr)


# ---- metrics ----

def calculate_metrics(results: Sequence[RequestResult], duration: float, percentiles: list[float],
                      selected: Sequence[str]) -> dict:
    done = [r for r in results if r.success]
    total_in, total_out = sum(r.input_len for r in done), sum(r.output_len for r in done)
    values = {"ttft": [r.ttft for r in done],
              "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1],
              "itl": [gap for r in done for gap in r.itls],
              "e2el": [r.latency for r in done]}
    metrics = {"duration": duration, "completed": len(done), "failed": len(results) - len(done),
               "total_input_tokens": total_in, "total_output_tokens": total_out,
               "request_throughput": len(done) / duration, "output_throughput": total_out / duration,
               "total_token_throughput": (total_in + total_out) / duration,
               "input_lens": [r.input_len for r in results], "output_lens": [r.output_len for r in results],
               "ttfts": values["ttft"], "itls": [r.itls for r in results],
               "errors": [r.error for r in results]}
    for name in selected:
        metrics.update(summary(name, values[name], percentiles))
    return metrics


def summary(name: str, seconds: list[float], percentiles: list[float]) -> dict:
    ms = sorted(v * 1e3 for v in seconds)
    out = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
           f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
           f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = percentile(ms, p)
    return out


def percentile(ordered: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not ordered:
        return 0.0
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def print_table(metrics: dict, args, concurrency: int | None, selected: Sequence[str], percentiles: list[float]) -> None:
    rows = [("Successful requests:", metrics["completed"]), ("Failed requests:", metrics["failed"]),
            ("Maximum request concurrency:", concurrency),
            ("Benchmark duration (s):", f"{metrics['duration']:.2f}"),
            ("Total input tokens:", metrics["total_input_tokens"]),
            ("Total generated tokens:", metrics["total_output_tokens"]),
            ("Request throughput (req/s):", f"{metrics['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{metrics['output_throughput']:.2f}"),
            ("Total Token throughput (tok/s):", f"{metrics['total_token_throughput']:.2f}")]
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    for label, value in rows:
        print(f"{label:<40}{value!s:<10}")
    for name in selected:
        print("{s:{c}^{n}}".format(s=METRIC_TITLES[name], n=50, c="-"))
        upper = name.upper()
        print(f"{'Mean ' + upper + ' (ms):':<40}{metrics[f'mean_{name}_ms']:<10.2f}")
        print(f"{'Median ' + upper + ' (ms):':<40}{metrics[f'median_{name}_ms']:<10.2f}")
        for p in percentiles:
            print(f"{f'P{p:g} {upper} (ms):':<40}{metrics[f'p{p:g}_{name}_ms']:<10.2f}")
    print("=" * 50)


# ---- sweep and plot ----

def sweep_line(concurrency: int, m: dict) -> str:
    success = m["completed"] / max(1, m["completed"] + m["failed"])
    return (f"{concurrency:>11}  {success:>7.1%}  {m['output_throughput']:>10.1f}  {m['median_tpot_ms']:>9.1f}  "
            f"{m['p99_tpot_ms']:>8.1f}  {m['median_itl_ms']:>8.1f}  {m['p99_itl_ms']:>7.1f}  {m['p99_ttft_ms']:>8.1f}")


def capacity(levels: list[dict], tpot_bound_ms: float | None) -> int | None:
    """The highest concurrency with (almost) every request answered and p99 TPOT within the bound."""
    good = [lv["max_concurrency"] for lv in levels
            if lv["failed"] <= 0.001 * (lv["completed"] + lv["failed"])
            and (tpot_bound_ms is None or lv["p99_tpot_ms"] <= tpot_bound_ms)]
    return max(good) if good else None


def plot(path: str, sweeps: dict[str, list[dict]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, levels in sweeps.items():
        xs = [lv["max_concurrency"] for lv in levels]
        left.plot(xs, [lv["output_throughput"] for lv in levels], marker="o", label=label)
        right.plot(xs, [lv["median_tpot_ms"] for lv in levels], marker="o", label=f"{label} p50")
        right.plot(xs, [lv["p99_tpot_ms"] for lv in levels], marker="x", linestyle="--", label=f"{label} p99")
    left.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput", xscale="log", xticks=xs)
    right.set(xlabel="concurrency", ylabel="ms", title="time per output token", xscale="log", xticks=xs)
    for axis in (left, right):
        axis.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


# ---- entry point ----

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--tokenizer", default=None, help="for random prompts (default: the default model's)")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    p.add_argument("--dataset-name", default="random", choices=("random", "sharegpt"))
    p.add_argument("--dataset-path", default=None, help="a ShareGPT-style JSON file (for --dataset-name sharegpt)")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl", help=f"comma-separated, of {','.join(METRICS)}")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--sweep", default=None, help="comma-separated concurrencies to run one after another")
    p.add_argument("--tpot-bound-ms", type=float, default=None, help="the sweep's TPOT bound (on p99)")
    p.add_argument("--plot", default=None, help="draw the sweep (or --plot-results) to this PNG")
    p.add_argument("--plot-results", nargs="*", default=None, help="saved sweep results to draw side by side")
    return p.parse_args(argv)


def first_model(args) -> str:
    response = httpx.get(args.base_url + "/v1/models", headers=_auth_headers(args), timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.plot and args.plot_results:
        plot(args.plot, {Path(f).stem: json.loads(Path(f).read_text())["levels"] for f in args.plot_results})
        return {}
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    selected = [m for m in args.percentile_metrics.split(",") if m]
    if args.sweep:  # the sweep's table needs these whatever was selected
        selected = list(dict.fromkeys([*selected, "ttft", "tpot", "itl"]))
        percentiles = sorted({*percentiles, 99.0})
    model = args.model or first_model(args)
    tokenizer = load_tokenizer(args.tokenizer)
    rng = random.Random(args.seed)
    prompts = sharegpt_prompts(args, tokenizer, rng) if args.dataset_name == "sharegpt" else \
        random_prompts(args, tokenizer, rng)
    levels = [int(c) for c in args.sweep.split(",")] if args.sweep else [args.max_concurrency]
    runs = []
    for concurrency in levels:
        results, duration = trio.run(run_benchmark, args, model, prompts, concurrency)
        metrics = calculate_metrics(results, duration, percentiles, selected)
        metrics.update(max_concurrency=concurrency, model_id=model, num_prompts=len(prompts),
                       request_rate=args.request_rate, burstiness=args.burstiness,
                       endpoint=args.endpoint, date=time.strftime("%Y%m%d-%H%M%S"))
        if not args.sweep:
            print_table(metrics, args, concurrency, selected, percentiles)
        runs.append(metrics)
    result = runs[0] if not args.sweep else report_sweep(args, runs)
    if args.save_result:
        name = args.result_filename or f"serve-{model.replace('/', '_')}-{result.get('date', 'sweep')}.json"
        Path(name).write_text(json.dumps(result, indent=1, default=str))
    return result


def report_sweep(args, runs: list[dict]) -> dict:
    print(f"{'concurrency':>11}  {'success':>7}  {'out tok/s':>10}  {'TPOT p50':>9}  {'TPOT p99':>8}  "
          f"{'ITL p50':>8}  {'ITL p99':>7}  {'TTFT p99':>8}   (ms)")
    levels = [{k: v for k, v in run.items() if not isinstance(v, list)} for run in runs]
    for level in levels:
        print(sweep_line(level["max_concurrency"], level))
    best = capacity(levels, args.tpot_bound_ms)
    bound = f"p99 TPOT <= {args.tpot_bound_ms:g} ms" if args.tpot_bound_ms else "no TPOT bound"
    print(f"capacity: concurrency {best} ({bound}, ~100% success)" if best else f"capacity: none met ({bound})")
    if args.plot:
        plot(args.plot, {"this run": levels})
    return {"levels": levels, "capacity": best, "tpot_bound_ms": args.tpot_bound_ms}


if __name__ == "__main__":
    main()
