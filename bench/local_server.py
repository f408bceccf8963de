"""Start ``python -m engine.api`` on a free loopback port for a benchmark, and wait until it is healthy."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def start_server(flags: list[str], timeout_s: float = 300) -> tuple[subprocess.Popen, str]:
    """(the server process, its base URL). The caller stops it (SIGTERM) when done."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "engine.api", "--port", str(port), "--log-level", "warning", *flags],
                            cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit("the server exited during start-up")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become healthy")
