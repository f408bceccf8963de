"""Per-request state built from the core's ``TokenDelta``s: tokens, logprobs, text, finish state."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence

import attrs

from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.frontend.stats import IterationStats, RequestTimes, TokenClock
from engine.messages import TokenDelta
from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput, TokenLogprobs
from engine.sampling_params import SamplingParams


@attrs.frozen
class StopStringHit:
    """Completion ``index`` produced stop string ``stop`` at its ``num_tokens``-th token: the
    core must finish it."""

    index: int
    stop: str
    num_tokens: int


@attrs.define
class CompletionState:
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = attrs.field(factory=list)
    logprobs: list[TokenLogprobs] = attrs.field(factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The core has finished this sequence too. A stop string ends a completion here first; the
    # core hears of it a step later, and until then the request id stays taken.
    engine_finished: bool = False
    # It has a token, or has ended: it no longer counts as waiting (``RequestState.num_waiting``).
    started: bool = False
    clock: TokenClock = attrs.field(factory=TokenClock)


class RequestState:
    """Everything known so far about one request; ``apply`` each delta, read ``output()``.

    Tokens that arrive for a completion after it finished (the core may run a step before
    it hears of a stop string) are ignored. If one completion fails in the engine, the
    whole request has failed: ``error`` says why.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer, arrival: float | None = None, waits: bool = True) -> None:
        """``waits``: its completions count as waiting until they start (``num_waiting``); not
        for requests that wait in room their caller holds (a beam search's steps)."""
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.completions = [CompletionState(IncrementalDetokenizer(tokenizer, params, prompt_token_ids))
                            for _ in range(params.n)]
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.num_cached_tokens = 0
        self.times = RequestTimes(time.monotonic() if arrival is None else arrival)
        self.error: str | None = None
        self.error_param: str | None = None  # where the caller's parameters were at fault
        self._num_unfinished = params.n
        self._waits = waits
        self.num_waiting = params.n if waits else 0  # completions with no token yet that have not ended

    @property
    def finished(self) -> bool:
        return self._num_unfinished == 0

    @property
    def engine_finished(self) -> bool:
        """The core holds nothing of this request any more (its id may be used again)."""
        return all(c.engine_finished for c in self.completions)

    @property
    def first_scheduled_at(self) -> float | None:
        return self.times.first_scheduled

    def apply(self, delta: TokenDelta, stats: IterationStats) -> StopStringHit | None:
        """Add a delta; return a stop-string hit that the caller must report to the core."""
        completion = self.completions[delta.index]
        completion.engine_finished = completion.engine_finished or delta.finished
        if completion.finish_reason is not None:
            return None
        if delta.error is not None:
            self.fail(stats, delta.error)
            self.error_param = self.error_param or delta.error_param
            return None
        if delta.new_prompt_logprobs and delta.index == 0:
            self.prompt_logprobs += delta.new_prompt_logprobs
        self.num_cached_tokens = delta.num_cached_tokens
        times = self.times
        if times.first_scheduled is None:
            times.first_scheduled = delta.first_scheduled_at
        if completion.clock.scheduled is None:
            completion.clock.scheduled = delta.first_scheduled_at
        if not completion.started and (delta.new_token_ids or delta.finished):
            self._start(completion)
        # Ended by a stop token (EOS or one of stop_token_ids; a stop string is the detokenizer's):
        # the token is the completion's last, but its text is not, unless
        # include_stop_str_in_output (vLLM's detokenizer skips it the same way).
        stop_token = (delta.finished and delta.finish_reason == "stop" and not isinstance(delta.stop_reason, str)
                      and bool(delta.new_token_ids) and not self.params.include_stop_str_in_output)
        if delta.new_token_ids:
            times.on_tokens(completion.clock, stats)
            last = len(delta.new_token_ids) - 1
            for i, token in enumerate(delta.new_token_ids):
                if delta.new_logprobs:
                    completion.logprobs.append(delta.new_logprobs[i])
                if stop_token and i == last:
                    completion.token_ids.append(token)
                    break
                hit = self.add_token(delta.index, token, stats)  # (its clock is read above)
                if hit is not None:
                    return hit
        if delta.finished:
            self._finish(completion, delta.finish_reason, delta.stop_reason, stats,
                         text_tokens=-1 if stop_token else None)
        return None

    def _start(self, completion: CompletionState) -> None:
        completion.started = True
        self.num_waiting -= self._waits

    def add_token(self, index: int, token: int, stats: IterationStats) -> StopStringHit | None:
        """One more token of completion ``index``: the common delta (``Decodes``: a completion
        with output already, no logprobs, not finished by the engine), and each token ``apply``
        adds; return a stop-string hit as ``apply`` does."""
        completion = self.completions[index]
        if completion.finish_reason is not None:
            return None
        # ``times.on_tokens``, written out: this runs for every stream at every step.
        clock, now = completion.clock, stats.now
        if now != clock.last:
            if clock.last is None:
                self.times.on_tokens(clock, stats)
            else:
                stats.inter_token_latencies.append(now - clock.last)
                clock.last = now
        completion.token_ids.append(token)
        stop = completion.detokenizer.add_token(token)
        if stop is None:
            return None
        self._finish(completion, "stop", stop, stats)
        return StopStringHit(index, stop, len(completion.token_ids))

    def fail(self, stats: IterationStats, error: str = "the engine failed") -> None:
        """End every unfinished completion as 'error' (this request, or the engine, failed)."""
        self.error = self.error or error
        if self.finished:
            return
        for completion in self.completions:
            if completion.finish_reason is None:
                completion.finish_reason = "error"
                self._record_finish(completion, stats)
            completion.started = True
        self._num_unfinished = self.num_waiting = 0
        self._record_request(stats)

    def _finish(self, completion: CompletionState, reason: str, stop_reason: int | str | None,
                stats: IterationStats, text_tokens: int | None = None) -> None:
        """``text_tokens``: the tokens that make the text (all; -1: all but the stop token)."""
        completion.finish_reason, completion.stop_reason = reason, stop_reason
        self._num_unfinished -= 1
        completion.detokenizer.finish(completion.token_ids[:text_tokens])
        if completion.detokenizer.stop_hit is not None:  # (in the bytes flushed at the end)
            completion.finish_reason, completion.stop_reason = "stop", completion.detokenizer.stop_hit
        self._record_finish(completion, stats)
        if self.finished:
            self._record_request(stats)

    def _record_finish(self, completion: CompletionState, stats: IterationStats) -> None:
        """Each completion is a sequence of its own in the stats, as vLLM's child requests."""
        self.times.finished(completion.clock, stats, completion.finish_reason, len(self.prompt_token_ids),
                            len(completion.token_ids))

    def _record_request(self, stats: IterationStats) -> None:
        stats.params_n.append(len(self.completions))
        stats.max_num_generation_tokens.append(max(len(c.token_ids) for c in self.completions))

    # ---- building outputs ----

    def completion_output(self, index: int, text_from: int = 0, tokens_from: int = 0) -> CompletionOutput:
        """Completion ``index`` from the given offsets on (0, 0 for the whole of it)."""
        c = self.completions[index]
        logprobs = cumulative = None
        if self.params.logprobs is not None:
            history = c.logprobs
            logprobs = [lp.to_dict(functools.partial(self.decode_one, context=self._before(history, i)))
                        for i, lp in enumerate(history[tokens_from:], start=tokens_from)]
            cumulative = sum(lp.logprob for lp in c.logprobs)
        return CompletionOutput(index, c.detokenizer.visible_since(text_from), c.token_ids[tokens_from:],
                                cumulative, logprobs, c.finish_reason, c.stop_reason)

    def prompt_logprobs_output(self) -> list[PositionLogprobs | None] | None:
        if self.params.prompt_logprobs is None:
            return None
        ids = self.prompt_token_ids  # (position i + 1's, read after the prompt's tokens before it)
        return [None] + [lp.to_dict(functools.partial(self.decode_one, context=ids[max(0, i - 3):i + 1]))
                         for i, lp in enumerate(self.prompt_logprobs)]

    def output(self) -> RequestOutput:
        """The whole request so far (vLLM's CUMULATIVE form)."""
        outputs = [self.completion_output(i) for i in range(len(self.completions))]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs_output(),
                             outputs, self.finished, self.num_cached_tokens, self.first_scheduled_at)

    def _before(self, history: list[TokenLogprobs], i: int) -> list[int]:
        """The up to 4 tokens before position ``i`` of a completion: the prompt's last ones first."""
        if i >= 4:
            return [h.token_id for h in history[i - 4:i]]
        return [*self.prompt_token_ids[-4:], *(h.token_id for h in history[:i])][-4:]

    def decode_one(self, token_id: int, context: Sequence[int] = ()) -> str:
        """A token's text as logprobs show it, read after ``context`` (the up to 4 tokens before
        it: a UTF-8 character's most bytes), as vLLM's: a token that ends inside a character
        (byte-level pieces of an emoji) is "", and the one that completes it has the character
        (with the text of the pieces before it), so that the tokens' texts make the text."""
        decode = self.tokenizer.decode
        text = decode([token_id])
        if not text.endswith("\ufffd"):
            return text
        for n in range(1, min(len(context), 4) + 1):
            before = list(context[-n:])
            whole = decode(before + [token_id])
            if whole.endswith("\ufffd"):
                continue
            clean = n  # the tokens before the unfinished pieces: their text is theirs, not this one's
            while clean and decode([before[clean - 1]]).endswith("\ufffd"):
                clean -= 1
            prefix = decode(before[:clean]) if clean else ""
            return whole[len(os.path.commonprefix([prefix, whole])):]
        return ""
