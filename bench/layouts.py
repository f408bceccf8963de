"""The server's process layouts against each other: one process, the engine core in a process
of its own (``--engine-process``), and two HTTP fronts over it (``--api-server-count 2``),
under the same serving workloads, in one run.

For each layout and workload it starts ``python -m engine.api``, runs ``bench/serve.py``
(the ``vllm bench serve`` clone) against it, and reads each server process's CPU time from
/proc: the fronts' share (every process but the engine's; with one process, all of it) is
what HTTP, tokenization and detokenization cost, the work that the split moves off the
engine's GIL. Layouts alternate (A B A B) so that drift in a shared
machine's speed lands on both.

    python bench/layouts.py                      # short chats, then long prompts
    python bench/layouts.py --rounds 1 --num-prompts 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from local_server import ROOT, start_server

LAYOUTS = {"one process": [], "engine process": ["--engine-process"], "2 API servers": ["--api-server-count", "2"]}
# (name, bench/serve.py arguments): many short chat requests, then long prompts
WORKLOADS = {
    "short chats": ["--endpoint", "/v1/chat/completions", "--random-input-len", "32", "--random-output-len", "32",
                    "--max-concurrency", "32"],
    "long prompts": ["--endpoint", "/v1/completions", "--random-input-len", "1024", "--random-output-len", "64",
                     "--max-concurrency", "8"],
}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def is_engine(pid: int) -> bool:
    return b"engine.transport.engine_process" in Path(f"/proc/{pid}/cmdline").read_bytes()


def children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return found


def run_workload(url: str, workload: list[str], num_prompts: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--base-url", url,
                        "--num-prompts", str(num_prompts), "--ignore-eos", "--disable-tqdm", "--save-result",
                        "--result-filename", str(out), "--percentile-metrics", "ttft,tpot,itl", *workload],
                       check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="A B rounds per workload (the best of each is kept)")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--server-flags", default="", help="more flags for every server, e.g. '--backend cpu'")
    args = parser.parse_args()
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    rows = []
    for workload_name, workload in WORKLOADS.items():
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for layout, flags in LAYOUTS.items():
                proc, url = start_server([*flags, *args.server_flags.split()])
                try:
                    run_workload(url, workload, 8)  # warm-up: compile paths, fill caches
                    pids = [proc.pid, *children(proc.pid)]
                    engines = [is_engine(p) for p in pids]
                    before = [cpu_seconds(p) for p in pids]
                    result = run_workload(url, workload, args.num_prompts)
                    used = [cpu_seconds(p) - b for p, b in zip(pids, before)]
                finally:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=60)
                result["front_cpu_s"] = sum(u for u, engine in zip(used, engines) if not engine)
                result["engine_cpu_s"] = sum(u for u, engine in zip(used, engines) if engine)
                if layout not in best or result["output_throughput"] > best[layout]["output_throughput"]:
                    best[layout] = result
        for layout, r in best.items():
            rows.append((workload_name, layout, r))
    header = (f"{'workload':<13} {'layout':<15} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
              f"{'TPOT p99':>9} {'front CPU s':>11} {'engine CPU s':>12}")
    print(header)
    for workload_name, layout, r in rows:
        print(f"{workload_name:<13} {layout:<15} {r['output_throughput']:>9.1f} {r['median_ttft_ms']:>9.1f} "
              f"{r['p99_ttft_ms']:>9.1f} {r['median_tpot_ms']:>9.1f} {r['p99_tpot_ms']:>9.1f} "
              f"{r['front_cpu_s']:>11.1f} {r['engine_cpu_s']:>12.1f}")


if __name__ == "__main__":
    main()
