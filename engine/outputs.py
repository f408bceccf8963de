"""What the engine returns, named as in vLLM: ``RequestOutput`` holding ``CompletionOutput``s."""

from __future__ import annotations

import attrs


@attrs.frozen
class Logprob:
    """Log-probability of one token at one position, with its rank among all tokens (1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's log-probabilities: the chosen token and the top alternatives, by token id.
PositionLogprobs = dict[int, Logprob]


@attrs.frozen
class TokenLogprobs:
    """Raw sampler output for one position, before token ids are decoded to text."""

    token_id: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]

    def to_dict(self, decode=None) -> PositionLogprobs:
        """vLLM's per-position form: ``{token_id: Logprob}``, the chosen token first."""
        def text(token_id: int) -> str | None:
            return decode(token_id) if decode is not None else None

        result = {self.token_id: Logprob(self.logprob, self.rank, text(self.token_id))}
        for rank, (token_id, logprob) in enumerate(zip(self.top_ids, self.top_logprobs), start=1):
            if token_id not in result:
                result[token_id] = Logprob(logprob, rank, text(token_id))
        return result


# The outputs are built for every stream at every step, so they are plain attrs classes, as
# vLLM's are plain dataclasses: a frozen one costs 1.9 us to build against 0.7 us (7 fields).
@attrs.define
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort'
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    lora_request: None = None  # (vLLM's; no LoRA here)

    def finished(self) -> bool:
        """A method, as vLLM's (``RequestOutput.finished`` is a field)."""
        return self.finish_reason is not None


@attrs.define
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    first_scheduled_at: float | None = None  # time.monotonic() when the engine first scheduled it
    # vLLM's fields this engine has no use for, there for code that reads them: no per-request
    # metrics object (stat loggers see the timings), no LoRA, no encoder-decoder models.
    metrics: None = None
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
