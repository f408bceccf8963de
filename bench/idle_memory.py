"""Resident memory of an idle server: `python -m engine.api` started with the given flags (none:
the defaults), measured once /health answers, with the start-up line that says what the KV
cache holds. Each `--kv-cache-dtype` given with --each is one server, one after the other.

    python bench/idle_memory.py [--each auto,float32,bfloat16,int8] [-- more server flags]
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def measure(flags: list[str]) -> tuple[int, str]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "engine.api", "--port", str(port), *flags], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(server.stdout.read())
                time.sleep(0.5)
        time.sleep(2)  # settled
        rss = rss_bytes(server.pid)
    finally:
        server.terminate()
        output, _ = server.communicate(timeout=60)
    return rss, output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--each", default="auto", help="comma-separated --kv-cache-dtype values")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    for kv in args.each.split(","):
        rss, log = measure(["--kv-cache-dtype", kv, *extra])
        ready = next((m.group(0) for m in re.finditer(r"KV cache .*per token\)", log)), "?")
        print(f"--kv-cache-dtype {kv:>9}: idle RSS {rss / 1e9:.2f} GB; {ready}")


if __name__ == "__main__":
    main()
