"""Per-request state built from the core's ``TokenDelta``s: tokens, logprobs, text, finish state."""

from __future__ import annotations

import attrs

from engine.detokenizer import IncrementalDetokenizer
from engine.messages import TokenDelta
from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput, TokenLogprobs
from engine.sampling_params import SamplingParams


@attrs.frozen
class StopStringHit:
    """Completion ``index`` produced stop string ``stop``: the core must finish it."""

    index: int
    stop: str


@attrs.define
class CompletionState:
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = attrs.field(factory=list)
    logprobs: list[TokenLogprobs] = attrs.field(factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestState:
    """Everything known so far about one request; ``apply`` each delta, read ``output()``.

    Tokens that arrive for a completion after it finished (the core may run a step before
    it hears of a stop string) are ignored.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.completions = [CompletionState(IncrementalDetokenizer(tokenizer, params)) for _ in range(params.n)]
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.num_cached_tokens = 0
        self.first_scheduled_at: float | None = None
        self._num_unfinished = params.n

    @property
    def finished(self) -> bool:
        return self._num_unfinished == 0

    def apply(self, delta: TokenDelta) -> StopStringHit | None:
        """Add a delta; return a stop-string hit that the caller must report to the core."""
        completion = self.completions[delta.index]
        if completion.finish_reason is not None:
            return None
        if delta.index == 0:
            self.prompt_logprobs += delta.new_prompt_logprobs
        self.num_cached_tokens = delta.num_cached_tokens
        self.first_scheduled_at = self.first_scheduled_at or delta.first_scheduled_at
        for i, token in enumerate(delta.new_token_ids):
            completion.token_ids.append(token)
            if delta.new_logprobs:
                completion.logprobs.append(delta.new_logprobs[i])
            stop = completion.detokenizer.add_token(token)
            if stop is not None:
                self._finish(completion, "stop", stop)
                return StopStringHit(delta.index, stop)
        if delta.finished:
            self._finish(completion, delta.finish_reason, delta.stop_reason)
        return None

    def _finish(self, completion: CompletionState, reason: str, stop_reason: int | str | None) -> None:
        completion.finish_reason, completion.stop_reason = reason, stop_reason
        self._num_unfinished -= 1
        completion.detokenizer.finish(completion.token_ids)

    # ---- building outputs ----

    def completion_output(self, index: int, text_from: int = 0, tokens_from: int = 0) -> CompletionOutput:
        """Completion ``index`` from the given offsets on (0, 0 for the whole of it)."""
        c = self.completions[index]
        logprobs = cumulative = None
        if self.params.logprobs is not None:
            logprobs = [lp.to_dict(self.decode_one) for lp in c.logprobs[tokens_from:]]
            cumulative = sum(lp.logprob for lp in c.logprobs)
        return CompletionOutput(index, c.detokenizer.visible_since(text_from), c.token_ids[tokens_from:],
                                cumulative, logprobs, c.finish_reason, c.stop_reason)

    def prompt_logprobs_output(self) -> list[PositionLogprobs | None] | None:
        if self.params.prompt_logprobs is None:
            return None
        return [None] + [lp.to_dict(self.decode_one) for lp in self.prompt_logprobs]

    def output(self) -> RequestOutput:
        """The whole request so far (vLLM's CUMULATIVE form)."""
        outputs = [self.completion_output(i) for i in range(len(self.completions))]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs_output(),
                             outputs, self.finished, self.num_cached_tokens, self.first_scheduled_at)

    def decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
