"""Beam search, as vLLM's: the engine scores each beam's next tokens, the front keeps the best.

Each step asks the engine, for every live beam, for the ``2 * beam_width`` most likely next
tokens (one token of output with that many logprobs: the model's raw log-probabilities, so
``temperature`` plays no part, as with vLLM's default logprobs mode). Each beam extended by each
of its candidates is scored as transformers scores it: its summed log-probability over its
number of generated tokens (an end token counted) to the power ``length_penalty``. A candidate
that is an end token (the model's EOS and other end tokens unless ``ignore_eos``, and the
request's ``stop_token_ids``) finishes its beam, wherever it ranks among the step's candidates
(vLLM's rule; transformers keeps only those within the best ``beam_width`` of the step, and so
may miss a better finished beam); the ``beam_width`` best of the others go on. Without end tokens
the beams are transformers' exactly. The search ends after ``max_tokens`` steps, when no beam is
left, or as soon as no live beam can still beat the ``beam_width`` best finished ones (a bound
that holds for any ``length_penalty``: log-probabilities only add up below zero).

A step sends each beam's whole sequence again; the prefix cache holds its full blocks, so a
step computes at most a block of tokens per beam.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import TYPE_CHECKING, Any

import attrs

from engine.errors import InvalidParameterError
from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from engine.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from engine.frontend.async_engine import EngineClient

# Each step asks for 2 x beam_width candidates per beam, within the engine's logprobs limit.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


def _check(param: str, ok: bool, message: str) -> None:
    if not ok:
        raise InvalidParameterError(param, f"{param} {message}")


@attrs.frozen(kw_only=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` (``stop_token_ids`` and ``cache_salt`` added)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # accepted as in vLLM; the scores are raw log-probabilities
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # the text ends with the end token's text
    stop_token_ids: list[int] = attrs.field(factory=list, converter=list)
    cache_salt: str | None = None

    def __attrs_post_init__(self) -> None:
        _check("beam_width", isinstance(self.beam_width, int) and 1 <= self.beam_width <= MAX_BEAM_WIDTH,
               f"must be an integer in [1, {MAX_BEAM_WIDTH}] (each step scores 2 x beam_width tokens a beam); "
               f"got {self.beam_width!r}")
        _check("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"must be an integer >= 1; got {self.max_tokens!r}")
        _check("length_penalty", isinstance(self.length_penalty, (int, float)) and -10 <= self.length_penalty <= 10,
               f"must be a number in [-10, 10]; got {self.length_penalty!r}")
        _check("temperature", isinstance(self.temperature, (int, float)) and self.temperature >= 0,
               f"must be a number >= 0; got {self.temperature!r}")


@attrs.define
class BeamSearchSequence:
    """One beam: ``tokens`` holds the prompt's and the beam's (as vLLM's)."""

    tokens: list[int]
    logprobs: list[PositionLogprobs]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


@attrs.define
class BeamSearchOutput:
    """The best ``beam_width`` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@attrs.define
class _Beam:
    tokens: tuple[int, ...]  # generated so far
    logprobs: tuple[PositionLogprobs, ...]
    cum_logprob: float
    ended_by: int | None = None  # the end token that finished it

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / max(len(self.tokens), 1) ** length_penalty

    def best_possible(self, length_penalty: float, max_tokens: int) -> float:
        """A bound on the score of any beam this one may become: its log-probability only falls."""
        length = max_tokens if length_penalty > 0 else max(len(self.tokens), 1)
        return self.cum_logprob / length ** length_penalty


async def beam_search(client: EngineClient, prompt: str | list[int] | dict[str, Any], params: BeamSearchParams,
                      request_id: str | None = None, priority: int = 0, admitted: bool = False) -> RequestOutput:
    """The ``beam_width`` best continuations of ``prompt``, best first, as one finished output.

    Raises:
        InvalidParameterError: a bad prompt or parameter (nothing is queued).
        EngineOverloadedError: no room for ``beam_width`` sequences now. The room is held
            until the search ends, so a search that started runs to its end; its steps wait in
            it (``admitted``: the caller holds the room, or bounds its own queue).
        EngineDeadError, RequestFailedError: the engine, or a step's request, failed.
    """
    text, prompt_ids = client.prepare(prompt)
    client.validate(prompt_ids, SamplingParams(max_tokens=params.max_tokens, stop_token_ids=params.stop_token_ids),
                    priority)
    with contextlib.nullcontext() if admitted else client.reserve(params.beam_width):
        return await _search(client, text, prompt_ids, params, request_id or uuid.uuid4().hex, priority)


async def _search(client: EngineClient, text: str | None, prompt_ids: list[int], params: BeamSearchParams,
                  request_id: str, priority: int) -> RequestOutput:
    width, penalty = params.beam_width, params.length_penalty
    step = SamplingParams(max_tokens=1, temperature=0, logprobs=2 * width, ignore_eos=True,
                          cache_salt=params.cache_salt, output_kind=RequestOutputKind.FINAL_ONLY)
    ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(client.eos_token_ids))
    live, finished = [_Beam((), (), 0.0)], []
    num_cached = 0
    for n in range(params.max_tokens):
        outputs: list[RequestOutput | None] = [None] * len(live)
        async with await client.add_requests(
                [{"prompt_token_ids": prompt_ids + list(beam.tokens)} for beam in live], step,
                [f"{request_id}-{n}-{i}" for i in range(len(live))], priority, admitted=True) as queued:
            async for index, output in queued:
                outputs[index] = output
        if n == 0:
            num_cached = outputs[0].num_cached_tokens
        candidates = []
        for beam, output in zip(live, outputs):
            (position,) = output.outputs[0].logprobs
            for token, logprob in position.items():
                grown = _Beam(beam.tokens + (token,), beam.logprobs + (position,), beam.cum_logprob + logprob.logprob,
                              token if token in ends else None)
                (finished if grown.ended_by is not None else candidates).append(grown)
        live = sorted(candidates, key=lambda b: b.score(penalty), reverse=True)[:width]
        finished = sorted(finished, key=lambda b: b.score(penalty), reverse=True)[:width]
        if not live or (len(finished) == width and finished[-1].score(penalty) >=
                        max(b.best_possible(penalty, params.max_tokens) for b in live)):
            break
    beams = sorted(finished + live, key=lambda b: b.score(penalty), reverse=True)[:width]
    tokenizer = client.tokenizer
    outputs = []
    for i, beam in enumerate(beams):
        shown = beam.tokens if beam.ended_by is None or params.include_stop_str_in_output else beam.tokens[:-1]
        outputs.append(CompletionOutput(
            i, tokenizer.decode(list(shown), skip_special_tokens=True), list(beam.tokens), beam.cum_logprob,
            list(beam.logprobs), "length" if beam.ended_by is None else "stop",
            beam.ended_by if beam.ended_by in params.stop_token_ids else None))
    return RequestOutput(request_id, text, prompt_ids, None, outputs, True, num_cached)
