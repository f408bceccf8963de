"""The values between the engine core and the model runner: a step's plan and its result.

The scheduler decides a step; the core hands the runner a ``StepPlan``, made only of numbers,
strings, tuples and ``SamplingParams`` (the engine's own copies, and encodable by the wire codec), and gets back
a ``RunnerOutput``. The runner keeps its own state per request id, built from the plans it has
been given (``NewRequest`` the first time, then only what changed), as vLLM's workers do: it
never reads the scheduler's ``Request`` objects or the block manager. So a runner in another
process (a tensor-parallel rank) can be driven by the same value.
"""

from __future__ import annotations

import attrs

from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams


@attrs.frozen
class NewRequest:
    """A request the runner has no state for: scheduled for the first time, or again after a
    preemption (which dropped its state). What the runner keeps for it until it finishes."""

    request_id: str
    token_ids: tuple[int, ...]  # prompt + output so far (a resumed request has output)
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_id: int | None
    num_prompt_logprobs: int = 0  # prompt positions whose logprobs were already reported


@attrs.frozen
class StepPlan:
    """What one step computes. Row ``i`` computes ``num_new_tokens[i]`` tokens of request
    ``request_ids[i]`` from position ``starts[i]``; its input tokens are the next
    ``num_new_tokens[i]`` of ``token_ids`` (all rows' inputs, concatenated in row order).

    ``new_block_ids`` holds, for each request whose KV block table grew, the block ids appended
    since the runner last saw it (all of them for a new request); a table only grows while its
    request runs. A model with layer groups (engine/kv_groups.py) has a table per group, all
    growing alike: the ids are each group's new ones, group after group. ``finished_ids`` and ``preempted_ids`` name requests whose runner state is to
    be dropped, before the rows are read (a preempted request comes back as a ``NewRequest``).

    ``sample_rows`` are the rows whose last token is the last known one (their logits give the
    next token). ``grammar_rows`` are sampling rows whose next token is constrained: row ``j``
    of ``grammar_bitmask`` (little-endian int32 words, ``ceil(vocab / 32)`` per row, bit set =
    allowed) is the mask of ``grammar_rows[j]``.

    ``num_draft_tokens`` (empty when no row carries drafts) holds per row how many of its input
    tokens are proposed ones (speculative decoding, engine/speculative.py): such a row is a
    sampling row whose last known token is followed by that many drafts, and every one of its
    positions is sampled in turn while the drafts hold.
    ``num_proposals``: how many tokens a draft model (speculative method ``draft_model``) is to
    propose after each sampled token of this step, for the next (0: none; the draft model
    still computes the step's tokens, to keep its KV cache whole).
    """

    request_ids: tuple[str, ...]
    starts: tuple[int, ...]
    num_new_tokens: tuple[int, ...]
    token_ids: tuple[int, ...]
    sample_rows: tuple[int, ...]
    new_requests: tuple[NewRequest, ...] = ()
    new_block_ids: tuple[tuple[str, tuple[int, ...]], ...] = ()
    finished_ids: tuple[str, ...] = ()
    preempted_ids: tuple[str, ...] = ()
    grammar_rows: tuple[int, ...] = ()
    grammar_bitmask: bytes = b""
    num_draft_tokens: tuple[int, ...] = ()
    num_proposals: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    @property
    def num_batched_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_empty(self) -> bool:
        return not self.request_ids


@attrs.frozen
class RunnerOutput:
    """Per request id: the sampled token (only for sampling rows), its logprobs if asked, prompt
    logprobs computed in this step if asked, and the error of each request whose own part of
    the step failed (its other entries are to be ignored). ``accepted`` holds, for a row whose
    drafts were kept, those drafts (they come before its sampled token), and
    ``accepted_logprobs`` their logprobs where asked. ``proposals``: a draft model's tokens to
    follow each sampled one (``StepPlan.num_proposals``)."""

    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    prompt_logprobs: dict[str, list[TokenLogprobs]]
    failed: dict[str, Exception] = attrs.field(factory=dict)
    accepted: dict[str, tuple[int, ...]] = attrs.field(factory=dict)
    accepted_logprobs: dict[str, tuple[TokenLogprobs, ...]] = attrs.field(factory=dict)
    proposals: dict[str, tuple[int, ...]] = attrs.field(factory=dict)
