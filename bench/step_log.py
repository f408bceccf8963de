"""Where a serving run's inter-token latency tail comes from, step by step.

``serve`` runs ``python -m engine.api`` with each engine step's device work timed into a file
(one line a step: start, ms, decoding rows, prompt tokens, drafted tokens); run
``bench/serve.py`` against it, then ``report`` the file:

    python bench/step_log.py serve --out /tmp/steps.tsv -- --port 8000
    python bench/serve.py --base-url http://127.0.0.1:8000 --random-input-len 128 ... --request-rate 1.2
    python bench/step_log.py report /tmp/steps.tsv

The report splits the file into runs at idle gaps of over 5 s (``--idle-gap``; leave the server
idle that long between benchmark runs) and says, for each: the steps' cost by the number of
decoding streams, decode-only and with a prompt chunk; a least-squares fit of a step's ms to
(1, decoding rows, prompt tokens); and the gaps each decoding stream saw, as
``bench/serve.py`` counts ITL, p99 over median, four ways: as they ran (step end to step end: the
host's work between steps counts; the network, the client and a stream's first token do not, so
serve.py's ratio differs some), in the steps' device time alone, as they would be had every step
cost its fit (the shape of the load and the scheduler's choices alone), and as they would be with
no prompt token in any step (the number of streams alone). A device-time ratio far above the
fitted one lost steps to something else on the cores (the client, the HTTP side); a fitted one
far above the streams-alone one has its tail in the prompt chunks; a fitted one near the
streams-alone one, in the number of streams, which no prefill policy changes.

The server runs in this process from the tree this file is in (not an installed copy).
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
IDLE_GAP_S = 5.0
BANDS = ((1, 3), (3, 6), (6, 10), (10, 16), (16, 32), (32, 48), (48, 65), (65, 257))


def install(path: str) -> None:
    """Time every ``EngineCore.execute`` into ``path``."""
    from engine.core import engine_core

    out = open(path, "w", buffering=1)
    execute = engine_core.EngineCore.execute

    def timed(self, output):
        start = time.perf_counter()
        result = execute(self, output)
        ms = (time.perf_counter() - start) * 1e3
        # A row that samples one token past its drafts is a decode (a prompt's one-token last
        # chunk too: it costs one); every other token is a prompt token.
        drafts = output.plan.num_draft_tokens or (0,) * len(output.chunks)
        decodes = prompt = 0
        for chunk, k in zip(output.chunks, drafts):
            if chunk.samples and chunk.num_new_tokens - k == 1:
                decodes += 1
            else:
                prompt += chunk.num_new_tokens
        out.write(f"{start:.4f}\t{ms:.2f}\t{decodes}\t{prompt}\t{sum(drafts)}\n")
        return result

    engine_core.EngineCore.execute = timed


def runs(steps: np.ndarray, idle_gap_s: float = IDLE_GAP_S) -> list[np.ndarray]:
    """The file's steps cut into runs at idle gaps."""
    if len(steps) == 0:
        return []
    return np.split(steps, np.where(np.diff(steps[:, 0]) > idle_gap_s)[0] + 1)


def fit(ms: np.ndarray, decodes: np.ndarray, prompt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fixed, per decoding row, per prompt token) ms by least squares, and each step's ms by it."""
    x = np.column_stack([np.ones_like(ms), decodes, prompt])
    coef = np.linalg.lstsq(x, ms, rcond=None)[0]
    return coef, x @ coef


def _median(values: np.ndarray) -> float:
    return float(np.median(values)) if len(values) else float("nan")


def gap_ratio(ms: np.ndarray, decodes: np.ndarray) -> float:
    """p99 / median of the gaps the decoding streams saw: a step of D decoding rows is a gap of
    ``ms`` for each of them."""
    gaps = np.repeat(ms, decodes.astype(int))
    return float(np.percentile(gaps, 99) / np.median(gaps)) if len(gaps) else float("nan")


def step_to_step_ms(run: np.ndarray) -> np.ndarray:
    """Each step's end to the next one's (its own device time for the first): the device time and
    the host's work between steps (scheduling, outputs, the event loop), as a stream's tokens come."""
    ends = run[:, 0] * 1e3 + run[:, 1]
    return np.concatenate([run[:1, 1], np.diff(ends)])


def analyse(run: np.ndarray) -> dict:
    ms, decodes, prompt = run[:, 1], run[:, 2], run[:, 3]
    coef, fitted = fit(ms, decodes, prompt)
    weighted = np.repeat(decodes, decodes.astype(int))
    bands = []
    for lo, hi in BANDS:
        band = (decodes >= lo) & (decodes < hi)
        plain, mixed = band & (prompt == 0), band & (prompt > 0)
        if band.any():
            bands.append((lo, hi, int(plain.sum()), _median(ms[plain]), int(mixed.sum()), _median(ms[mixed]),
                          _median(prompt[mixed])))
    return {
        "steps": len(run), "seconds": float(run[-1, 0] - run[0, 0]),
        "with_prompt": float((prompt > 0).mean()), "fit": coef,
        "streams_p50_p99": tuple(np.percentile(weighted, [50, 99])) if len(weighted) else (float("nan"),) * 2,
        "ratio": gap_ratio(step_to_step_ms(run), decodes),
        "ratio_device": gap_ratio(ms, decodes),
        "ratio_fitted": gap_ratio(fitted, decodes),
        "ratio_streams_alone": gap_ratio(coef[0] + coef[1] * decodes, decodes),
        "bands": bands,
    }


def report(path: str, idle_gap_s: float = IDLE_GAP_S) -> None:
    steps = np.loadtxt(path, ndmin=2)
    for i, run in enumerate(runs(steps, idle_gap_s)):
        if len(run) < 20:
            print(f"run {i}: {len(run)} steps (too few to report)")
            continue
        a = analyse(run)
        fixed, per_decode, per_prompt = a["fit"]
        print(f"run {i}: {a['steps']} steps in {a['seconds']:.0f} s, {a['with_prompt']:.0%} with prompt tokens; "
              f"streams (token-weighted) p50 {a['streams_p50_p99'][0]:.0f}, p99 {a['streams_p50_p99'][1]:.0f}")
        print(f"  step ms = {fixed:.1f} + {per_decode:.2f} x decoding rows + {per_prompt:.2f} x prompt tokens")
        print(f"  ITL p99 / median: {a['ratio']:.2f}x as run (step end to step end), {a['ratio_device']:.2f}x in device "
              f"time, {a['ratio_fitted']:.2f}x at the fit, "
              f"{a['ratio_streams_alone']:.2f}x from the number of streams alone")
        print("  streams   decode-only ms (steps)   with a prompt chunk ms (steps, median tokens)")
        for lo, hi, n_plain, plain, n_mixed, mixed, tokens in a["bands"]:
            print(f"  {lo:3d}-{hi - 1:<3d}   {plain:8.1f} ({n_plain:5d})          {mixed:8.1f} ({n_mixed:5d}, {tokens:.0f})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the server with every step timed")
    serve.add_argument("--out", required=True)
    serve.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: python -m engine.api's flags")
    rep = sub.add_parser("report", help="where a step log's ITL tail comes from")
    rep.add_argument("path")
    rep.add_argument("--idle-gap", type=float, default=IDLE_GAP_S, help="seconds without a step that end a run")
    args = parser.parse_args(argv)
    if args.command == "report":
        report(args.path, args.idle_gap)
        return
    extra = args.server_args[1:] if args.server_args[:1] == ["--"] else args.server_args
    if any(a.split("=")[0] in ("--engine-process", "--data-parallel-size", "--api-server-count", "--headless")
           for a in extra):
        parser.error("the steps are timed in this process: serve with the engine in it (no --engine-process, "
                     "--data-parallel-size, --api-server-count or --headless)")
    sys.path.insert(0, str(ROOT))
    install(args.out)
    sys.argv = ["engine.api", *extra]
    runpy.run_module("engine.api", run_name="__main__")


if __name__ == "__main__":
    main()
