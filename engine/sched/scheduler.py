"""Continuous-batching scheduler with vLLM v1 semantics: synchronous, no trio, no torch.

There are no prefill and decode phases. Each request knows how many of its tokens
(prompt + output so far) are in the KV cache (``num_computed_tokens``); a step gives each
scheduled request some of the rest, up to a per-step token budget.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, NamedTuple

import attrs

from engine.plan import NewRequest, StepPlan
from engine.sched.kv_cache import BlockManager
from engine.sched.request import Request, RequestStatus
from engine.speculative import NgramIndex, SpeculativeConfig


class ScheduledChunk(NamedTuple):
    """``num_new_tokens`` tokens of ``request`` to compute this step, from ``start``.

    A named tuple: one is made per running request per step, and a tuple is built in a
    third of the time of a frozen attrs class, as immutable."""

    request: Request
    start: int  # == request.num_computed_tokens when scheduled
    num_new_tokens: int
    # True when the chunk reaches the request's last known token, so its logits give the next one.
    samples: bool

    @classmethod
    def of(cls, request: Request, start: int, num_new_tokens: int) -> ScheduledChunk:
        return cls(request, start, num_new_tokens, start + num_new_tokens == len(request.token_ids))

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def is_prompt(self) -> bool:
        """Part of a prompt (under the step's prefill cap), even one token of it; a decode is the
        one token that samples."""
        return self.num_new_tokens > 1 or not self.samples


# ``ScheduledChunk(...)`` without the named tuple's generated ``__new__`` (0.23 -> 0.13 us: one
# per decoding request per step).
_chunk = tuple.__new__


@attrs.frozen
class SchedulerOutput:
    """What one step computes: ``chunks`` (in batch order) for the core's own accounting, and
    the same as a value, ``plan``, for the runner (which also names the requests preempted in
    this step and those that ended since the previous one)."""

    chunks: list[ScheduledChunk]
    plan: StepPlan
    # Rows whose request has a structured-output grammar and samples: their matchers mask the
    # next token (EngineCore fills the plan's bitmask when it executes the step) and take the
    # sampled one (EngineCore.update).
    constrained_rows: tuple[int, ...] = ()
    # Per request id, a matcher that raised while its mask was filled (filled in by execute:
    # the request fails after the step).
    grammar_errors: dict[str, Exception] = attrs.field(factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return self.plan.num_batched_tokens

    @property
    def preempted_ids(self) -> list[str]:
        return list(self.plan.preempted_ids)

    @property
    def finished_ids(self) -> list[str]:
        return list(self.plan.finished_ids)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


if TYPE_CHECKING:
    from engine.config import EngineConfig

# The cap that follows the batch (EngineConfig.mixed_prefill_per_decode): never below what fills
# a step to this many tokens, decodes included (a lone stream must not starve a prompt), and
# never below the backlog spread over this many steps (a queue of long prompts is worked off). A
# shorter horizon (16) re-synchronized the streams into cohorts in bench/schedule_sim.py.
# 16, not a floor of 32 prompt tokens, since 2026-12-06: on Zen 4 (bench/step_cost.py --decodes
# 6) a step of 6 decodes costs 19 ms, of 16 tokens 30 ms, of 22-38 tokens 41-56 ms (the packed
# products work in blocks of 16 rows), so a prompt's 32-token chunks made every few streams'
# next token wait 2.4-2.7x a decode step: ITL p99 2.8x the median under Poisson arrivals.
MIN_MIXED_STEP_TOKENS = 16
BACKLOG_STEPS = 64
# The ratio also follows the workload: at least this many times the prompt tokens per output
# token. To keep D streams decoding, each step must prefill about D x prompt / output tokens;
# below that the batch shrinks, the cap (per decoding stream) with it, and prompts queue:
# 512-token prompts with 128-token outputs waited 35 s (TTFT p50 at 32 streams in
# bench/schedule_sim.py) with the ratio at 1.5, 3.0 s at 6 (1.5 x 4); 8 let prefill bursts
# through again (ITL p99 3.5x the median). 1.2 since 2026-12-05: at 1.5 a step decoding 64 streams
# with 96 prompt tokens cost ~2x a decode-only one, and ITL p99 reached 1.8-1.95x the median with
# Poisson arrivals and 1.7x with mixed lengths; at 1.2 1.5-1.7x, at the same output tok/s and a
# later first token (serve.py, Zen 3; bench/README.md, "The tail, again").
# The rate is the prompt tokens of the requests that finished over the output tokens that all
# requests produced, both decayed over about PREFILL_RATE_WINDOW steps (Little's law: in a
# steady state that is prompt / output per request). Not prompt / output of the finished ones:
# the first to finish are those with the shortest outputs, so with mixed lengths that ratio
# started several times too high (1.5 x 22 for 50-970-token prompts and 12-243-token outputs)
# and let 1024-token prefill steps stall 64 streams (ITL p99 12.8x the median); this one starts
# low (as the configured ratio would) and rises as requests finish. Until it has, a bound from
# below holds it up: answers end at max_tokens at the latest, so the prompt tokens computed per
# max_tokens of recently admitted requests (over about PREFILL_BOUND_WINDOW of them) is at most
# the workload's rate, exact where answers run to max_tokens, and known from the first admission.
PREFILL_RATE_MARGIN = 1.2
PREFILL_RATE_WINDOW = 256
PREFILL_BOUND_WINDOW = 64


@attrs.define
class SpecDecodeStats:
    """Speculative decoding's counters (vLLM's ``spec_decode`` metrics): drafts (steps of a
    request that carried any), draft tokens, kept tokens, and kept tokens per draft position."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_kept: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_kept
        for position in range(num_kept):
            self.accepted_per_pos[position] += 1


@attrs.define
class StepBudget:
    """Tokens one step may still take: in all, and in prefill chunks (more than one token)."""

    tokens: int
    prefill: float  # math.inf when uncapped
    cap: float = attrs.field(init=False)  # the prefill cap the step started with

    def __attrs_post_init__(self) -> None:
        self.cap = self.prefill

    def grant(self, wanted: int) -> int:
        """How many of ``wanted`` tokens fit (one token is a decode, more are a prefill chunk).
        Under a cap (streams decode), a prompt that needs n steps at the cap is cut into n equal
        chunks, not n - 1 full ones and a remainder: as many steps to its first token, and the
        decoding streams wait one cost of step instead of alternately 1 + r and less (a 128-token
        prompt under a cap of 90: 64 + 64, not 90 + 38)."""
        if wanted == 1:
            return min(1, self.tokens)
        if wanted > self.cap:
            whole = max(1, int(self.cap))  # (the chunks are whole tokens: a cap of 38.4 takes 38)
            wanted = -(-wanted // -(-wanted // whole))
        return int(min(wanted, self.tokens, self.prefill))

    def spend(self, chunk: ScheduledChunk) -> None:
        """Take the tokens of a scheduled chunk: a prompt's (even one token) count against the
        prefill cap too."""
        self.tokens -= chunk.num_new_tokens
        if chunk.is_prompt:
            self.prefill -= chunk.num_new_tokens

    def give_back(self, chunk: ScheduledChunk) -> None:
        self.tokens += chunk.num_new_tokens
        if chunk.is_prompt:
            self.prefill += chunk.num_new_tokens


class Scheduler:
    """Decides, each step, which tokens of which requests the model computes.

    Args:
        config: budgets (``max_num_seqs``, ``max_num_batched_tokens``), chunked prefill and
            the scheduling policy.
        block_manager: owns the KV blocks.
        max_model_len: the resolved longest sequence.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.batch_tokens(max_model_len)
        self.max_num_mixed_prefill_tokens = config.max_num_mixed_prefill_tokens
        self.mixed_prefill_per_decode = config.mixed_prefill_per_decode
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.priority_policy = config.scheduling_policy == "priority"
        self.max_model_len = max_model_len
        self.kv = block_manager
        self.waiting: list[Request] = []  # sorted by _order_key
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []
        self._num_constrained = 0  # live requests with a structured-output grammar
        # Prompt tokens computed of requests finished, and output tokens made, recently (decayed per step).
        self._recent_prefill = self._recent_output = 0.0
        # Prompt tokens to compute and max_tokens of requests admitted recently (decayed per admission).
        self._admitted_prefill = self._admitted_max_tokens = 0.0
        self.speculative: SpeculativeConfig | None = config.speculative
        self.spec_stats = SpecDecodeStats(self.speculative.num_speculative_tokens if self.speculative else 0)

    # ---- membership ----

    def _order_key(self, request: Request) -> tuple[int, int]:
        return (request.priority if self.priority_policy else 0, request.arrival_order)

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._num_constrained += request.matcher is not None
        bisect.insort(self.waiting, request, key=self._order_key)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish the named live requests as aborted, freeing their blocks; unknown ids are ignored."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self.finish(request, RequestStatus.FINISHED_ABORTED)
                aborted.append(request)
        return aborted

    def finish(self, request: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Move a live request to a finished status and free everything it holds."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) and request.num_cached_tokens >= 0:
            self._recent_prefill += request.num_prompt_tokens - request.num_cached_tokens
        request.status = status
        request.stop_reason = stop_reason
        self.kv.free(request)
        del self.requests[request.request_id]
        self._num_constrained -= request.matcher is not None
        self._finished_ids.append(request.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ---- the step ----

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work.

        1. Running requests, oldest first, each get their remaining tokens (one, in decode;
           a chunk, in a chunked prefill) up to the token budget. When a block cannot be
           had, the newest running request (lowest priority first under ``priority``) is
           preempted: its blocks are freed and it goes back to waiting, to be recomputed.
        2. If nothing was preempted, waiting requests are admitted in order while the budget,
           ``max_num_seqs`` and free blocks allow; their cached prefix is skipped, and a
           prompt longer than the budget is chunked (or waits, without chunked prefill).

        Prefill chunks (of running or newly admitted requests) share a second budget in steps
        that also decode: a step is as slow as the tokens in it, and every decoding stream
        waits for the whole step, so a long prefill joining it would stall them all. The
        budget is ``max_num_mixed_prefill_tokens`` and/or, with ``mixed_prefill_per_decode``,
        proportional to the decoding streams (``_prefill_cap``). Steps with nothing to decode
        take the full budget.
        """
        scheduled: dict[str, ScheduledChunk] = {}
        preempted: list[str] = []
        budget = StepBudget(self.max_num_batched_tokens, self._prefill_cap())
        self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        spec = self.speculative
        drafting = spec is not None and (spec.disable_by_batch_size is None
                                         or len(self.running) <= spec.disable_by_batch_size)
        if drafting:
            self._schedule_drafts(budget, scheduled)
        finished, self._finished_ids = self._finished_ids, []
        chunks = list(scheduled.values())
        plan, constrained = self._plan(chunks, preempted, finished)
        if drafting and spec.method == "draft_model":  # (proposals for the next step)
            plan = attrs.evolve(plan, num_proposals=spec.num_speculative_tokens)
        return SchedulerOutput(chunks, plan, constrained)

    def _plan(self, chunks: list[ScheduledChunk], preempted: list[str],
              finished: list[str]) -> tuple[StepPlan, tuple[int, ...]]:
        """The step as the runner's value: rows, their input tokens, and what the runner does
        not know yet (new requests, grown block tables); and the rows whose grammar masks the
        next token (EngineCore fills their masks into the plan). One pass, every step over every row:
        a decode row costs a few appends, and its block table is read only when its row starts
        a block the runner does not know of (a request owns exactly the blocks its computed
        tokens need), or the runner has no state for the request."""
        ids: list[str] = []
        starts: list[int] = []
        counts: list[int] = []
        tokens: list[int] = []
        sample_rows: list[int] = []
        grammar_rows: list[int] = []
        new: list[NewRequest] = []
        new_blocks: list[tuple[str, tuple[int, ...]]] = []
        drafted: list[int] = []  # per row, when any row carries drafts
        kv, bs, constrained = self.kv, self.kv.block_size, self._num_constrained > 0
        for row, (request, start, num_new, samples) in enumerate(chunks):
            request_id = request.request_id
            ids.append(request_id)
            starts.append(start)
            counts.append(num_new)
            if num_new == 1:
                tokens.append(request.token_ids[start])
            elif request.spec_token_ids:
                tokens.append(request.token_ids[start])
                tokens += request.spec_token_ids
                drafted += [0] * (row - len(drafted))
                drafted.append(len(request.spec_token_ids))
            else:
                tokens += request.token_ids[start:start + num_new]
            if samples:
                sample_rows.append(row)
                if constrained and request.matcher is not None:
                    grammar_rows.append(row)
            have = request.num_runner_blocks
            if start + num_new > have * bs:
                if have < 0:
                    new.append(NewRequest(request_id, tuple(request.token_ids), request.num_prompt_tokens,
                                          request.params, request.eos_token_id, request.num_prompt_logprobs))
                    have = 0
                new_blocks.append((request_id, kv.new_block_ids(request_id, have)))
                request.num_runner_blocks = len(kv.tables[request_id][0])
        if drafted:
            drafted += [0] * (len(ids) - len(drafted))
        return StepPlan(tuple(ids), tuple(starts), tuple(counts), tuple(tokens), tuple(sample_rows), tuple(new),
                        tuple(new_blocks), tuple(finished), tuple(preempted),
                        num_draft_tokens=tuple(drafted)), tuple(grammar_rows)

    def _prefill_cap(self) -> float:
        """The prefill tokens this step may carry: capped when it also decodes.

        With ``mixed_prefill_per_decode`` (r), D decoding streams admit max(16 - D, r * D,
        backlog / 64): a step holds at most about (1 + r) D tokens, so every stream's next token
        waits at most about 1 + r decode-only steps, and with r above the workload's prompt
        tokens per output token prompts are admitted faster than streams finish, so the batch
        refills to its concurrency: r is raised to PREFILL_RATE_MARGIN (1.2) times that rate, as
        observed (``prefill_per_decode``)."""
        cap, ratio = self.max_num_mixed_prefill_tokens, self.mixed_prefill_per_decode
        if (cap is None and ratio is None) or not self.enable_chunked_prefill:
            return math.inf
        if ratio is None:
            return cap if any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running) else math.inf
        decoding = backlog = 0  # one pass: this runs every step over every running request
        for r in self.running:
            left = r.num_tokens - r.num_computed_tokens
            if left == 1:
                decoding += 1
            else:
                backlog += left
        if decoding == 0:
            return math.inf
        backlog += sum(r.num_tokens for r in self.waiting)
        paced = max(1, MIN_MIXED_STEP_TOKENS - decoding, self.prefill_per_decode * decoding, backlog / BACKLOG_STEPS)
        return paced if cap is None else min(cap, paced)

    @property
    def prefill_per_decode(self) -> float:
        """The per-decode ratio in force: the configured one, or more where the recent workload
        has more prompt tokens per output token (see PREFILL_RATE_MARGIN)."""
        rate = self._recent_prefill / self._recent_output if self._recent_output > 0 else 0.0
        if self._admitted_max_tokens > 0:
            rate = max(rate, self._admitted_prefill / self._admitted_max_tokens)
        return max(self.mixed_prefill_per_decode or 0.0, PREFILL_RATE_MARGIN * rate)

    def _schedule_running(self, budget: StepBudget, scheduled: dict[str, ScheduledChunk],
                          preempted: list[str]) -> None:
        running, allocate, bs = RequestStatus.RUNNING, self.kv.allocate, self.kv.block_size
        if self.kv.sliding_window is not None:  # blocks the windows have passed go back before any is asked for
            for request in self.running:
                self.kv.free_out_of_window(request)
        for request in list(self.running):
            if budget.tokens == 0:
                break
            if request.status is not running:  # preempted earlier in this loop
                continue
            start = request.num_computed_tokens
            num_new = len(request.token_ids) - start
            # A decode: most requests, every step. Its token has room in the blocks the request
            # owns, which are the blocks the runner was sent (every allocation reaches the runner
            # in its step's plan), and does not fill its block (a full block is registered in the
            # prefix cache): the block manager has nothing to do, and is not asked.
            if num_new == 1 and ((start + 1) % bs and start < request.num_runner_blocks * bs
                                 or allocate(request, 1)):
                scheduled[request.request_id] = _chunk(ScheduledChunk, (request, start, 1, True))
                budget.tokens -= 1
                continue
            num_new = budget.grant(num_new)
            if num_new == 0:  # a prefill chunk, and this step's prefill budget is spent
                continue
            while not allocate(request, num_new):
                victim = self._pick_victim()
                self._preempt(victim)
                preempted.append(victim.request_id)
                unscheduled = scheduled.pop(victim.request_id, None)
                if unscheduled is not None:
                    budget.give_back(unscheduled)
                if victim is request:
                    break
            else:
                chunk = scheduled[request.request_id] = ScheduledChunk.of(request, request.num_computed_tokens, num_new)
                budget.spend(chunk)

    def _schedule_drafts(self, budget: StepBudget, scheduled: dict[str, ScheduledChunk]) -> None:
        """Give decoding requests proposed tokens after their next one, from what the step
        has left: tokens of its budget and free blocks (a proposal never preempts anyone nor
        keeps anyone's token or prompt out of the step)."""
        for request_id, chunk in scheduled.items():
            if budget.tokens == 0:
                break
            request = chunk.request
            if chunk.num_new_tokens != 1 or chunk.start != len(request.token_ids) - 1:
                continue
            drafts = self._drafts(request, budget.tokens)
            if drafts and self.kv.allocate(request, 1 + len(drafts)):
                request.spec_token_ids = drafts
                scheduled[request_id] = _chunk(ScheduledChunk, (request, chunk.start, 1 + len(drafts), True))
                budget.tokens -= len(drafts)

    def _drafts(self, request: Request, room: int) -> list[int]:
        """Proposed tokens to compute after ``request``'s last known one this step: at most
        ``room``, and no more than its max_tokens and max_model_len leave room for with the token
        sampled after them. None for a request under a grammar (its masks are filled per
        sampled position)."""
        spec = self.speculative
        most = min(spec.num_speculative_tokens, room, request.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1)
        if most < 1 or request.matcher is not None:
            return []
        if spec.method == "draft_model":
            return list(request.proposed_token_ids[:most])
        if request.ngram_index is None:
            request.ngram_index = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
        return request.ngram_index.drafts(request.token_ids, most)

    def _pick_victim(self) -> Request:
        if self.priority_policy:
            return max(self.running, key=self._order_key)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.forget_uncomputed(request)  # (blocks registered this step whose KV will not be written)
        self.kv.free(request)
        request.num_runner_blocks = -1  # the plan names it preempted: the runner drops its state
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=self._order_key)

    def _schedule_waiting(self, budget: StepBudget, scheduled: dict[str, ScheduledChunk]) -> None:
        while self.waiting and budget.tokens > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            # Prompt logprobs need the logits of every prompt position, so no cache hits.
            wants_all_logits = request.params.prompt_logprobs is not None
            cached = [] if wants_all_logits else self.kv.find_cached_prefix(request)
            num_cached = len(cached) * self.kv.block_size
            wanted = request.num_tokens - num_cached
            num_new = budget.grant(wanted)
            if num_new == 0 or (num_new < wanted and not self.enable_chunked_prefill):
                break
            if not self.kv.allocate(request, num_new, cached):
                break
            if self.kv.enable_prefix_caching and not wants_all_logits and not request.num_preemptions:
                # (as vLLM counts: lookups made, of new requests; a resumed one finds its own blocks)
                self.kv.record_prefix_lookup(request.num_tokens, num_cached)
            self._admit(request, num_cached)
            chunk = scheduled[request.request_id] = ScheduledChunk.of(request, num_cached, num_new)
            budget.spend(chunk)

    def _admit(self, request: Request, num_cached: int) -> None:
        del self.waiting[0]
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
            request.first_scheduled_at = time.monotonic()
            keep = 1 - 1 / PREFILL_BOUND_WINDOW
            self._admitted_prefill = keep * self._admitted_prefill + request.num_tokens - num_cached
            self._admitted_max_tokens = keep * self._admitted_max_tokens + request.max_tokens

    def update(self, output: SchedulerOutput, sampled: dict[str, int],
               grammar_finished: Collection[str] = (), accepted: dict[str, tuple[int, ...]] | None = None,
               proposals: dict[str, tuple[int, ...]] | None = None) -> list[Request]:
        """Account for a finished step: advance computed counts, append sampled tokens and
        finish requests that hit a stop condition, or whose structured-output grammar is
        complete (``grammar_finished``: its stop token is in, whatever ``ignore_eos`` or
        ``min_tokens`` say). ``accepted``: per drafted request, the drafts kept (they come
        before its sampled token). ``proposals``: a draft model's tokens to follow each sampled
        one (they replace the request's earlier ones). Returns the requests finished here."""
        finished = []
        keep = 1 - 1 / PREFILL_RATE_WINDOW
        self._recent_prefill *= keep
        self._recent_output = keep * self._recent_output + len(sampled)
        running, max_model_len = RequestStatus.RUNNING, self.max_model_len
        drafts_from_model = self.speculative is not None and self.speculative.method == "draft_model"
        for request, start, num_new_tokens, _ in output.chunks:
            if request.status is not running:  # finished (aborted) while the step ran
                continue
            if drafts_from_model:  # (none from this step: none to use in the next)
                request.proposed_token_ids = proposals.get(request.request_id, ()) if proposals else ()
            if request.spec_token_ids:
                if self._update_drafted(request, start, sampled, accepted or {}):
                    finished.append(request)
                continue
            request.num_computed_tokens = start + num_new_tokens
            token = sampled.get(request.request_id)
            if token is None:
                continue
            token_ids = request.token_ids
            token_ids.append(token)
            if request.request_id in grammar_finished:
                stop_reason = token if token in request.params.stop_token_ids else None
                status = RequestStatus.FINISHED_STOPPED
            elif (token == request.eos_token_id or token in request.params.stop_token_ids
                  or len(token_ids) - len(request.prompt_token_ids) >= request.max_tokens
                  or len(token_ids) >= max_model_len):
                status, stop_reason = self._check_stop(request, token)
            else:  # the common case, checked inline: no stop token, no length reached
                continue
            if status is not None:
                self.finish(request, status, stop_reason)
                finished.append(request)
        return finished

    def _update_drafted(self, request: Request, start: int, sampled: dict[str, int],
                        accepted: dict[str, tuple[int, ...]]) -> bool:
        """A step that computed drafts after ``request``'s last known token (never one under a
        grammar): the KV of the kept ones is valid (the rest is overwritten later); the kept
        drafts, then the sampled token, are appended one at a time until one stops the request;
        blocks now full of known, computed tokens join the prefix cache. Returns whether it
        finished."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        kept = accepted.get(request.request_id, ())
        self.spec_stats.record(len(drafts), len(kept))
        request.num_computed_tokens = start + 1 + len(kept)
        token = sampled.get(request.request_id)
        if token is None:  # (its part of the step failed: it is finished as an error)
            return False
        status = stop_reason = None
        for token in (*kept, token):
            request.token_ids.append(token)
            status, stop_reason = self._check_stop(request, token)
            if status is not None:
                break
        self.kv.cache_computed_blocks(request, start)
        if status is None:
            return False
        self.finish(request, status, stop_reason)
        return True

    def _check_stop(self, request: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        params = request.params
        num_tokens = len(request.token_ids)
        num_output = num_tokens - len(request.prompt_token_ids)
        if num_output >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED, None
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if num_output >= request.max_tokens or num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None
