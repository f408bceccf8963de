"""Turning the core's ``TokenDelta``s into ``RequestOutput``s: text, logprobs, stop strings."""

from __future__ import annotations

import attrs

from engine.messages import TokenDelta
from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput, TokenLogprobs
from engine.sampling_params import SamplingParams


@attrs.frozen
class StopStringHit:
    """Completion ``index`` produced stop string ``stop``: the core must finish it."""

    index: int
    stop: str


@attrs.define
class _Completion:
    token_ids: list[int] = attrs.field(factory=list)
    logprobs: list[TokenLogprobs] = attrs.field(factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestState:
    """Everything known so far about one request; ``apply`` each delta, read ``output()``."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.completions = [_Completion() for _ in range(params.n)]
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def apply(self, delta: TokenDelta) -> StopStringHit | None:
        """Add a delta; return a stop-string hit the caller must report to the core."""
        completion = self.completions[delta.index]
        if completion.finish_reason is not None:
            return None
        completion.token_ids += delta.new_token_ids
        completion.logprobs += delta.new_logprobs
        if delta.index == 0:
            self.prompt_logprobs += delta.new_prompt_logprobs
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.finished:
            completion.finish_reason, completion.stop_reason = delta.finish_reason, delta.stop_reason
        hit = self._find_stop_string(completion, delta.index) if delta.new_token_ids and self.params.stop else None
        if hit is not None:
            completion.finish_reason, completion.stop_reason = "stop", hit.stop
        return hit

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.params.skip_special_tokens,
                                     spaces_between_special_tokens=self.params.spaces_between_special_tokens)

    def _find_stop_string(self, completion: _Completion, index: int) -> StopStringHit | None:
        previous = len(completion.text)
        completion.text = self._decode(completion.token_ids)
        longest = max(len(s) for s in self.params.stop)
        window_start = max(0, previous - longest + 1)
        found = [(completion.text.find(s, window_start), s) for s in self.params.stop]
        found = [(pos, s) for pos, s in found if pos >= 0]
        if not found:
            return None
        pos, stop = min(found)
        completion.text = completion.text[:pos + len(stop) if self.params.include_stop_str_in_output else pos]
        return StopStringHit(index, stop)

    def output(self) -> RequestOutput:
        decode_one = self._decode_one if self.params.logprobs is not None or self.params.prompt_logprobs is not None else None
        outputs = []
        for index, c in enumerate(self.completions):
            text = c.text if isinstance(c.stop_reason, str) else self._decode(c.token_ids)
            logprobs = None
            cumulative = None
            if self.params.logprobs is not None:
                logprobs = [lp.to_dict(decode_one) for lp in c.logprobs]
                cumulative = sum(lp.logprob for lp in c.logprobs)
            outputs.append(CompletionOutput(index, text, list(c.token_ids), cumulative, logprobs,
                                            c.finish_reason, c.stop_reason))
        prompt_logprobs: list[PositionLogprobs | None] | None = None
        if self.params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [lp.to_dict(decode_one) for lp in self.prompt_logprobs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, prompt_logprobs, outputs,
                             self.finished, self.num_cached_tokens)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
