"""Batch invariance (``--batch-invariant``): a request's tokens and logprobs are the same bits
whatever else the engine runs. Products (packed and dense) and attention rows summed in an order
set by the row alone; checked on the kernels, then on the real default model (alone vs among
2, 7, 32 and 64 others, chunked prefill at several sizes, prefix cached or not, after a forced
preemption), then through the HTTP server with ``n`` > 1 and a seed at temperature 1."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import trio

from backends import get_backend
from backends import packed as packed_kernels
from backends import kv_cache as kvc
from backends.base import AttentionMetadata
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.errors import ConfigError
from engine.models.linear import quantize_q8_m
from engine.sampling_params import SamplingParams
from tests.conftest import on_every_core, run_prompts, serve_http

ROWS = (1, 2, 5, 7, 8, 15, 16, 33, 64, 130)  # every tile and panel boundary of the packed kernels


def vector_paths() -> list[str]:
    return [isa for isa in packed_kernels.ISAS if isa != "best" and packed_kernels.isa_supported(isa)]


def packed_weight(kind: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random blocks of ``kind`` with sane scales (fp16 1/64, min -1/8 where there is one)."""
    block = packed_kernels.TYPES[kind][1]
    data = torch.randint(0, 256, (n, k // 32 * block), dtype=torch.uint8, generator=gen)
    head = data.view(n, k // 32, block)
    head[..., 0:2] = torch.tensor([0x00, 0x24], dtype=torch.uint8)  # d = 1/64
    if kind in ("Q4_1", "Q8_M"):
        head[..., 2:4] = torch.tensor([0x00, 0xb0], dtype=torch.uint8)  # m = -1/8
    return data


@pytest.mark.parametrize("isa", vector_paths())
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q8_M", "float32", "bfloat16"])
def test_fixed_order_products_give_each_row_the_bits_it_gets_alone(kind, isa):
    gen = torch.Generator().manual_seed(0)
    n, k = 100, 320
    if kind in ("float32", "bfloat16"):
        weight = torch.randn(n, k, generator=gen).to(getattr(torch, kind))
        matrix, reference = packed_kernels.DenseMatrix(weight), weight.float()
    else:
        data = packed_weight(kind, n, k, gen)
        matrix = packed_kernels.PackedMatrix(data, kind, k)
        reference = packed_kernels.dequantize_range(data, kind, k, 0, n)
    x = torch.randn(max(ROWS), k, generator=gen)
    alone = torch.cat([matrix.linear(x[i:i + 1].contiguous(), isa, "fixed_order") for i in range(len(x))])
    torch.testing.assert_close(alone, x @ reference.T, atol=2e-4, rtol=2e-4)  # the right product
    for m in ROWS:
        assert torch.equal(matrix.linear(x[:m].contiguous(), isa, "fixed_order"), alone[:m]), f"{m} rows"


def test_dense_weights_the_row_tiles_cannot_take_are_refused():
    with pytest.raises(ValueError, match="whole blocks of 32"):
        packed_kernels.DenseMatrix(torch.zeros(4, 40))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        packed_kernels.DenseMatrix(torch.zeros(4, 64, dtype=torch.float16))
    matrix = packed_kernels.DenseMatrix(torch.zeros(4, 64))
    with pytest.raises(ValueError, match="fixed order only"):
        matrix.linear(torch.zeros(1, 64), activations="float32")


def attend(backend, sequences, block_size: int = 16, kv_heads: int = 3, head_size: int = 64):
    """Run ``backend`` on one step holding ``sequences`` (each: its queries ``[n, heads, head_size]``
    for the last n positions, and its keys and values ``[seq_len, kv_heads, head_size]``): each
    sequence's output rows."""
    tables, slots, starts = [], [], [0]
    next_block = 0
    for queries, keys, _ in sequences:
        blocks = -(-len(keys) // block_size)
        table = list(range(next_block, next_block + blocks))[::-1]  # (not in order: a real table is not)
        next_block += blocks
        tables.append(table)
        positions = torch.arange(len(keys))
        slots.append(torch.tensor(table)[positions // block_size] * block_size + positions % block_size)
        starts.append(starts[-1] + len(queries))
    spec = kvc.kv_cache_dtype("float32")
    cache = torch.zeros(backend.kv_cache_shape(next_block, block_size, kv_heads, head_size, spec))
    backend.write_kv(torch.cat([k for _, k, _ in sequences]), torch.cat([v for _, _, v in sequences]), cache,
                     torch.cat(slots))
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([len(k) for _, k, _ in sequences], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.cat(slots), max_query_len=max(len(q) for q, _, _ in sequences),
        max_seq_len=max(len(k) for _, k, _ in sequences))
    query = torch.cat([q for q, _, _ in sequences])
    out = backend.attend(query, cache, meta, 0.125, torch.empty_like(query))  # (query heads: a multiple of 3)
    return [out[starts[i]:starts[i + 1]] for i in range(len(sequences))]


@pytest.mark.parametrize("heads", [9, 3])
@pytest.mark.parametrize("backend_name", ["cpu", "torch"])
def test_an_attention_row_is_the_same_alone_in_a_batch_and_in_a_prompt(backend_name, heads):
    """A decode at position 700 (long enough that a lone decode's keys would be split across
    threads) alone, among twelve other sequences, and as row 10 of an 11-token prompt chunk;
    with 3 query heads per KV head, and with 1 (where a lone decode row would dot its keys
    another way than a prompt's rows)."""
    backend = get_backend(backend_name, "cpu")
    backend.batch_invariant = True
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 701, 3, 64, generator=gen).unbind(0)
    queries = torch.randn(11, heads, 64, generator=gen) * 3  # (peaked attention: every key matters)
    others = [(torch.randn(n, heads, 64, generator=gen), *torch.randn(2, c, 3, 64, generator=gen).unbind(0))
              for n, c in [(1, 40), (1, 900), (5, 300), (1, 17)] * 3]
    # (on every core: a lone decode row's keys are split across the threads unless invariant)
    alone = on_every_core(attend, backend, [(queries[10:], keys, values)])[0]
    among = on_every_core(attend, backend, [*others, (queries[10:], keys, values)])[-1]
    in_prompt = on_every_core(attend, backend, [(queries, keys, values), *others[:2]])[0][10:]
    assert torch.equal(among, alone) and torch.equal(in_prompt, alone)


# ---- the engine on the real default model ----

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.choice([3, 17, 60, 130, 200]))] for _ in range(n)]


# 600 tokens: alone, its decode attention would be split over threads (from 512 keys).
TARGET = [random.Random(3).randrange(100, 40000) for _ in range(600)]


def bits(output) -> tuple:
    """Tokens, and every logprob with the top logprobs, as exact floats."""
    tokens, logprobs = output
    return tokens, [(p.logprob, tuple(p.top_logprobs)) for p in logprobs]


def engine(backend: str, **fields) -> EngineCore:
    return EngineCore(EngineConfig(backend=backend, batch_invariant=True, **{"num_kv_blocks": 512, **fields}))


@pytest.fixture(scope="module")
def alone_on_cpu():
    return bits(run_prompts(engine("cpu"), [TARGET], PARAMS)[0])


@pytest.mark.slow
@pytest.mark.parametrize("others", [2, 7, 32, 64])
def test_a_request_among_others_gets_the_bits_it_gets_alone(alone_on_cpu, others):
    core = engine("cpu", max_num_seqs=128)
    outputs = run_prompts(core, prompts(others) + [TARGET], PARAMS)
    assert bits(outputs[-1]) == alone_on_cpu


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [16, 48, 256])
def test_chunked_prefill_at_any_size_gives_the_same_bits(alone_on_cpu, chunk):
    core = engine("cpu", max_num_batched_tokens=chunk, max_num_seqs=8)
    assert bits(run_prompts(core, prompts(5) + [TARGET], PARAMS)[-1]) == alone_on_cpu


@pytest.mark.slow
def test_a_cached_prefix_gives_the_same_bits(alone_on_cpu):
    core = engine("cpu")
    run_prompts(core, [TARGET[:450] + [5, 6, 7]], PARAMS)  # leaves 28 blocks of the target's prefix cached
    assert bits(run_prompts(core, [TARGET], PARAMS)[0]) == alone_on_cpu
    assert core.stats().prefix_cache_hits > 0


@pytest.mark.slow
def test_a_preempted_and_recomputed_request_gets_the_same_bits(alone_on_cpu, monkeypatch):
    """The target fills the cache beside two short prompts whose long outputs then need its
    blocks: it is preempted (the latest arrival) and recomputed once they finish."""
    core = engine("cpu", num_kv_blocks=42, max_num_seqs=8)
    preempted = []
    real = core.scheduler._preempt
    monkeypatch.setattr(core.scheduler, "_preempt", lambda request: (preempted.append(request.request_id),
                                                                     real(request)))
    long_outputs = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    for i, prompt in enumerate(prompts(2, seed=5)):
        core.add_request(f"other-{i}", prompt[:20], long_outputs)
    target = ([], [])
    core.add_request("target", TARGET, PARAMS)
    while core.has_unfinished_requests:
        for delta in core.step():
            if delta.request_id == "target":
                target[0].extend(delta.new_token_ids)
                target[1].extend(delta.new_logprobs)
    assert any(request_id.endswith("target") for request_id in preempted)
    assert bits(target) == alone_on_cpu


@pytest.mark.slow
def test_the_torch_reference_is_batch_invariant_too():
    """The oracle, with each attention row on its own: alone vs among 7 others, in 16-token chunks."""
    alone = bits(run_prompts(engine("torch"), [TARGET[:200]], PARAMS)[0])
    core = engine("torch", max_num_batched_tokens=16, max_num_seqs=8)
    assert bits(run_prompts(core, prompts(7) + [TARGET[:200]], PARAMS)[-1]) == alone


async def test_the_server_gives_the_same_samples_alone_and_under_load(tokenizer):
    """n = 3 samples at temperature 1 with a seed: the same text and logprobs whether the request
    runs alone or while 31 others stream."""
    core = engine("cpu", max_num_seqs=64)
    body = {"prompt": "The sea at night is", "n": 3, "seed": 1234, "temperature": 1.0, "max_tokens": 24,
            "ignore_eos": True, "logprobs": 2}

    def choices(response) -> list:
        assert response.status_code == 200, response.text
        return [(c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"])
                for c in response.json()["choices"]]

    # (each answer comes whole when its last token does: on a busy 2-core machine 32 requests to
    # the invariant engine took more than the client's usual 30 s; fail_after bounds the load)
    wait = 240
    async with serve_http(core, tokenizer) as server:
        alone = choices(await server.http.post("/v1/completions", json=body, timeout=wait))
        assert len({text for text, _, _ in alone}) > 1  # (three different samples: the seed is per sample)
        under_load = []

        async def other(i: int) -> None:
            await server.http.post("/v1/completions", json={
                "prompt": f"Count to {i} and then tell a story about number {i}.", "max_tokens": 40 + i,
                "temperature": 0.8, "ignore_eos": True}, timeout=wait)

        async def target() -> None:
            await trio.sleep(0.3)  # (the others are running by then)
            under_load.append(choices(await server.http.post("/v1/completions", json=body, timeout=wait)))

        with trio.fail_after(wait):
            async with trio.open_nursery() as nursery:
                for i in range(31):
                    nursery.start_soon(other, i)
                nursery.start_soon(target)
        assert under_load == [alone]


# ---- configuration ----

@pytest.mark.parametrize("fields, words", [
    (dict(activation_quantization="int16"), "activation quantization int16"),
    (dict(calculate_kv_scales=True), "first forward pass"),
    (dict(tensor_parallel_size=3), "at most 2 tensor-parallel ranks"),
])
def test_what_batch_invariance_cannot_keep_is_refused(fields, words):
    with pytest.raises(ConfigError, match=words):
        EngineConfig(batch_invariant=True, **fields)


def test_the_start_up_log_says_whether_invariance_holds(tiny_model, caplog, monkeypatch):
    from tests.conftest import tiny_engine_core

    with caplog.at_level(logging.INFO):
        core = tiny_engine_core(tiny_model, backend="cpu", batch_invariant=True)
    assert core.backend.batch_invariant and "batch invariant" in caplog.text
    caplog.clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with caplog.at_level(logging.INFO):
        core = tiny_engine_core(tiny_model, backend="triton", device="cpu", batch_invariant=True)
    assert "batch invariance is not available on the triton backend" in caplog.text
    # An engine built later over the same model without the flag gets the usual products back.
    core = tiny_engine_core(tiny_model, backend="cpu")
    assert not core.backend.batch_invariant and not any(
        getattr(linear, "fixed_order", False) or getattr(linear, "_fixed", None) for linear in tiny_model.linears())


def test_the_command_line_flag(monkeypatch):
    from api.cli import build_parser, engine_config

    assert engine_config(build_parser().parse_args(["--batch-invariant"])).batch_invariant
    assert not engine_config(build_parser().parse_args([])).batch_invariant
