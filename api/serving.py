"""Turning engine outputs into OpenAI responses: chat and text completions, streaming and not."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import orjson

from engine.outputs import PositionLogprobs, RequestOutput
from engine.reasoning import Opening, ReasoningParser, count_reasoning_tokens
from engine.tools import ParsedDelta, ToolCallParser


def sse(data: Any) -> bytes:
    """One server-sent event frame."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int | None = None) -> dict:
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


# OpenAI's schema has numbers only; a token a constraint masked has logprob -inf (JSON's null
# through orjson). vLLM writes such values as -9999.0 in every logprobs field; so do we.
MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _token(token_id: int, text: str | None, as_ids: bool) -> str | None:
    """A token as a logprobs entry names it: its text, or vLLM's ``token_id:N`` (which tells
    apart tokens of the same text, and tokens that are not whole characters)."""
    return f"token_id:{token_id}" if as_ids else text


def chat_logprobs(positions: list[PositionLogprobs], token_ids: list[int], top: int, as_ids: bool = False,
                  vocab_bytes: Sequence[bytes] = ()) -> dict:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}``
    (``as_ids``: tokens named ``token_id:N``). Each ``bytes`` is the token's own from
    ``vocab_bytes`` (``engine.tokenizer.token_bytes``): OpenAI's "useful in instances where
    characters are represented by multiple tokens and their byte representations must be
    combined", where the token's text is a replacement character (vLLM gives that text's bytes)."""
    def bytes_of(token_id: int, text: str | None) -> list[int]:
        if 0 <= token_id < len(vocab_bytes):
            return list(vocab_bytes[token_id])
        return _token_bytes(text or "")

    content = []
    for token_id, position in zip(token_ids, positions):
        text = position[token_id].decoded_token
        alternatives = sorted(position.items(), key=lambda item: item[1].rank)[:top]
        content.append({
            "token": _token(token_id, text, as_ids), "logprob": _logprob(position[token_id].logprob),
            "bytes": bytes_of(token_id, text),
            "top_logprobs": [{"token": _token(t, lp.decoded_token, as_ids), "logprob": _logprob(lp.logprob),
                              "bytes": bytes_of(t, lp.decoded_token)} for t, lp in alternatives],
        })
    return {"content": content, "refusal": None}


def completion_logprobs(positions: list[PositionLogprobs | None], token_ids: list[int], top: int, offset: int,
                        decode=None, as_ids: bool = False) -> dict:
    """The legacy completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset.
    Each ``top_logprobs`` entry holds the ``top`` most likely tokens and the sampled one (OpenAI:
    "up to logprobs+1 elements"; with ``top`` 0 the sampled one alone). A None position (a
    prompt's first token, echoed) has its text (by ``decode``) and null logprobs. ``as_ids``:
    tokens named ``token_id:N`` (offsets still count the text)."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, position in zip(token_ids, positions):
        if position is None:
            text = decode([token_id])
            tokens.append(_token(token_id, text, as_ids))
            token_logprobs.append(None)
            top_logprobs.append(None)
            text_offset.append(offset)
            offset += len(text)
            continue
        chosen = position[token_id]
        tokens.append(_token(token_id, chosen.decoded_token, as_ids))
        token_logprobs.append(_logprob(chosen.logprob))
        best = sorted(position.items(), key=lambda item: item[1].rank)[:top]  # (a position may hold more)
        shown = best if any(t == token_id for t, _ in best) else [*best, (token_id, chosen)]
        top_logprobs.append({_token(t, lp.decoded_token, as_ids): _logprob(lp.logprob) for t, lp in shown})
        text_offset.append(offset)
        offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def prompt_logprobs_json(positions: list[PositionLogprobs | None] | None) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt position None (the first) or
    ``{token id: {"logprob", "rank", "decoded_token"}}``."""
    if positions is None:
        return None
    return [None if p is None else {str(t): {"logprob": _logprob(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in p.items()}
            for p in positions]


class ChunkWriter:
    """Frames the streamed chunks of one response; with include_usage every chunk carries a
    ``usage`` key (null, or the running counts under continuous_usage_stats)."""

    def __init__(self, request_id: str, kind: str, model: str, options, tracker: UsageTracker) -> None:
        self.head = {"id": request_id, "object": kind, "created": int(time.time()), "model": model}
        self.include_usage = bool(options and options.include_usage)
        self.continuous = self.include_usage and options.continuous_usage_stats
        self.tracker = tracker

    def __call__(self, choices: list[dict], usage: dict | None = None, **fields: Any) -> bytes:
        data = {**self.head, **fields, "choices": choices}
        if self.include_usage:
            data["usage"] = usage if usage is not None else (self.tracker.usage() if self.continuous else None)
        return sse(data)


class UsageTracker:
    """Token counts of one response, over all its prompts and completions (``usage``)."""

    def __init__(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_completion_tokens = 0
        self.num_reasoning_tokens: int | None = None  # counted where a reasoning parser is on
        self._cached_tokens: dict[int, int] = {}  # per prompt

    def observe(self, output: RequestOutput, prompt_index: int = 0) -> None:
        """Count a new output (a delta, or a request's one final output)."""
        self.num_completion_tokens += sum(len(c.token_ids) for c in output.outputs)
        self._cached_tokens[prompt_index] = output.num_cached_tokens

    def usage(self) -> dict:
        return usage(self.num_prompt_tokens, self.num_completion_tokens, sum(self._cached_tokens.values()),
                     self.num_reasoning_tokens)

    def count_reasoning(self, choices: list[OutputSplitter]) -> None:
        """Count the reasoning tokens of finished choices (a no-op without a reasoning parser)."""
        counts = [c.reasoning_tokens() for c in choices]
        if any(n is not None for n in counts):
            self.num_reasoning_tokens = sum(n or 0 for n in counts)


@attrs.frozen
class ReasoningPlan:
    """A request's reasoning: its model's parser, where its output begins, and how to count
    reasoning tokens (``decode``: token ids to text, as the output's text was made)."""

    parser: ReasoningParser
    opening: Opening
    decode: Callable[[list[int]], str]


@attrs.frozen
class SplitDelta:
    """New output of a choice: reasoning, then the answer as content and calls, and the
    answer's ``pieces`` (content text and ``CallDelta`` values) in the order written."""

    reasoning: str = ""
    content: str = ""
    calls: tuple = ()  # CallDelta values of the tool-call parser
    pieces: tuple = ()


class OutputSplitter:
    """One choice's output split, as it streams, into reasoning (with a reasoning parser), then
    content and tool calls (when tools may be called): whatever reasoning ends in, a tool
    call included, the answer's parser sees only the answer. Fed the whole output at once it
    gives what the deltas add up to."""

    def __init__(self, reasoning: ReasoningPlan | None, tools: bool, calls_only: bool = False) -> None:
        self.reasoning = reasoning
        self._splitter = reasoning.parser.splitter(reasoning.opening) if reasoning is not None else None
        self.tools = ToolCallParser(calls_only) if tools else None
        self._token_ids: list[int] = []
        # Where each fed piece began, as (tokens, characters) of the output before it.
        self._starts: list[tuple[int, int]] = []
        self._num_chars = 0

    @property
    def has_reasoning(self) -> bool:
        return self._splitter is not None and self._splitter.has_reasoning

    def feed(self, text: str, token_ids=(), final: bool = False) -> SplitDelta:
        reasoning, content = "", text
        if self._splitter is not None:
            if not self._splitter.closed:  # (until the reasoning is closed: for counting its tokens)
                self._starts.append((len(self._token_ids), self._num_chars))
                self._token_ids.extend(token_ids)
                self._num_chars += len(text)
            split = self._splitter.feed(text, final)
            reasoning, content = split.reasoning, split.content
        if self.tools is None:
            return SplitDelta(reasoning, content, pieces=(content,) if content else ())
        parsed: ParsedDelta = self.tools.feed(content, final)
        return SplitDelta(reasoning, parsed.content, parsed.calls, parsed.pieces)

    def reasoning_tokens(self) -> int | None:
        """The output's tokens within its reasoning (None without a reasoning parser): those
        after an opening tag the output wrote, up to the closing tag (to the end when it was
        never closed)."""
        splitter = self._splitter
        if splitter is None:
            return None
        if not splitter.has_reasoning:
            return 0
        end = self._tokens_within(splitter.reasoning_end) if splitter.closed else len(self._token_ids)
        return end - self._tokens_within(splitter.reasoning_start)

    def _tokens_within(self, offset: int) -> int:
        """How many of the first tokens have their text end at or before ``offset`` characters,
        searched for in the piece the offset falls in."""
        if offset <= 0:
            return 0
        at = max(i for i, (_, chars) in enumerate(self._starts) if chars <= offset)
        first_token, first_char = self._starts[at]
        return first_token + count_reasoning_tokens(self.reasoning.decode, self._token_ids[first_token:],
                                                    offset - first_char)
