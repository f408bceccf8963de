"""The chat page at ``/`` (static files shipped in the package, served from memory) and the
counters its engine panel polls (``/v1/engine/stats``: numbers only, never a request's text)."""

from __future__ import annotations

import time
from collections import deque
from importlib import resources

import attrs

from engine.messages import EngineStats

# The page's files, by the name they are served under /static/ (index.html is served at /).
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8"}


@attrs.frozen
class StaticFile:
    body: bytes
    content_type: str


def load_static() -> dict[str, StaticFile]:
    """Every file of the page (read once, at start)."""
    folder = resources.files("api") / "static"
    files = {}
    for entry in folder.iterdir():
        suffix = entry.name[entry.name.rfind("."):]
        if suffix in _TYPES:
            files[entry.name] = StaticFile(entry.read_bytes(), _TYPES[suffix])
    return files


class Throughput:
    """Tokens per second over the last few seconds, from the engine's running counters
    (sampled when asked, so an idle page costs nothing between polls)."""

    def __init__(self, window: float = 5.0, clock=time.monotonic) -> None:
        self.window = window
        self._clock = clock
        self._samples: deque[tuple[float, int, int]] = deque(maxlen=4096)  # (time, prompt tokens, generation tokens)

    def observe(self, stats: list[EngineStats]) -> tuple[float, float]:
        """(prompt, generation) tokens per second since the oldest sample within the window."""
        now = self._clock()
        prompt, generation = sum(s.num_prompt_tokens for s in stats), sum(s.num_generation_tokens for s in stats)
        samples = self._samples
        samples.append((now, prompt, generation))
        while len(samples) > 1 and samples[1][0] <= now - self.window:
            samples.popleft()  # (the oldest kept is the last one older than the window)
        then, prompt_then, generation_then = samples[0]
        span = now - then
        if span <= 0:
            return 0.0, 0.0
        return (prompt - prompt_then) / span, (generation - generation_then) / span


def engine_stats_json(model: str, stats: list[EngineStats], throughput: Throughput,
                      max_model_len: int | None) -> dict:
    """The engine panel's numbers, summed over the engines (names as vLLM's metrics)."""
    used, total = sum(s.kv_blocks_used for s in stats), sum(s.kv_blocks_total for s in stats)
    prompt_rate, generation_rate = throughput.observe(stats)
    return {
        "object": "engine.stats", "model": model, "max_model_len": max_model_len,
        "num_requests_running": sum(s.num_running for s in stats),
        "num_requests_waiting": sum(s.num_waiting for s in stats),
        "kv_cache_usage": used / total if total else 0.0, "kv_blocks_used": used, "kv_blocks_total": total,
        "num_preemptions": sum(s.num_preemptions for s in stats),
        "prompt_tokens_per_second": prompt_rate, "generation_tokens_per_second": generation_rate,
    }
