"""Batched token sampling with per-request parameters.

Order, as in vLLM: raw logprobs are taken first (what ``logprobs`` reports); then
allowed_token_ids and bad_words (other tokens, and each bad word's last token where the output
ends with the rest of it, masked), logit_bias, min_tokens (stop tokens masked),
repetition/frequency/presence penalties;
then greedy rows take the argmax, and the others apply temperature, min-p, then top-k and top-p
(on what min-p left) and draw by inverting the row's cumulative distribution (float64) at one uniform number.
That samples exactly from p with one random number per row, where the exponential race
(argmax of p / Exp(1) noise, as vLLM does on GPUs) needs one per vocabulary entry: on a CPU
drawing 64 x 49k exponentials took 100 ms, a quarter of a 64-row decode step. Each seeded
request draws its number from its own generator, so its tokens do not depend on what else is
in the batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import attrs
import numpy as np
import torch

from engine.errors import InvalidParameterError
from engine.outputs import TokenLogprobs
from engine.runner.requests import RunnerRequest as Request


@attrs.frozen
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where not requested
    # Rows whose own set-up or processing raised: their request fails, the batch goes on.
    errors: dict[int, Exception] = attrs.field(factory=dict)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's index of its largest value (the first of equal ones; a NaN counts as the
    largest), as ``torch.argmax`` gives it. On the CPU through numpy, whose vectorized argmax
    takes 7 us for a row of 49k logits where torch's takes 66 (and 37 us for 8 rows against 261)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(dim=-1).tolist()
    return np.argmax(logits.contiguous().numpy(), axis=-1).tolist()


@contextmanager
def isolated(errors: dict, key) -> Iterator[None]:
    """Run work that belongs to one request: an exception is recorded under ``key`` (that
    request fails alone) instead of failing the whole batch, and so the engine."""
    try:
        yield
    except Exception as exc:
        errors[key] = exc


class Sampler:
    """Samples one token per row of a logits batch.

    Resource handling: keeps one ``torch.Generator`` per seeded request; call ``forget`` with
    finished request ids to drop them.
    """

    def __init__(self, seed: int, device: str = "cpu") -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for unseeded requests
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request],
                 grammar: tuple[torch.Tensor, list[int]] | None = None) -> SamplerOutput:
        """``logits``: [N, vocab] float32, row i for ``requests[i]``. ``grammar``: a token bitmask
        (``apply_token_bitmask``) and the rows it masks, first of all processing: what is
        reported and sampled is what the grammar allows."""
        errors: dict[int, Exception] = {}
        constrained: frozenset[int] = frozenset()
        if grammar is not None:
            bitmask, rows = grammar
            apply_token_bitmask(logits, bitmask, rows)
            constrained = frozenset(rows)
        logprobs = self._logprobs(logits, requests)
        logits = self._process(logits, requests, errors, constrained)
        greedy = [r.params.greedy for r in requests]
        if all(greedy):
            token_ids = argmax_rows(logits)
        elif any(greedy):
            token_ids = torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(dim=-1),
                                    self._random(logits, requests, errors)).tolist()
        else:
            token_ids = self._random(logits, requests, errors).tolist()
        if logprobs is not None:
            return SamplerOutput(token_ids, self._gather_logprobs(logprobs, token_ids, requests, errors), errors)
        return SamplerOutput(token_ids, [None] * len(requests), errors)

    # ---- logprobs ----

    @staticmethod
    def _logprobs(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor | None:
        if all(r.params.logprobs is None for r in requests):
            return None
        return logits.log_softmax(dim=-1)

    @staticmethod
    def _gather_logprobs(logprobs: torch.Tensor, token_ids: list[int], requests: Sequence[Request],
                         errors: dict[int, Exception]) -> list[TokenLogprobs | None]:
        result: list[TokenLogprobs | None] = [None] * len(requests)
        for row, (token_id, request) in enumerate(zip(token_ids, requests)):
            k = request.params.logprobs
            if k is not None:
                with isolated(errors, row):
                    result[row] = position_logprobs(logprobs[row], token_id, k)
        return result

    # ---- logits processors ----

    def _process(self, logits: torch.Tensor, requests: Sequence[Request], errors: dict[int, Exception],
                 constrained: frozenset[int] = frozenset()) -> torch.Tensor:
        needs = [r.params.processes_logits or r.num_output_tokens < r.params.min_tokens for r in requests]
        if not any(needs):
            return logits
        logits = logits.clone()
        for row, request in enumerate(requests):
            if needs[row]:
                with isolated(errors, row):
                    process_row(logits[row], request, row in constrained)
        restricted = [row for row, r in enumerate(requests) if needs[row] and row not in errors and r.params.restricts]
        if restricted:  # (one look at the rows the restrictions may have emptied: one device sync a step)
            for row, left in zip(restricted, torch.isfinite(logits[restricted]).any(dim=-1).tolist()):
                if not left:
                    errors[row] = NoTokenLeftError.of(requests[row].params, row in constrained)
        return logits

    # ---- random sampling ----

    def _random(self, logits: torch.Tensor, requests: Sequence[Request], errors: dict[int, Exception]) -> torch.Tensor:
        """One token per row drawn from its processed distribution (greedy rows' draws are
        discarded by the caller)."""
        params = [r.params for r in requests]
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=logits.device)
        logits = logits / temperature[:, None]
        if any(p.min_p > 0 for p in params):  # (before top-p, as vLLM: its nucleus is of what min-p leaves)
            min_p = torch.tensor([p.min_p for p in params], device=logits.device)
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            logits = apply_top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
        return inverse_cdf_sample(logits.softmax(dim=-1), self._uniforms(requests, errors, logits.device))

    def _uniforms(self, requests: Sequence[Request], errors: dict[int, Exception], device) -> torch.Tensor:
        """One float64 in [0, 1) per row: from the request's own generator where it is seeded."""
        u = torch.empty(len(requests), dtype=torch.float64, device=device)
        if any(r.params.seed is None for r in requests):
            u.uniform_(generator=self.generator)
        for row, request in enumerate(requests):
            if request.params.seed is not None:
                with isolated(errors, row):
                    u[row:row + 1].uniform_(generator=self._generator_for(request))
        return u

    def _generator_for(self, request: Request) -> torch.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(request.params.seed)
            self._generators[request.request_id] = gen
        return gen


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first index whose cumulative probability exceeds ``u[i]`` times the
    row's total (so rows need not sum exactly to 1). A zero-probability token has an empty
    interval and is never chosen, except through rounding at the very top of the range
    (u within ~1e-16 of 1); such a row takes its most likely token instead."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = (u * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
    impossible = probs.gather(1, tokens) <= 0
    if impossible.any():
        tokens = torch.where(impossible, probs.argmax(dim=-1, keepdim=True), tokens)
    return tokens.squeeze(1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set to -inf, in place, what ``bitmask`` forbids in the ``rows`` of ``logits``: row ``j``
    of ``bitmask`` (int32 words, bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed,
    xgrammar's layout) masks ``logits[rows[j]]``. Tokens past the mask's width are forbidden.
    xgrammar's kernel does the masking (10x a torch unpack on CPU; its own kernel on GPU)."""
    import xgrammar

    rows = list(rows)
    width = bitmask.shape[1] * 32
    if width < logits.shape[1]:
        logits[rows, width:] = float("-inf")
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)  # one row per logits row
    full[rows] = bitmask
    xgrammar.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True),
                                         vocab_size=min(width, logits.shape[1]), indices=rows)


def process_row(logits: torch.Tensor, request: Request, constrained: bool = False) -> None:
    """Apply one request's logit bias, min_tokens mask and penalties to its logits row, in place
    (``constrained``: its grammar mask is already applied). Restrictions that leave no token
    are the caller's to find (``Sampler`` looks at every row at once)."""
    params = request.params
    if params.allowed_token_ids is not None:
        ids = torch.tensor(params.allowed_token_ids, device=logits.device)
        kept = logits[ids]
        logits.fill_(float("-inf"))
        logits[ids] = kept
    if params.bad_words_token_ids:
        logits[_bad_words_due(params.bad_words_token_ids, request)] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        biases = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        logits.index_add_(0, ids, biases)
    if request.num_output_tokens < params.min_tokens:
        stops = list(params.stop_token_ids)
        if request.eos_token_id is not None and not params.ignore_eos:
            stops.append(request.eos_token_id)
        if stops:
            ids = torch.tensor(stops, device=logits.device)
            kept = logits[ids]
            logits[ids] = float("-inf")
            if constrained and not torch.isfinite(logits).any():
                logits[ids] = kept  # the grammar allows nothing but to stop: min_tokens cannot hold
    if params.needs_penalties:
        _apply_penalties(logits, request)


class NoTokenLeftError(InvalidParameterError):
    """A request's restrictions exclude every token at a position: the caller's parameters are
    at fault (a 400), though only sampling could tell."""

    @classmethod
    def of(cls, params, constrained: bool) -> NoTokenLeftError:
        return cls("allowed_token_ids" if params.allowed_token_ids is not None else "bad_words",
                   "no token is left to sample: allowed_token_ids and bad_words" +
                   (" (with the structured output's grammar)" if constrained else "") +
                   " exclude every token the model may write next")


def _bad_words_due(sequences: list[list[int]], request: Request) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far."""
    output = request.output_token_ids if request.params.reads_output else []
    due = []
    for ids in sequences:
        k = len(ids) - 1
        if k == 0 or (len(output) >= k and output[-k:] == ids[:-1]):
            due.append(ids[-1])
    return due


def _apply_penalties(logits: torch.Tensor, request: Request) -> None:
    params = request.params
    vocab = logits.shape[0]
    device = logits.device
    output = torch.tensor(request.output_token_ids, dtype=torch.long, device=device)
    counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype)
    if params.repetition_penalty != 1:
        prompt = torch.tensor(request.prompt_token_ids, dtype=torch.long, device=device)
        seen = (torch.bincount(prompt, minlength=vocab)[:vocab] > 0) | (counts > 0)
        penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k and top-p nucleus."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    k = torch.tensor([vocab if kk <= 0 else min(kk, vocab) for kk in top_k], device=logits.device)
    kth_smallest_kept = sorted_logits.gather(1, (vocab - k)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_smallest_kept, float("-inf"))
    p = torch.tensor(top_p, device=logits.device, dtype=logits.dtype)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside = cumulative <= (1 - p)[:, None]
    outside[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def position_logprobs(logprobs: torch.Tensor, token_id: int, k: int) -> TokenLogprobs:
    """The chosen token's logprob and rank plus the top ``k`` alternatives, from one ``[vocab]`` row."""
    chosen = logprobs[token_id]
    rank = int((logprobs > chosen).sum()) + 1
    if k > 0:
        top = logprobs.topk(k)
        top_ids, top_values = tuple(top.indices.tolist()), tuple(top.values.tolist())
    else:
        top_ids, top_values = (), ()
    return TokenLogprobs(token_id, float(chosen), rank, top_ids, top_values)
