"""Turning engine outputs into OpenAI responses: chat and text completions, streaming and not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import trio

from api.metrics import Metrics, RequestTimer
from engine.errors import first_leaf
from engine.outputs import PositionLogprobs, RequestOutput


def sse(data: Any) -> bytes:
    """One server-sent event frame."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(positions: list[PositionLogprobs], token_ids: list[int], top: int) -> dict:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}``."""
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position[token_id]
        alternatives = sorted((lp for lp in position.values()), key=lambda lp: lp.rank)[:top]
        content.append({
            "token": chosen.decoded_token, "logprob": max(chosen.logprob, -9999.0),
            "bytes": _token_bytes(chosen.decoded_token or ""),
            "top_logprobs": [{"token": lp.decoded_token, "logprob": max(lp.logprob, -9999.0),
                              "bytes": _token_bytes(lp.decoded_token or "")} for lp in alternatives],
        })
    return {"content": content, "refusal": None}


def completion_logprobs(positions: list[PositionLogprobs], token_ids: list[int], top: int, offset: int) -> dict:
    """The legacy completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, position in zip(token_ids, positions):
        chosen = position[token_id]
        tokens.append(chosen.decoded_token)
        token_logprobs.append(chosen.logprob)
        best = sorted(position.items(), key=lambda kv: kv[1].rank)[:top]
        top_logprobs.append({lp.decoded_token: lp.logprob for _, lp in best})
        text_offset.append(offset)
        offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


class ChunkWriter:
    """Frames the streamed chunks of one response; with include_usage every chunk carries a
    ``usage`` key (null, or the running counts under continuous_usage_stats)."""

    def __init__(self, request_id: str, kind: str, model: str, options, tracker: OutputTracker) -> None:
        self.head = {"id": request_id, "object": kind, "created": int(time.time()), "model": model}
        self.include_usage = bool(options and options.include_usage)
        self.continuous = self.include_usage and options.continuous_usage_stats
        self.tracker = tracker

    def __call__(self, choices: list[dict], usage: dict | None = None) -> bytes:
        data = {**self.head, "choices": choices}
        if self.include_usage:
            data["usage"] = usage if usage is not None else (self.tracker.usage() if self.continuous else None)
        return sse(data)


class OutputTracker:
    """Per-request bookkeeping shared by both endpoints: usage counts and metrics timings."""

    def __init__(self, metrics: Metrics, num_prompt_tokens: int) -> None:
        self.metrics = metrics
        self.timer = RequestTimer(time.monotonic())
        self.num_prompt_tokens = num_prompt_tokens
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reasons: list[str] = []

    def observe(self, output: RequestOutput) -> None:
        new_tokens = sum(len(c.token_ids) for c in output.outputs)
        self.num_completion_tokens += new_tokens
        self.timer.on_tokens(time.monotonic(), new_tokens)
        self.num_cached_tokens = output.num_cached_tokens
        if output.first_scheduled_at is not None and self.timer.first_scheduled is None:
            self.timer.first_scheduled = output.first_scheduled_at
        self.finish_reasons += [c.finish_reason for c in output.outputs if c.finish_reason]

    def done(self) -> None:
        self.metrics.observe_request(self.timer, self.finish_reasons)

    def usage(self) -> dict:
        return usage(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests (one per prompt) as they come: ``(prompt index, output)``."""
    send, receive = trio.open_memory_channel(0)

    async def pump(index: int, stream: AsyncIterator[RequestOutput], out: trio.MemorySendChannel) -> None:
        async with out:
            async for output in stream:
                await out.send((index, output))

    try:
        async with trio.open_nursery() as nursery:
            async with send:
                for i, stream in enumerate(streams):
                    nursery.start_soon(pump, i, stream, send.clone())
            async with receive:
                async for item in receive:
                    yield item
    except BaseExceptionGroup as group:  # a failing request: raise its error, not the nursery's group
        leaf = first_leaf(group)
        if isinstance(leaf, Exception):
            raise leaf from None
        raise

