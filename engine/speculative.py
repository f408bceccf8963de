"""Speculative decoding: what ``--speculative-config`` says, and the n-gram proposer.

A decoding request may carry a few proposed next tokens (drafts) into a step: the model
computes its last known token and the drafts in one pass, and the runner samples each
position in turn exactly as it would have without speculation (every sampling parameter, the
request's own seeded draws), keeping drafts while they equal what it samples. The first
position where they differ gives the sampled token instead, and when all are kept the last
position gives one more. So the output is what the model samples, whatever was proposed: for
a proposal of one token per position (an n-gram's), comparing a draw from the target's
distribution with the draft is the rejection rule of Leviathan et al. with a one-hot draft
distribution (keep x with probability p(x), else draw from p without x), in one step.

``draft_model`` proposals come from a smaller model of the same vocabulary, run by the same
engine beside the target (engine/runner/drafter.py): it computes the tokens the target
computes, into a KV cache of its own over the target's block tables, and after each step
proposes its greedy continuation of each request (a one-hot draft distribution again).

Proposals cost a longer forward pass; on a CPU a decode step is bound by reading the weights
until the batch is large, so at a few streams the extra tokens are nearly free, and under
load they are not: proposals stop while more than ``disable_by_batch_size`` requests run
(vLLM's key), and a draft model then runs no pass at all (it catches up on what it missed
when proposals resume).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from engine.errors import ConfigError

METHODS = ("ngram", "draft_model")
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
# Proposals stop while more requests than this run (a step then costs about its tokens here).
# Measured on AMD EPYC Zen 3 (AVX2; bench/spec_decode.py --force --kv-cache-dtype float16, 8
# rounds, every prompt N at a time), proposals / none, mean: 2 streams edit 1.19x, chat 1.01x;
# 3 streams 1.10x / 1.00x; 4 streams 1.04x / 0.93x (chat lost 7% where edits gained 4%).
DEFAULT_DISABLE_BY_BATCH_SIZE = 3


def _error(message: str) -> ConfigError:
    return ConfigError("speculative_config", f"speculative_config: {message}")


def _at_least_one(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _error(f"{attribute.name} must be an integer of at least 1, got {value!r}")


@attrs.frozen
class SpeculativeConfig:
    """``--speculative-config`` (vLLM's keys).

    Attributes:
        method: ``ngram``: prompt lookup, proposing what followed the latest earlier place
            where the request's last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens
            (prompt and output) occur. ``draft_model``: the greedy continuation of ``model``.
        model: the draft model (``draft_model``): a .gguf file or a Hugging Face directory of a
            smaller model with the target's vocabulary.
        num_speculative_tokens: most drafts a request carries into a step.
        prompt_lookup_min, prompt_lookup_max: the shortest and longest n-gram matched (one
            given alone sets the other, as in vLLM; neither: 3 and 5).
        disable_by_batch_size: no proposals while more than this many requests run (None:
            proposals at any batch size).
    """

    method: str
    num_speculative_tokens: int = attrs.field(validator=_at_least_one)
    # Measured (bench/spec_decode.py, AMD EPYC family 23): 2..4 lost 9% on chat at 4 streams
    # (short coincidental matches proposing tokens that are rejected), 3..5 broke even there
    # and kept the gain on edits (1.40x vs 1.42x at one stream).
    prompt_lookup_min: int = attrs.field(default=3, validator=_at_least_one)
    prompt_lookup_max: int = attrs.field(default=5, validator=_at_least_one)
    disable_by_batch_size: int | None = attrs.field(default=DEFAULT_DISABLE_BY_BATCH_SIZE,
                                                    validator=attrs.validators.optional(_at_least_one))
    model: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise _error(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                                                    f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def from_json(cls, value: str | dict | None) -> SpeculativeConfig | None:
        """Parse ``--speculative-config`` (JSON text or a dict); None when not given.

        Raises:
            ConfigError: not a JSON object, an unknown key or method, or a bad value.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        fields = _object(value)
        method = fields.get("method")
        if method is None and "model" in fields:  # (as vLLM: a draft model names its method)
            method = "draft_model"
            fields = {**fields, "method": method}
        if method not in METHODS:
            raise _error(f"unknown speculative method {method!r}; known: "
                                                    f"{', '.join(METHODS)}")
        known = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise _error(f"unknown key(s) {', '.join(unknown)}; known: "
                                                    f"{', '.join(sorted(known))}")
        if "num_speculative_tokens" not in fields:
            raise _error("num_speculative_tokens is required")
        if method == "draft_model":
            if not isinstance(fields.get("model"), str) or not fields["model"]:
                raise _error("method 'draft_model' needs 'model': the draft model's .gguf file or directory")
            if not Path(fields["model"]).expanduser().exists():
                raise _error(f"draft model {fields['model']!r} not found (this server does not download from a hub)")
            given = sorted(set(_NGRAM_KEYS) & set(fields))
            if given:
                raise _error(f"{', '.join(given)} belong(s) to method 'ngram', not 'draft_model'")
        elif "model" in fields:
            raise _error("'model' belongs to method 'draft_model'")
        if ("prompt_lookup_min" in fields) != ("prompt_lookup_max" in fields):
            given = fields.get("prompt_lookup_min", fields.get("prompt_lookup_max"))
            fields = {**fields, "prompt_lookup_min": given, "prompt_lookup_max": given}
        return cls(**fields)


def _object(value: str | dict) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise _error(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise _error("must be a JSON object, e.g. "
                                                '{"method": "ngram", "num_speculative_tokens": 4}')
    return value


class NgramIndex:
    """Where each n-gram of a growing token list starts, for prompt lookup: kept up to date as
    tokens are appended (each new token adds one start per n), so that a step's lookup is a few
    dict reads instead of a scan of the whole prompt and output (a scan with numpy took 0.2-0.35
    ms a step at 300-2,000 tokens on AMD EPYC Zen 3: 2-4% of a one-stream decode step, per
    decoding request).

    One per request (``Request.ngram_index``, made at its first lookup: ~2 ms for 2,000 tokens,
    ~0.6 KB a token for lookup 3..5, kept while the request runs): ``token_ids`` is its prompt +
    output, which only grows between calls (a shorter list is indexed again from the start; a
    list changed in place is not seen)."""

    __slots__ = ("min_n", "max_n", "_starts", "_size")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its starts, in order
        self._size = 0  # the list's length when last indexed

    def drafts(self, token_ids: Sequence[int], num_drafts: int) -> list[int]:
        """Up to ``num_drafts`` tokens that followed an earlier occurrence of the longest suffix of
        ``token_ids`` of ``max_n`` .. ``min_n`` tokens that occurs before; [] if none. The
        occurrence is the latest with ``num_drafts`` tokens after it, or else the first (in a
        repeating text the latest may be too near the end to say much)."""
        size = len(token_ids)
        if size < self._size:  # (not a request's list: indexed again from its start)
            self._starts.clear()
            self._size = 0
        if num_drafts < 1 or size <= self.min_n:
            return []
        self._index(token_ids, size)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            starts = self._starts.get(tuple(token_ids[size - n:]))
            if starts:
                roomy = bisect.bisect_right(starts, size - n - num_drafts)  # (starts with room: before it)
                start = (starts[roomy - 1] if roomy else starts[0]) + n
                return list(token_ids[start:start + num_drafts])
        return []

    def _index(self, token_ids: Sequence[int], size: int) -> None:
        """Add the n-grams that now have a token after them (an n-gram is a place to copy from
        only then): those starting at ``size - n - 1`` and before, not yet in."""
        starts = self._starts
        for n in range(self.min_n, self.max_n + 1):
            first, last = max(0, self._size - n), size - n - 1
            if last < first:
                continue
            grams = zip(*(token_ids[first + j:last + 1 + j] for j in range(n)))
            for at, gram in enumerate(grams, first):
                places = starts.get(gram)
                if places is None:
                    starts[gram] = [at]
                else:
                    places.append(at)
        self._size = size
