"""Speculative decoding (engine/speculative.py): the n-gram proposer, the configuration and its
errors, the same output with and without proposals on the real model (greedy on the cpu and
torch backends, n-gram and draft-model proposals; seeded sampling with every sampling
parameter), the sampled distribution (a chi-square test that fails when the rule is broken), KV
blocks after rejections, preemption and aborts, and the counters."""

from __future__ import annotations

import logging
import random
import subprocess
import sys

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.errors import ConfigError
from engine.sampling_params import SamplingParams
from engine.speculative import NgramIndex, SpeculativeConfig
from tests.conftest import NEAR_TIE, run_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


# ---- the proposer ----

def ngram_drafts(token_ids: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """What a request's index proposes for a list it sees whole."""
    return NgramIndex(min_n, max_n).drafts(token_ids, num_drafts)


def test_ngram_drafts_follow_the_latest_earlier_occurrence_of_the_longest_suffix():
    assert ngram_drafts([1, 2, 3, 4, 5, 9, 9, 1, 2, 3], 3, 2, 4) == [4, 5, 9]
    # The latest earlier occurrence: [7, 8] occurs twice; what followed the second is proposed.
    assert ngram_drafts([7, 8, 1, 7, 8, 2, 7, 8], 2, 2, 2) == [2, 7]
    # ... unless it is too near the end to give as many as asked: then the first.
    assert ngram_drafts([7, 8, 1, 2, 3, 7, 8, 4, 7, 8], 3, 2, 2) == [4, 7, 8]
    assert ngram_drafts([7, 8, 1, 2, 3, 7, 8, 4, 7, 8], 4, 2, 2) == [1, 2, 3, 7]
    assert ngram_drafts([9, 9, 9, 9, 9], 3, 2, 4) == [9]  # (no occurrence has 3 after it: the first's 1)
    # The longest n-gram wins over a later, shorter one: [3, 7, 8] is matched at its only place.
    assert ngram_drafts([3, 7, 8, 5, 7, 8, 6, 3, 7, 8], 1, 2, 3) == [5]
    assert ngram_drafts([1, 2, 3], 3, 2, 4) == []  # nothing occurs twice
    assert ngram_drafts([5, 6, 5, 6], 8, 2, 4) == [5, 6]  # as many as there are
    assert ngram_drafts([5, 6, 5, 6], 0, 2, 4) == []


def _drafts_by_scan(tokens: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """What prompt lookup proposes, by the plainest scan: the longest suffix of max_n .. min_n
    tokens that occurs earlier with a token after it; its latest such place with num_drafts
    tokens after it, else its first."""
    size = len(tokens)
    if num_drafts < 1:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        places = [i for i in range(size - n) if tokens[i:i + n] == tokens[size - n:]]
        if places:
            roomy = [i for i in places if i + n + num_drafts <= size]
            start = (roomy[-1] if roomy else places[0]) + n
            return tokens[start:start + num_drafts]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_a_request_s_ngram_index_proposes_what_a_scan_of_its_tokens_does_as_they_grow(seed):
    """One index per request, fed its growing list (a token or a few kept drafts at a time):
    at every length it proposes what a scan of the whole list does (few symbols: many repeats,
    so the latest-with-room and first-occurrence rules are both exercised)."""
    rng = random.Random(seed)
    min_n = rng.randint(1, 3)
    max_n = rng.randint(min_n, 5)
    index, tokens = NgramIndex(min_n, max_n), []
    checked = proposed = 0
    while len(tokens) < 300:
        tokens += [rng.randrange(4) for _ in range(rng.choice((1, 1, 1, 2, 5)))]
        num_drafts = rng.randint(0, 6)
        expected = _drafts_by_scan(tokens, num_drafts, min_n, max_n)
        assert index.drafts(tokens, num_drafts) == expected, (len(tokens), num_drafts)
        checked, proposed = checked + 1, proposed + bool(expected)
    assert proposed > checked // 2
    # Each place of each n-gram with a token after it is held once (as of a lookup).
    index.drafts(tokens, 1)
    assert sum(map(len, index._starts.values())) == sum(len(tokens) - n for n in range(min_n, max_n + 1))
    # A shorter list (not a request's: its tokens only grow) is indexed again from its start,
    # even when it asks for nothing.
    assert index.drafts(tokens[:2], 0) == []
    other = [rng.randrange(4, 8) for _ in range(40)]
    assert index.drafts(other, 3) == _drafts_by_scan(other, 3, min_n, max_n)


@pytest.mark.parametrize("value, words", [
    ('{"method": "eagle", "num_speculative_tokens": 3}', "unknown speculative method 'eagle'"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "at least 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "foo": 1}', "unknown key(s) foo"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
     "prompt_lookup_min (5) exceeds"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs 'model'"),
    ('{"model": "/no/such/model", "num_speculative_tokens": 2}', "'/no/such/model' not found"),
    ('{"model": "tests", "num_speculative_tokens": 2, "prompt_lookup_min": 2}', "belong(s) to method 'ngram'"),
    ('{"method": "ngram", "model": "tests", "num_speculative_tokens": 2}', "'model' belongs to method 'draft_model'"),
    ("[1]", "must be a JSON object"),
    ("{", "not valid JSON"),
])
def test_a_wrong_config_is_refused_naming_what_is_wrong(value, words):
    with pytest.raises(ConfigError, match="speculative_config") as info:
        EngineConfig(speculative_config=value)
    assert words in str(info.value)


def test_the_server_refuses_a_wrong_config_in_one_line():
    run = subprocess.run([sys.executable, "-m", "engine.api", "--speculative-config", '{"method": "medusa"}'],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == ("error: speculative_config: unknown speculative method 'medusa'; "
                                                   "known: ngram, draft_model")


# ---- the real model: the same output with and without proposals ----

@pytest.fixture(scope="module")
def model():
    from engine.models.loader import load_model, resolve_model

    return load_model(resolve_model(None), "auto", torch.float32, "cpu", 0, activation_quantization="none")


def _prompts(tokenizer) -> list[list[int]]:
    """50 chat prompts: plain questions, code to write, and text to copy with one change (where
    the n-gram proposals are kept)."""
    topics = ["the sea", "a lighthouse", "autumn", "a cat", "the moon", "trains", "bread", "rain", "chess",
              "a river", "bees", "winter", "a library", "volcanoes", "the desert", "owls", "tea"]
    code = ["reverses a string", "sums a list", "checks for a prime", "counts vowels", "merges two dicts",
            "flattens a list", "finds the maximum", "computes a factorial", "reads a file", "sorts words",
            "removes duplicates", "computes fibonacci numbers", "parses a date", "capitalizes words",
            "joins paths", "counts lines"]
    texts = ["def area(width, height):\n    result = width * height\n    return result\n\nprint(area(2, 3))",
             "The keeper climbed the stairs every evening to light the lamp, and he never missed a night.",
             "for item in items:\n    if item.ready:\n        process(item)\n    else:\n        skip(item)",
             "Dear Sam, thank you for the books. I read the first one twice and I liked it very much.",
             "x = load()\ny = clean(x)\nz = train(y)\nsave(z)\nprint('done')"]
    changes = ["rename the variables", "use single quotes", "make it shorter", "add a comment"]
    messages = [f"Tell me about {t}." for t in topics]
    messages += [f"Write a Python function that {c}." for c in code]
    messages += [f"Copy this with one change ({c}):\n\n{t}" for t in texts for c in changes[:3]] + \
                [f"Repeat exactly: {texts[1]}", f"Repeat exactly: {texts[3]}"]
    assert len(messages) == 50
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                           add_generation_prompt=True) for m in messages]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def _run(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> list[tuple[list[int], list]]:
    """Each prompt's tokens and their logprobs, the prompts all queued at once; no block left."""
    outputs = run_prompts(core, prompts, params)
    assert core.block_manager.num_used_blocks == 0
    core.block_manager.check_invariants()
    return outputs


_PLAIN: dict[tuple, list] = {}


def _plain(model, backend: str, prompts: list[list[int]], params: SamplingParams) -> list[tuple[list[int], list]]:
    """``_run`` without proposals, kept per backend, prompts and parameters (several tests and
    parametrizations compare against the same run)."""
    key = (id(model), backend, str(prompts), repr(params))
    if key not in _PLAIN:
        _PLAIN[key] = _run(_core(model, backend, None), prompts, params)
    return _PLAIN[key]


def _core(model, backend: str, speculative: dict | None, **fields) -> EngineCore:
    config = dict(backend=backend, dtype="float32", kv_cache_dtype="float32", num_kv_blocks=1024, max_num_seqs=16,
                  max_num_batched_tokens=512, speculative_config=speculative)
    return EngineCore(EngineConfig(**{**config, **fields}), model=model)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_output_is_the_same_with_proposals(model, tokenizer, backend):
    """Proposals in every batch (disable_by_batch_size above the batch): the tokens are those of
    the engine without them, but where the two first part at a near-tie of the run without
    (the verifying pass computes a position in another batch shape: DESIGN.md's rule)."""
    prompts = _prompts(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
    plain = _plain(model, backend, prompts, params)
    core = _core(model, backend, {**NGRAM, "disable_by_batch_size": 64})
    drafted = _run(core, prompts, params)
    stats = core.stats()
    assert stats.spec_num_accepted_tokens > 0.3 * stats.spec_num_draft_tokens  # proposals were made and kept
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    identical = 0
    for i, ((want, want_lps), (got, _)) in enumerate(zip(plain, drafted)):
        if got == want:
            identical += 1
            continue
        step = next(s for s, (a, b) in enumerate(zip(got, want)) if a != b)
        alternatives = dict(zip(want_lps[step].top_ids, want_lps[step].top_logprobs))
        assert got[step] in alternatives and alternatives[want[step]] - alternatives[got[step]] < NEAR_TIE, \
            f"prompt {i} parted at step {step}: {got[step]} for {want[step]}, no near-tie"
    assert identical >= 45


@pytest.mark.slow
def test_batch_invariant_proposals_give_the_same_bits_with_an_int8_cache(model, tokenizer):
    """With the int8 cache a verifying pass's last-bit differences become rounding steps of the
    cached keys and values (~1e-2 in a logprob), so without --batch-invariant texts can part
    (docs/guide.md); with it every position is computed as a one-token step computes it: the
    same tokens and logprobs, bit for bit."""
    prompts = _prompts(tokenizer)[::5]  # plain, code and copy prompts alike
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
    fields = dict(kv_cache_dtype="int8", batch_invariant=True)
    plain = _run(_core(model, "cpu", None, **fields), prompts, params)
    core = _core(model, "cpu", {**NGRAM, "disable_by_batch_size": 64}, **fields)
    drafted = _run(core, prompts, params)
    assert core.stats().spec_num_accepted_tokens > 20
    for (want, want_lps), (got, got_lps) in zip(plain, drafted):
        assert got == want
        assert [(p.logprob, p.top_logprobs) for p in got_lps] == [(p.logprob, p.top_logprobs) for p in want_lps]


@pytest.fixture(scope="session")
def random_draft(tmp_path_factory) -> str:
    """A random-weight Llama with the default model's vocabulary, saved as a model directory: a
    draft model whose proposals are nearly always rejected."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("random-draft")
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return str(directory)


def _draft(path: str) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": 3, "disable_by_batch_size": 64}


@pytest.mark.slow
@pytest.mark.parametrize("backend, draft", [("cpu", "itself"), ("cpu", "random"), ("torch", "random")])
def test_greedy_output_is_the_same_with_a_draft_model(model, tokenizer, random_draft, backend, draft):
    """The default model as its own draft (every proposal should be kept: the draft's KV cache,
    kept over the target's block tables, must be right for that) and a random-weight draft (nearly
    every proposal rejected): the tokens of the engine without proposals, over 50 prompts."""
    from engine.models.loader import default_model_path

    prompts = _prompts(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=16)
    plain = _plain(model, backend, prompts, params)
    path = str(default_model_path()) if draft == "itself" else random_draft
    core = _core(model, backend, _draft(path))
    drafted = _run(core, prompts, params)
    stats = core.stats()
    assert stats.spec_num_draft_tokens > 200 and sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    if draft == "itself":
        assert stats.spec_num_accepted_tokens > 0.9 * stats.spec_num_draft_tokens
    else:
        assert stats.spec_num_accepted_tokens < 0.2 * stats.spec_num_draft_tokens
    same = sum(got == want for (want, _), (got, _) in zip(plain, drafted))
    assert same >= 48  # (two may part at a near-tie: the verifying pass has another batch shape)


def test_the_drafter_catches_up_on_what_it_missed_and_trusts_no_block_written_while_it_sat_out(tiny_model):
    """The drafter's bookkeeping, its passes recorded (blocks of 4 tokens): a request computed,
    then two paused steps, then proposals again: the pass starts at its first missed position.
    A block the draft had filled, given to another request and written while the draft sat
    out, is no prefix to trust: a request that hits it is computed from position 0. Missed
    tokens past the budget wait for the next pass, their row proposing nothing meanwhile."""
    from backends import get_backend
    from backends.kv_cache import same_as
    from engine.runner.drafter import Drafter, DraftRow

    drafter = Drafter(tiny_model, get_backend("torch", "cpu"), 16, 4, "cpu", same_as(torch.float32), 2, 4,
                      max_catch_up=5)
    passes = []

    def forward(rows, tokens, positions, tables, sample):
        passes.append([(row.request_id, span.start, tuple(t)) for row, t, span in zip(rows, tokens, positions)])
        return [7] * len(sample)

    drafter._forward = forward
    a = tuple(range(100, 110))
    drafter.admit("a", a)
    assert drafter.run([DraftRow("a", 0, (*a, 110), (0, 1, 2), True)], 2) == {"a": (7, 7)}
    assert passes[0] == [("a", 0, (*a, 110))] and drafter.filled[:3] == [4, 4, 2]
    passes.clear()
    for position in (10, 11):  # (paused: no pass)
        assert drafter.run([DraftRow("a", position, (100 + position,), (0, 1, 2), False)], 0) == {}
    assert not passes and drafter.filled[:3] == [4, 4, 2]
    drafter.run([DraftRow("a", 12, (112, 113), (0, 1, 2, 3), True)], 2)
    assert passes[0][0] == ("a", 10, (110, 111, 112, 113))  # (from its first missed position)
    assert drafter.filled[:4] == [4, 4, 4, 1]

    drafter.forget(["a"])  # (block 1, filled for "a", goes to "b", written while paused)
    drafter.admit("b", (200, 201, 202, 203, 204))
    drafter.run([DraftRow("b", 0, (200, 201, 202, 203, 204), (1, 5), False)], 0)
    assert drafter.filled[1] == 0 and drafter.filled[5] == 0
    passes.clear()
    drafter.admit("c", (200, 201, 202, 203, 300, 301))  # (a prefix hit on block 1)
    drafter.run([DraftRow("c", 4, (300, 301, 302), (1, 6), True)], 2)
    assert passes[0][0] == ("c", 0, (200, 201, 202, 203, 300, 301, 302))

    passes.clear()  # (the budget: 5 missed tokens a pass)
    drafter.admit("d", tuple(range(400, 412)))
    drafter.run([DraftRow("d", 0, tuple(range(400, 408)), (8, 9), False)], 0)
    drafter.run([DraftRow("d", 8, (408, 409, 410, 411, 412), (8, 9, 10), True)], 2)
    assert passes == [[("d", 0, (400, 401, 402, 403, 404))]]  # (no proposal pass: nothing proposes)
    passes.clear()
    drafter.run([DraftRow("d", 12, (412, 413), (8, 9, 10, 11), True)], 2)
    assert passes == [[("d", 5, (405, 406, 407, 408, 409))]]  # (7 missed: 5 now)
    passes.clear()
    drafter.run([DraftRow("d", 14, (414, 415), (8, 9, 10, 11), True)], 2)
    assert passes[0][0] == ("d", 10, tuple(range(410, 416)))


def test_over_a_sliding_window_s_table_the_drafter_runs_every_step_and_catches_up_within_it(tiny_model):
    """The draft computes every step, proposals or not (blocks of 4 tokens, window 8)."""
    from backends import get_backend
    from backends.kv_cache import same_as
    from engine.runner.drafter import Drafter, DraftRow

    steady = Drafter(tiny_model, get_backend("torch", "cpu"), 16, 4, "cpu", same_as(torch.float32), 2, 4,
                     max_catch_up=5, window=8)
    passes = []

    def forward(rows, tokens, positions, tables, sample):
        passes.append([(row.request_id, span.start, tuple(t)) for row, t, span in zip(rows, tokens, positions)])
        return [7] * len(sample)

    steady._forward = forward
    steady.admit("e", (1, 2, 3))
    assert steady.run([DraftRow("e", 0, (1, 2, 3), (0,), False)], 0) == {}
    assert passes == [[("e", 0, (1, 2, 3))]] and steady.filled[0] == 3
    # A catch-up that lags past the window (its budget spent while the row ran ahead) resumes from
    # the first block the window reaches: the blocks before it are given back (other requests').
    passes.clear()
    steady.admit("f", tuple(range(500, 516)))
    steady._valid["f"] = 2  # (the lag)
    steady.run([DraftRow("f", 16, (516,), (0, 1, 2, 3, 4), True)], 2)
    assert passes[0][0] == ("f", 8, tuple(range(508, 513)))  # (not from 2: blocks 0 and 1 are out of the window)


@pytest.mark.slow
def test_a_draft_model_sits_out_large_batches_and_catches_up_when_they_shrink(model, tokenizer, monkeypatch):
    """disable_by_batch_size 3: one request decodes alone with proposals, then nine more of its
    prefix arrive (each asking for 6 tokens more than the last) and the draft model runs no
    forward pass while more than three run; as they finish, proposals resume for the last ones,
    whose draft KV (the prefix, what they and the first request computed meanwhile) is caught up
    first. The model as its own draft then has its proposals kept as if it had never paused; the
    tokens are those without proposals (but where a near-tie parts them: another batch shape)."""
    from engine.models.loader import default_model_path
    from engine.runner.drafter import Drafter

    passes, steps = [0], []  # (proposals asked for, the draft's forward passes) per step
    real_forward, real_run = Drafter._forward, Drafter.run

    def forward(self, *args):
        passes[0] += 1
        return real_forward(self, *args)

    def run(self, rows, num_proposals):
        before = passes[0]
        proposals = real_run(self, rows, num_proposals)
        steps.append((num_proposals, passes[0] - before))
        return proposals

    monkeypatch.setattr(Drafter, "_forward", forward)
    monkeypatch.setattr(Drafter, "run", run)
    shared = _prompts(tokenizer)[-7]
    prompts = [shared + p[-6:] for p in _prompts(tokenizer)[:10]]

    def tokens(core: EngineCore) -> list[list[int]]:
        out = {str(i): [] for i in range(len(prompts))}

        def step() -> None:
            for delta in core.step():
                out[delta.request_id] += delta.new_token_ids

        core.add_request("9", prompts[9], SamplingParams(temperature=0, max_tokens=70, ignore_eos=True))
        for _ in range(6):
            step()
        for i, prompt in enumerate(prompts[:9]):
            core.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=6 * (i + 1), ignore_eos=True))
        while core.has_unfinished_requests:
            step()
        assert core.block_manager.num_used_blocks == 0
        return [out[str(i)] for i in range(len(prompts))]

    plain = tokens(_core(model, "cpu", None))
    steps.clear()
    core = _core(model, "cpu", {**_draft(str(default_model_path())), "disable_by_batch_size": 3})
    drafted = tokens(core)
    asked = [n > 0 for n, _ in steps]
    paused = asked.index(False)
    resumed = asked.index(True, paused)
    assert paused >= 2 and resumed - paused >= 10  # (on, then paused for a while, then on again)
    assert not any(n for a, n in steps if a == 0)  # (no pass of the draft model while paused)
    stats = core.stats()
    assert stats.prefix_cache_hits > 0 and stats.spec_num_draft_tokens > 20
    assert stats.spec_num_accepted_tokens > 0.9 * stats.spec_num_draft_tokens
    assert sum(got == want for got, want in zip(drafted, plain)) >= 9


@pytest.mark.slow
def test_a_draft_model_through_preemptions_and_a_prefix_cache_gives_the_same_tokens(model, tokenizer):
    """A cache too small for the batch (requests preempted and recomputed, the draft's cache with
    them) and prompts that share a prefix (the draft reads the cached blocks the target reuses):
    the same tokens as without proposals, proposals still kept, no block left."""
    from engine.models.loader import default_model_path

    shared = _prompts(tokenizer)[-7]
    prompts = [shared + p[-6:] for p in _prompts(tokenizer)[:10]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _run(_core(model, "cpu", None), prompts, params)
    core = _core(model, "cpu", _draft(str(default_model_path())), num_kv_blocks=24, max_num_seqs=10)
    drafted = _run(core, prompts, params)
    stats = core.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_num_accepted_tokens > 0.9 * stats.spec_num_draft_tokens
    assert [tokens for tokens, _ in drafted] == [tokens for tokens, _ in plain]


def test_a_draft_model_s_context_ending_one_past_a_block_ends_requests_cleanly(tiny_model, tmp_path):
    """A draft of 33 positions (two blocks of 16 and one) sets max_model_len: in the step that
    reaches it, the last sampled token would sit in a block the target does not hold yet (no
    proposal follows it, so no scratch blocks either); the request ends at the length limit with
    the tokens of the engine without proposals."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=33,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    core = _tiny_core(tiny_model, speculative_config={**_draft(str(tmp_path)), "disable_by_batch_size": 8})
    assert core.max_model_len == 33
    prompt, params = list(range(10, 30)), SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    [(drafted, _)] = _run(core, [prompt], params)
    [(plain, _)] = _run(_tiny_core(tiny_model, speculative_config=None, max_model_len=33), [prompt], params)
    assert drafted == plain and len(drafted) == 13 and core.stats().spec_num_drafts > 0


def _owned_blocks_only(core: EngineCore, monkeypatch) -> dict[str, list[int]]:
    """Hold every pass of the draft model to the blocks its rows' requests own (or its scratch
    blocks): each slot it writes and each key slot its layers' windows reach. Returns the
    positions the draft computed per request."""
    from engine.runner.drafter import Drafter

    real, computed = Drafter._forward, {}

    def forward(self, rows, tokens, positions, tables, sample):
        bs = self.block_size
        reach = min((layer.window or 1 << 30) for layer in self.model.layers)
        for row, table, span in zip(rows, tables, positions):
            owned = {b.block_id for t in core.block_manager.tables[row.request_id] for b in t if b.ref_count > 0}
            computed.setdefault(row.request_id, []).extend(span)
            for p in span:
                for key in range(max(p - reach + 1, 0), p + 1):
                    block = table[key // bs]
                    assert block in owned or block >= self.scratch_base, (row.request_id, p, key, block, table)
        return real(self, rows, tokens, positions, tables, sample)

    monkeypatch.setattr(Drafter, "_forward", forward)
    return computed


@pytest.mark.parametrize("draft", ["itself", "no window"])
def test_a_draft_model_over_a_sliding_window_keeps_to_the_blocks_its_requests_own(tmp_path, monkeypatch, caplog,
                                                                                     draft):
    """A model whose every layer slides (window 24, blocks of 8): its one table names blocks the
    target gave back (to other requests) and, in place of a cached prefix's blocks the window
    passed, block 0. The draft model (the model itself, or one of no window) reads and writes
    only the blocks its rows' requests own: a request hitting the prefix of an earlier one (whose
    first block went to a third request) is not caught up through block 0 (which was the third
    request's draft KV), and a draft of no window attends within the model's. The two choices of
    an n = 2 request, admitted together, share the prompt's blocks: the draft computes the prompt
    once, as the target does. The tokens are those of the engine without proposals."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    caplog.set_level(logging.INFO, "engine")
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(sliding_window=24, **shape)).save_pretrained(tmp_path / "target")
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(tmp_path / "llama")
    drafter = str(tmp_path / ("target" if draft == "itself" else "llama"))
    first, second = [10 + j * 7 % 50 for j in range(40)], [100 + j * 11 % 60 for j in range(36)]

    def tokens(speculative: dict | None) -> tuple[EngineCore, dict[str, list[int]], dict]:
        core = EngineCore(EngineConfig(model=str(tmp_path / "target"), backend="cpu", dtype="float32",
                                       kv_cache_dtype="float32", num_kv_blocks=13, block_size=8, max_num_seqs=4,
                                       max_num_batched_tokens=256, speculative_config=speculative))
        computed = _owned_blocks_only(core, monkeypatch) if speculative else {}
        out: dict[str, list[int]] = {}

        def steps(n: int) -> None:
            for _ in range(n):
                for delta in core.step():
                    out.setdefault(delta.request_id, []).extend(delta.new_token_ids)

        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        core.add_request("a", first, params)
        steps(3)  # (its first blocks pass out of the window, back to the free list)
        core.add_request("b", second, params)  # (its fifth block: block 0)
        steps(3)
        core.add_request("c", [*first, 5, 6], params)  # (a hit on a's blocks 2-4; places 0 and 1: block 0)
        steps(1)
        table = {r: [b.block_id for b in t[0]] for r, t in core.block_manager.tables.items()}
        assert table["0_c"][:2] == [0, 0] and 0 in table["0_b"]  # (choice 0 of each: "0_c")
        steps(100)
        core.add_request("d", second[:20], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2))
        steps(100)
        assert not core.has_unfinished_requests and core.block_manager.num_used_blocks == 0
        return core, out, computed

    _, plain, _ = tokens(None)
    core, drafted, computed = tokens({**_draft(drafter), "disable_by_batch_size": 8})
    assert drafted == plain and core.stats().spec_num_drafts > 0
    cut = "the draft model attends within the model's sliding window (24 tokens)"
    assert (cut in caplog.text) == (draft == "no window")
    assert sorted(min(computed[f"{i}_d"]) for i in range(2)) == [0, 16]  # (16: the choice hitting 2 blocks)
    assert min(computed["0_c"]) == 40  # (its hit read, from the block its first query's window reaches)


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_model, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ConfigError, match="vocabulary of 300 tokens.*must use the model's tokenizer"):
        _tiny_core(tiny_model, speculative_config=_draft(str(tmp_path)))


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_seeded_sampling_with_every_parameter_is_the_same_with_proposals(model, tokenizer, proposer):
    """Each position is sampled as without proposals, from the request's own draws in the same
    order: with a seed, penalties, logit bias, min_tokens, bad words (of one token and of two:
    the ban depends on the drafts before the position), top-k/p, min-p and logprobs, the tokens
    and logprobs are those of the engine without proposals."""
    prompts = _prompts(tokenizer)[-12:]
    comma = tokenizer.encode(",", add_special_tokens=False)[0]
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.02, seed=1234, max_tokens=32,
                            repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1,
                            logit_bias={comma: -2.0}, min_tokens=8, logprobs=1, bad_words=["the stairs", "result"])
    params = params.with_bad_words_tokenized(lambda word: tokenizer.encode(word, add_special_tokens=False))
    plain = _run(_core(model, "cpu", None), prompts, params)
    if proposer == "ngram":
        spec = {**NGRAM, "disable_by_batch_size": 64}
    else:
        from engine.models.loader import default_model_path

        spec = _draft(str(default_model_path()))  # (greedy proposals of the model itself, sampled targets)
    core = _core(model, "cpu", spec)
    drafted = _run(core, prompts, params)
    assert core.stats().spec_num_accepted_tokens > 0
    for (want, want_lps), (got, got_lps) in zip(plain, drafted):
        assert got == want
        assert [lp.logprob for lp in got_lps] == pytest.approx([lp.logprob for lp in want_lps], abs=1e-3)


# ---- the sampled distribution ----

def test_kept_and_sampled_tokens_follow_the_targets_distribution(monkeypatch):
    """One step of 40,000 rows on a toy vocabulary, each row's last known token followed by two
    drafts (3, then 4). Each output position must follow the target's distribution there: the
    first token p0, the second (where the first draft was kept) p1, the third (both kept: the
    bonus) p0 again; and the first draft is kept at the rate p0(3). Chi-square tests at p > 1e-3;
    a rule that also keeps a rejected draft half of the time fails them."""
    from engine.runner import model_runner

    p0, p1 = _TOY_TARGETS
    first, second, third, kept = _toy_step(monkeypatch)
    assert _chi_square_p(first, p0) > 1e-3
    assert _chi_square_p(second, p1) > 1e-3
    assert _chi_square_p(third, p0) > 1e-3
    assert _chi_square_p(torch.tensor([kept, 40_000 - kept]), torch.tensor([float(p0[3]), 1 - float(p0[3])])) > 1e-3
    generator = torch.Generator().manual_seed(0)
    monkeypatch.setattr(model_runner, "keeps_draft",
                        lambda sampled, draft: sampled == draft or bool(torch.rand(1, generator=generator) < 0.5))
    broken, _, _, _ = _toy_step(monkeypatch)
    assert _chi_square_p(broken, p0) < 1e-6


_TOY_TARGETS = (torch.tensor([0.05, 0.4, 0.1, 0.2, 0.15, 0.1]), torch.tensor([0.3, 0.1, 0.1, 0.2, 0.2, 0.1]))
_TOY_DRAFTS = (3, 4)  # the proposed tokens: p0 keeps the first 20% of the time, p1 the second 20%


def _toy_step(monkeypatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Run ``ModelRunner.execute`` with a stub model whose logits at a row's positions are
    log p0, log p1, log p0 (drafts after the last known token). Returns the counts of the
    first output token, of the second and third where there are any, and how many first
    drafts were kept."""
    from engine.plan import NewRequest, StepPlan
    from engine.runner import model_runner
    from engine.runner.model_runner import ModelRunner

    rows = 40_000
    # Positions 2, 3, 4 of each row (its last known token, then two drafts) give rows 2, 0, 1.
    logits = torch.stack([_TOY_TARGETS[1].log(), _TOY_TARGETS[0].log(), _TOY_TARGETS[0].log()])

    class Stub:
        def forward(self, input_ids, positions, *args, **kwargs):
            return (positions % 3).float()[:, None]  # hidden row = which position of its row

        def compute_logits(self, hidden):
            return logits[hidden[:, 0].long()]

    runner = ModelRunner.__new__(ModelRunner)
    runner.model, runner.backend, runner.kv_caches, runner.kv_scales, runner._calibrate = Stub(), None, [], None, False
    runner.block_size, runner.device, runner.requests, runner._block_ids, runner.drafter = 16, "cpu", {}, {}, None
    runner.block_tables = [model_runner.BlockTables()]
    runner.sampler = model_runner.Sampler(0)
    params = SamplingParams(temperature=1.0, max_tokens=8)
    ids = tuple(f"r{i}" for i in range(rows))
    plan = StepPlan(ids, (2,) * rows, (3,) * rows, (7, *_TOY_DRAFTS) * rows, tuple(range(rows)),
                    new_requests=tuple(NewRequest(i, (5, 6, 7), 3, params, None) for i in ids),
                    new_block_ids=tuple((i, (1,)) for i in ids), num_draft_tokens=(2,) * rows)
    monkeypatch.setattr(runner, "_prepare", lambda plan: _toy_batch(runner, plan, rows))
    out = runner.execute(plan)
    outputs = [(*out.accepted.get(i, ()), out.sampled[i]) for i in ids]
    counts = [torch.bincount(torch.tensor([o[n] for o in outputs if len(o) > n]), minlength=6) for n in range(3)]
    return counts[0], counts[1], counts[2], sum(1 for i in ids if i in out.accepted)


def _toy_batch(runner, plan, rows: int):
    from engine.runner.model_runner import _Batch

    for request in runner.requests.values():
        request.num_tokens = 3  # (what _prepare sets: the known tokens, up to the first sampled position)
    positions = torch.tensor([2, 3, 4] * rows)
    return _Batch(torch.tensor(plan.token_ids), positions, None, [3 * i + 2 for i in range(rows)])


def _chi_square_p(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's chi-square test of ``counts`` against probabilities ``p``: the p-value (the
    upper regularized gamma function of the statistic, len(p) - 1 degrees of freedom)."""
    expected = p.double() * counts.sum()
    statistic = ((counts.double() - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(p) - 1) / 2, dtype=torch.float64), statistic / 2))


# ---- KV blocks ----

def _tiny_core(tiny_model, **fields) -> EngineCore:
    config = dict(backend="cpu", dtype="float32", kv_cache_dtype="float32", num_kv_blocks=64, max_num_seqs=8,
                  max_num_batched_tokens=128, speculative_config={**NGRAM, "disable_by_batch_size": 8})
    return EngineCore(EngineConfig(**{**config, **fields}), model=tiny_model)


def _repetitive(i: int) -> list[int]:
    """A prompt that repeats itself, so the proposer always finds something (that the random
    model rarely keeps)."""
    return [10 + i, 20 + i, 30 + i, 40 + i, 50 + i] * 6


def _check_blocks(core: EngineCore) -> None:
    core.block_manager.check_invariants(list(core.scheduler.requests.values()))
    for request in core.scheduler.running:  # the runner was sent every block its request owns
        assert request.num_runner_blocks == len(core.block_manager.tables[request.request_id][0])


def test_rejections_and_preemptions_leave_no_block_behind(tiny_model):
    """Eight requests in 48 blocks of 16 tokens, sampled at a high temperature (the random model
    is peaked; this makes many drafts rejected): requests are preempted mid-speculation, and at
    the end no block is held."""
    core = _tiny_core(tiny_model, num_kv_blocks=48)
    params = SamplingParams(temperature=8.0, max_tokens=100, ignore_eos=True, seed=3)
    for i in range(8):
        core.add_request(str(i), _repetitive(i), params)
    outputs = {str(i): [] for i in range(8)}
    while core.has_unfinished_requests:
        for delta in core.step():
            outputs[delta.request_id] += delta.new_token_ids
        _check_blocks(core)
    stats = core.stats()
    assert stats.num_preemptions > 0 and stats.spec_num_draft_tokens > 100
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # some kept, some rejected
    assert all(len(tokens) == 100 for tokens in outputs.values())
    assert core.block_manager.num_used_blocks == 0


def test_an_abort_mid_speculation_frees_every_block(tiny_model):
    core = _tiny_core(tiny_model)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i in range(4):
        core.add_request(str(i), _repetitive(i), params)
    for _ in range(40):  # until a step is scheduled with proposals in it
        plan = core.schedule()
        if plan.plan.num_draft_tokens:
            break
        core.update(plan, core.execute(plan))
    assert plan.plan.num_draft_tokens
    core.abort_requests([str(i) for i in range(4)])  # (while the step "runs": its result comes after)
    core.update(plan, core.execute(plan))
    while core.has_unfinished_requests:
        core.step()
    core.step()  # the runner hears of the finished requests
    assert core.block_manager.num_used_blocks == 0
    assert core.runner.requests == {}
    _check_blocks(core)


def test_blocks_filled_by_kept_proposals_serve_later_prefix_hits(tiny_model):
    """A greedy run that keeps proposals registers the blocks they filled once their tokens are
    known; a later request over that text hits them and continues as a cold engine does."""
    prompt = _repetitive(1)
    warm = _tiny_core(tiny_model)
    [(first, _)] = _run(warm, [prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    assert warm.stats().spec_num_accepted_tokens > 0
    follow = prompt + first + [77, 78]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [(hit, _)] = _run(warm, [follow], params)
    assert warm.stats().prefix_cache_hits >= 16 * ((len(prompt) + len(first)) // 16 - 1)
    cold = _tiny_core(tiny_model, enable_prefix_caching=False, speculative_config=None)
    [(expected, _)] = _run(cold, [follow], params)
    assert hit == expected


# ---- counters ----

def test_the_counters_appear_in_metrics_and_add_up(tiny_model):
    from api.metrics import Metrics

    core = _tiny_core(tiny_model)
    _run(core, [_repetitive(i) for i in range(3)], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stats = core.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert len(stats.spec_accepted_per_pos) == NGRAM["num_speculative_tokens"]
    text = Metrics(lambda: [stats], "m").exposition().decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:spec_decode")}
    labels = '{engine="0",model_name="m"}'
    assert values[f"vllm:spec_decode_num_drafts_total{labels}"] == stats.spec_num_drafts
    assert values[f"vllm:spec_decode_num_draft_tokens_total{labels}"] == stats.spec_num_draft_tokens
    assert values[f"vllm:spec_decode_num_accepted_tokens_total{labels}"] == stats.spec_num_accepted_tokens
    per_pos = [values[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{p}"}}']
               for p in range(4)]
    assert per_pos == list(stats.spec_accepted_per_pos)
    # Without speculative decoding the series are not there (as in vLLM).
    plain = _tiny_core(tiny_model, speculative_config=None).stats()
    assert "spec_decode" not in Metrics(lambda: [plain], "m").exposition().decode()


def test_a_prompt_whose_first_step_keeps_drafts_is_counted_once(tiny_model, monkeypatch):
    """vllm:prompt_tokens counts a sequence's prompt at its first token, also when that step
    verifies drafts and keeps them: a prompt found in the prefix cache but for its last token
    computes that token and the drafts in one step."""
    from engine.sched.scheduler import Scheduler

    prompt = list(range(10, 43))  # two blocks of 16 and one token
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [(greedy, _)] = _run(_tiny_core(tiny_model, speculative_config=None), [prompt], params)

    def always_right(self, request, room):  # the greedy continuation, as much as fits
        done = request.num_output_tokens
        return greedy[done:done + min(room, 4, len(greedy) - done - 1)]

    monkeypatch.setattr(Scheduler, "_drafts", always_right)
    core = _tiny_core(tiny_model)
    assert [out for out, _ in _run(core, [prompt], params)] == [greedy]
    assert [out for out, _ in _run(core, [prompt], params)] == [greedy]  # 32 tokens from the cache
    stats = core.stats()
    assert stats.prefix_cache_hits >= 32 and stats.spec_num_accepted_tokens > 0
    assert stats.num_request_prompt_tokens == 2 * len(prompt)


@pytest.mark.slow
def test_a_stop_token_among_kept_drafts_ends_the_output_there(model, tokenizer):
    """The model copies a text, so its drafts (from the prompt) are kept: a stop token from the
    middle of the copy ends the output there as without proposals, and what was kept after it
    in the same step is dropped (with its logprobs)."""
    message = "Repeat exactly: The keeper climbed the stairs every evening to light the lamp, and he never missed it."
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    [(tokens, _)] = _run(_core(model, "cpu", None), [prompt], SamplingParams(temperature=0, max_tokens=40))
    at = next(i for i in range(10, len(tokens)) if tokens[i] not in tokens[:i])
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[tokens[at]], logprobs=0)
    results = []
    for speculative in (None, NGRAM):
        core = _core(model, "cpu", speculative)
        core.add_request("x", prompt, params)
        deltas = []
        while core.has_unfinished_requests:
            deltas += core.step()
        out = [t for d in deltas for t in d.new_token_ids]
        assert len([lp for d in deltas for lp in d.new_logprobs]) == len(out)
        results.append((out, deltas[-1].finish_reason, deltas[-1].stop_reason))
        assert core.block_manager.num_used_blocks == 0
    assert core.stats().spec_num_accepted_tokens >= at // 2
    assert results[0] == results[1] == (tokens[:at + 1], "stop", tokens[at])


def test_one_lookup_bound_given_alone_sets_the_other():
    assert SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1}) \
        == SpeculativeConfig("ngram", 3, 1, 1)
    assert SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5}') \
        == SpeculativeConfig("ngram", 3, 5, 5)
    assert SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3}).prompt_lookup_max == 5
    assert SpeculativeConfig.from_json(
        {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}).disable_by_batch_size is None


def test_the_activity_line_says_the_mean_acceptance_length():
    from engine.frontend.stats import activity_line
    from engine.messages import EngineStats

    idle = EngineStats(0, 0, 0, 100, 0, 0, 0, 500, 1000, 10)
    assert activity_line(idle, idle, 10.0) is None
    busy = EngineStats(1, 2, 25, 100, 0, 0, 0, 600, 1300, 20, 50, 200, 100, (40, 30, 20, 10))
    line = activity_line(idle, busy, 10.0)
    assert line == ("Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 30.0 tokens/s, Running: 1 reqs, "
                    "Waiting: 2 reqs, KV cache usage: 25.0%; SpecDecoding: mean acceptance length 3.00, "
                    "draft acceptance rate 50.0%")


# ---- through the HTTP server ----

@pytest.mark.slow
async def test_streamed_answers_with_proposals_equal_the_whole_answer_and_stop_strings_hold(model, tokenizer):
    """Chat completions with n-gram proposals: streamed deltas (several tokens a step) add up
    to the non-streamed text; a stop string inside a copied passage ends both at the same
    place, leaving it out, as a server without proposals does, and vllm:generation_tokens
    counts what usage does (not the kept drafts past the stop string)."""
    import orjson

    from tests.conftest import serve_http

    message = "Repeat exactly: The keeper climbed the stairs every evening to light the lamp, and he never missed it."
    body = {"model": "tiny", "messages": [{"role": "user", "content": message}], "temperature": 0, "max_tokens": 40}
    answers = []
    for speculative in (None, NGRAM):
        async with serve_http(_core(model, "cpu", speculative), tokenizer) as server:
            whole = (await server.http.post("/v1/chat/completions", json=body)).json()
            streamed, events = "", 0
            stop = {"stop": ["the lamp"], "ignore_eos": True}  # (ignore_eos: the core hears of the stop
            async with server.http.stream("POST", "/v1/chat/completions",  # before it could end the sequence itself)
                                          json={**body, **stop, "stream": True}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        events += 1
                        streamed += orjson.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            stopped = (await server.http.post("/v1/chat/completions", json={**body, **stop})).json()
            await server.client.wait_idle()
            after = (await server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 12,
                                                                     "ignore_eos": True})).json()
            await server.client.wait_idle()  # (its steps' counts pay for the tokens past the stops)
            assert server.client.stats().num_generation_tokens == whole["usage"]["completion_tokens"] + (
                2 * stopped["usage"]["completion_tokens"] + after["usage"]["completion_tokens"])  # (streamed: stopped's)
            answers.append((whole["choices"][0]["message"]["content"], streamed,
                            stopped["choices"][0]["message"]["content"], events))
            if speculative:
                assert server.client.stats().spec_num_accepted_tokens > 0
    (plain, plain_stream, plain_stop, plain_events), (text, stream, stop, spec_events) = answers
    assert text == plain and "the lamp" in text
    assert stream == stop == plain_stop == plain_stream == text[:text.index("the lamp")]
    assert spec_events < plain_events  # several tokens a step
