"""Sampler: each logits processor and sampling rule on hand-made logits."""

from __future__ import annotations

import pytest
import torch

from engine.runner.requests import RunnerRequest
from engine.runner.sampler import Sampler, apply_token_bitmask, apply_top_k_top_p, argmax_rows, inverse_cdf_sample
from engine.sampling_params import MAX_SEED, MIN_SEED, SamplingParams
from tests.conftest import fail_logits_processing

VOCAB = 8


def req(request_id="r", prompt=(1, 2), output=(), **params) -> RunnerRequest:
    """The runner's state of a request at the step that samples its next token."""
    params.setdefault("max_tokens", 16)
    tokens = [*prompt, *output]
    return RunnerRequest(request_id, list(prompt), SamplingParams(**params), eos_token_id=7, num_prompt_logprobs=0,
                         token_ids=tokens, num_tokens=len(tokens))


def logits_of(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


ROW = [0.0, 1.0, 3.0, 2.0, 0.5, -1.0, 0.0, 2.5]


def test_greedy_takes_the_argmax():
    assert Sampler(0)(logits_of(ROW, ROW[::-1]), [req(temperature=0), req(temperature=0)]).token_ids == [2, 5]


def test_greedy_rows_take_torchs_argmax_with_its_ties_and_nans():
    """argmax_rows (numpy's on the CPU) picks what torch.argmax does: the first of equal values,
    a NaN over any number, a row of -inf's first entry; on strided rows and on bf16 too."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=gen)
    logits[1, 10] = logits[1, 20] = logits[1].max() + 1  # a tie: the first
    logits[2, 300] = logits[2, 40] = float("nan")  # NaNs: the first NaN
    logits[3] = float("-inf")
    logits[4, 5:9] = float("inf")
    logits[5] = logits[5].round()  # many ties at the top
    want = logits.argmax(dim=-1).tolist()
    assert argmax_rows(logits) == want and want[1] == 10 and want[2] == 40 and want[3] == 0 and want[4] == 5
    assert argmax_rows(logits[:, ::2]) == logits[:, ::2].argmax(dim=-1).tolist()
    assert argmax_rows(logits[[4, 1]]) == [5, 10]
    assert argmax_rows(logits.bfloat16()) == logits.bfloat16().argmax(dim=-1).tolist()


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=0.01), dict(min_p=1.0)])
def test_cuts_that_leave_one_token_act_greedy(params):
    sampler = Sampler(0)
    tokens = [sampler(logits_of(ROW), [req(temperature=1.5, **params)]).token_ids[0] for _ in range(20)]
    assert set(tokens) == {2}


def test_top_k_top_p_mask():
    masked = apply_top_k_top_p(logits_of(ROW, ROW), [3, 0], [1.0, 0.5])
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [2, 3, 7]
    probs = logits_of(ROW).softmax(-1)[0]
    kept = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert 2 in kept and probs[kept].sum() >= 0.5 and probs[kept].sum() - probs[kept].min() < 0.5


def test_temperature_sampling_follows_the_distribution():
    sampler = Sampler(0)
    probs = logits_of(ROW).softmax(-1)[0]
    n = 4000
    draws = sampler(logits_of(*[ROW] * n), [req(temperature=1.0) for _ in range(n)]).token_ids
    counts = torch.bincount(torch.tensor(draws), minlength=VOCAB).float() / n
    assert torch.allclose(counts, probs, atol=0.03)



def test_min_p_cuts_before_top_p_takes_its_nucleus():
    """vLLM's order: min-p drops the tail, then top-p takes its nucleus of what is left. Here
    min-p leaves 0.5, 0.3, 0.1 (0.56, 0.33, 0.11 of what is left): top-p 0.85 keeps the first two.
    (top-p first would keep all three: 0.5 + 0.3 < 0.85 of the whole.)"""
    row = torch.tensor([0.5, 0.3, 0.1] + [0.1 / 1000] * 1000).log().tolist()
    n = 3000
    draws = Sampler(0)(logits_of(*[row] * n), [req(temperature=1.0, top_p=0.85, min_p=0.1)] * n).token_ids
    counts = torch.bincount(torch.tensor(draws), minlength=len(row)).float() / n
    assert counts[2:].sum() == 0
    assert counts[0] == pytest.approx(0.5 / 0.8, abs=0.04)

def test_a_skewed_distribution_is_followed_down_to_its_small_probabilities():
    probs = torch.tensor([0.9, 0.0, 0.09, 0.0, 0.009, 0.001, 0.0])
    n = 200_000
    draws = inverse_cdf_sample(probs.expand(n, -1), torch.rand(n, dtype=torch.float64,
                                                                generator=torch.Generator().manual_seed(1)))
    counts = torch.bincount(draws, minlength=probs.numel()).double() / n
    assert counts[[1, 3, 6]].sum() == 0
    # Within 5 standard errors of each probability.
    assert torch.all((counts - probs).abs() <= 5 * (probs * (1 - probs) / n).sqrt() + 1e-12)


def test_the_ends_of_the_uniform_range_never_pick_an_impossible_token():
    # Zero-probability tokens at both ends of the vocabulary, and rows that do not sum to 1.
    probs = torch.tensor([[0.0, 0.25, 0.5, 0.0], [0.0, 0.0, 0.7, 0.0], [0.3, 0.0, 0.0, 0.0]])
    top = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    for u in (0.0, top.item(), 1.0):
        tokens = inverse_cdf_sample(probs, torch.full((3,), u, dtype=torch.float64)).tolist()
        assert all(probs[row, t] > 0 for row, t in enumerate(tokens)), (u, tokens)
    assert inverse_cdf_sample(probs, torch.zeros(3, dtype=torch.float64)).tolist() == [1, 2, 0]


def test_a_batch_mixing_greedy_and_sampled_rows():
    sampler = Sampler(0)
    rows = [req("g", temperature=0), req("s", temperature=1.0, top_k=1), req("t", temperature=1.0, top_k=2)]
    for _ in range(10):
        tokens = sampler(logits_of(ROW, ROW[::-1], ROW), rows).token_ids
        assert tokens[0] == 2 and tokens[1] == 5 and tokens[2] in (2, 7)


def test_seeded_rows_do_not_depend_on_the_batch():
    alone = [Sampler(0)(logits_of(ROW), [req("a", temperature=1.0, seed=5)]).token_ids[0] for _ in range(1)]
    sampler = Sampler(123)
    batch = sampler(logits_of(ROW[::-1], ROW, ROW), [req("x", temperature=1.0), req("a", temperature=1.0, seed=5),
                                                    req("y", temperature=1.0, seed=6)])
    assert batch.token_ids[1] == alone[0]
    # The generator carries on between steps of the same request (draws from a flat row differ),
    # and forget() starts it again from the seed.
    s = Sampler(0)
    draws = lambda: [s(logits_of([0.0] * VOCAB), [req("a", temperature=1.0, seed=5)]).token_ids[0] for _ in range(5)]
    seq = draws()
    assert len(set(seq)) > 1, seq
    s.forget(["a"])
    assert draws() == seq


def test_logit_bias_and_min_tokens():
    s = Sampler(0)
    assert s(logits_of(ROW), [req(temperature=0, logit_bias={5: 10})]).token_ids == [5]
    biased_to_eos = dict(temperature=0, logit_bias={7: 50}, stop_token_ids=[2])
    assert s(logits_of(ROW), [req(**biased_to_eos)]).token_ids == [7]
    # While fewer than min_tokens are out, EOS and stop tokens are masked.
    assert s(logits_of(ROW), [req(min_tokens=2, output=(1,), **biased_to_eos)]).token_ids == [3]
    assert s(logits_of(ROW), [req(min_tokens=1, output=(1,), **biased_to_eos)]).token_ids == [7]


def test_allowed_token_ids_leave_only_those_tokens():
    s = Sampler(0)
    assert s(logits_of(ROW), [req(temperature=0, allowed_token_ids=[0, 4, 5])]).token_ids == [4]
    rows = [req(f"r{i}", temperature=5.0, allowed_token_ids=[1, 5]) for i in range(64)]
    assert set(s(logits_of(*[ROW] * 64), rows).token_ids) == {1, 5}  # (p = 0.6 / 0.4: both drawn)



@pytest.mark.parametrize("params", [dict(temperature=1e30), dict(temperature=1.0, repetition_penalty=1e-30),
                                    dict(temperature=1.0, repetition_penalty=1e30)])
def test_extreme_scales_keep_the_masks(params):
    """At the bounds of temperature and repetition_penalty no logit overflows to NaN (a row of
    NaNs samples a token no mask allows); past them a value is refused."""
    from engine.errors import InvalidParameterError

    rows = [req(allowed_token_ids=[3, 4], output=(2, 3, 0), **params) for _ in range(64)]
    tokens = Sampler(0)(logits_of(*[[100.0, 0.0, -100.0, 50.0, 0.0, 60.0, 1.0, 2.0]] * 64), rows).token_ids
    assert set(tokens) <= {3, 4}
    name, value = next((k, v) for k, v in params.items() if v != 1.0)
    with pytest.raises(InvalidParameterError) as refused:
        SamplingParams(**{name: value * 10 if value > 1 else value / 10})
    assert refused.value.param == name

def test_bad_words_ban_their_last_token_where_the_output_ends_with_the_rest():
    s = Sampler(0)
    greedy = dict(temperature=0, bad_words_token_ids=[[2], [4, 7], [1, 4, 3]])  # (ROW's order: 2, 7, 3, 1, 4)
    assert s(logits_of(ROW), [req(**greedy)]).token_ids == [7]  # a one-token word: always banned
    assert s(logits_of(ROW), [req(output=(4,), **greedy)]).token_ids == [3]
    assert s(logits_of(ROW), [req(output=(1, 4), **greedy)]).token_ids == [1]
    assert s(logits_of(ROW), [req(prompt=(1, 4), **greedy)]).token_ids == [7]  # (the output's words only, as vLLM)


def test_restrictions_that_leave_no_token_fail_that_row_only():
    rows = [req("none", temperature=0, allowed_token_ids=[7], min_tokens=2), req("fine", temperature=0)]
    out = Sampler(0)(logits_of(ROW, ROW), rows)
    assert list(out.errors) == [0] and "no token is left to sample" in str(out.errors[0])
    assert out.token_ids[1] == 2


def test_penalties_match_their_definitions():
    s = Sampler(0)
    logits = logits_of(ROW)
    # frequency: token 2 seen twice -> 3.0 - 2 * 1.0 = 1.0, below token 7's 2.5
    assert s(logits, [req(temperature=0, output=(2, 2), frequency_penalty=1.0)]).token_ids == [7]
    # presence: a flat -1.6 for any seen token: 3.0 - 1.6 = 1.4 < 2.0
    assert s(logits, [req(temperature=0, output=(2, 7), presence_penalty=1.6)]).token_ids == [3]
    # repetition (prompt tokens count too): 3.0 / 2 = 1.5 < 2.5
    assert s(logits, [req(temperature=0, prompt=(2,), repetition_penalty=2.0)]).token_ids == [7]
    assert torch.equal(logits, logits_of(ROW))  # the caller's logits are not modified


def test_logprobs_report_raw_model_values_and_rank():
    out = Sampler(0)(logits_of(ROW), [req(temperature=0, logprobs=2, logit_bias={5: 10})])
    lp = out.logprobs[0]
    raw = logits_of(ROW).log_softmax(-1)[0]
    assert lp.token_id == 5 and lp.logprob == pytest.approx(raw[5].item())
    assert lp.rank == 8  # the least likely token of the raw distribution
    assert lp.top_ids == (2, 7)


def test_every_valid_seed_gives_a_generator():
    rows = [req(f"r{i}", temperature=1.0, seed=seed) for i, seed in enumerate([MAX_SEED, MIN_SEED, 0])]
    out = Sampler(0)(logits_of(*[ROW] * 3), rows)
    assert out.errors == {} and len(out.token_ids) == 3


def test_an_error_in_one_rows_processing_fails_that_row_only(monkeypatch):
    fail_logits_processing(monkeypatch, lambda r: r.request_id == "bad")
    rows = [req("good", temperature=0, logit_bias={1: 100}), req("bad", temperature=0, logit_bias={1: 100}),
            req("plain", temperature=0)]
    out = Sampler(0)(logits_of(ROW, ROW, ROW), rows)
    assert list(out.errors) == [1] and "injected" in str(out.errors[1])
    assert out.token_ids[0] == 1 and out.token_ids[2] == 2  # the others sampled as usual


@pytest.mark.parametrize("words", [3, 2])  # wider than the 70-token vocabulary, and narrower
def test_the_token_bitmask_forbids_what_its_bits_do_not_allow(words):
    vocab = 70
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, words), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab, generator=gen)
    ours = logits.clone()
    apply_token_bitmask(ours, bitmask, [2, 0])
    assert torch.equal(ours[1], logits[1])  # a row not named is left alone
    for mask_row, row in ((0, 2), (1, 0)):
        allowed = [t for t in range(min(vocab, 32 * words)) if (int(bitmask[mask_row, t // 32]) >> (t % 32)) & 1]
        assert 0 < len(allowed) < vocab
        assert torch.isfinite(ours[row]).nonzero().flatten().tolist() == allowed
        assert torch.equal(ours[row, allowed], logits[row, allowed])
