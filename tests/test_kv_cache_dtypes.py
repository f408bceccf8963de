"""The KV cache's element type and size as the engine chooses them (--kv-cache-dtype,
--kv-cache-memory, the CPU default, --gpu-memory-utilization), and what a user sees of them:
the start-up line, a refusal with exit status 2, and a cache that works with prefix caching,
preemption, chunked prefill and sliding windows in every type. (The kernels' conversions,
bit for bit, are in test_backends.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from backends import kv_cache as kvc
from engine.config import DEFAULT_CPU_KV_CACHE_TOKENS, EngineConfig, gpu_kv_cache_memory
from engine.core.engine_core import EngineCore
from engine.errors import ConfigError
from engine.models.llama import LlamaConfig, LlamaModel
from engine.models.loader import dummy_weights
from engine.sampling_params import SamplingParams
from tests.conftest import run_prompts

ROOT = os.path.dirname(os.path.dirname(__file__))
ENGINE_READY = re.compile(r"KV cache (\w+)( \(auto on this backend\))?: (\d+) blocks of (\d+) tokens \((\d+) tokens\), "
                          r"([\d.]+) MB \((\d+) bytes per token\)")


def small_model(layer_windows: tuple[int | None, ...], seed: int, hidden_size: int = 128, num_heads: int = 4,
                num_kv_heads: int = 2, lively: bool = False) -> LlamaModel:
    """Layers of random weights, head size 64 (an int8 row: 64 values + a 2-byte scale).

    ``dummy_weights`` (std 0.02, tied embeddings) gives a model that repeats its last token
    whatever it attends to; ``lively`` scales the products to std 1 / sqrt(fan-in) and unties a
    larger LM head, so that the tokens follow the keys each layer sees (its window's or all)."""
    config = LlamaConfig(vocab_size=256, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_layers=len(layer_windows), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                         rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1024,
                         tie_word_embeddings=not lively, eos_token_id=2, layer_windows=layer_windows)
    weights = dict(dummy_weights(config, seed=seed))
    if lively:
        for name, w in weights.items():
            if name.endswith("proj.weight") or name == "lm_head.weight":
                weights[name] = w / 0.02 / w.shape[1] ** 0.5 * (4 if name == "lm_head.weight" else 1)
    return LlamaModel.from_state_dict(config, weights, torch.float32, "cpu")


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return small_model((24, None), seed=3)


def ready_line(caplog) -> re.Match:
    match = next((ENGINE_READY.search(r.getMessage()) for r in caplog.records if "engine ready" in r.getMessage()),
                 None)
    assert match, caplog.text
    return match


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_capacity_at_one_budget_follows_the_bytes_of_each_type(model, caplog, backend):
    budget = 8 << 20
    tokens = {}
    for name in kvc.KV_CACHE_DTYPES:
        caplog.clear()
        with caplog.at_level("INFO"):
            core = EngineCore(EngineConfig(backend=backend, dtype="float32", kv_cache_memory=budget,
                                           kv_cache_dtype=name), model=model)
        line = ready_line(caplog)
        assert line.group(1) == name and core.runner.kv_caches[0].dtype == kvc.kv_cache_dtype(name).storage
        tokens[name] = int(line.group(5))
        # a global and a sliding layer: two block tables, sharing one tensor (engine/kv_groups.py)
        assert tokens[name] == core.block_manager.num_blocks // 2 * 16 and len(core.block_manager.windows) == 2
        tensors = {id(cache): cache for cache in core.runner.kv_caches}
        assert len(tensors) == 1
        held = sum(cache.numel() * cache.element_size() for cache in tensors.values())
        assert held <= budget and float(line.group(6)) == pytest.approx(held / 1e6, abs=0.05)  # what it says it holds
    for name, least in (("bfloat16", 1.95), ("float16", 1.95), ("fp8_e4m3", 3.8), ("fp8_e5m2", 3.8),
                        ("int8", 3.8)):
        assert tokens[name] >= least * tokens["float32"], (name, tokens)


def test_auto_is_said_in_the_start_up_line(model, caplog):
    with caplog.at_level("INFO"):
        EngineCore(EngineConfig(backend="cpu", dtype="float32", num_kv_blocks=8), model=model)
    line = ready_line(caplog)
    assert line.group(1) == "int8" and line.group(2)
    # 2 layers x 2 KV heads x (64 int8 + a 2-byte scale) x K and V
    assert int(line.group(7)) == 2 * 2 * 66 * 2


def test_the_cpu_default_holds_the_default_context_or_what_the_batch_can_use(model):
    # max_num_seqs x max_model_len below the default: no more than that (a block of each of the
    # model's two layer groups per 16 tokens, each a layer's worth: the bytes of one table)
    core = EngineCore(EngineConfig(backend="cpu", dtype="float32", max_num_seqs=3), model=model)
    assert core.block_manager.num_blocks * 16 == 2 * 3 * 1024
    core = EngineCore(EngineConfig(backend="cpu", dtype="float32", max_num_seqs=3, max_model_len=100), model=model)
    assert core.block_manager.num_blocks * 16 == 2 * 304  # 300 rounded up to whole blocks
    core = EngineCore(EngineConfig(backend="cpu", dtype="float32", max_num_seqs=128), model=model)
    assert core.block_manager.num_blocks * 16 == 2 * DEFAULT_CPU_KV_CACHE_TOKENS
    core = EngineCore(EngineConfig(backend="cpu", dtype="float32", max_num_seqs=128, disable_hybrid_kv_cache_manager=True),
                      model=model)
    assert core.block_manager.num_blocks * 16 == DEFAULT_CPU_KV_CACHE_TOKENS and len({id(c) for c in core.runner.kv_caches}) == 2


def test_gpu_memory_utilization_bounds_what_the_cache_takes():
    gib = 1 << 30
    # 0.9 of 80 GiB, less 0.05 for activations, less the 10 GiB in use (weights, others)
    assert gpu_kv_cache_memory(0.9, free=70 * gib, total=80 * gib) == int(80 * gib * 0.85) - 10 * gib
    assert gpu_kv_cache_memory(0.5, free=20 * gib, total=80 * gib) == 0  # already past its share
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be a fraction"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_a_type_the_backend_cannot_keep_is_refused_before_loading(model):
    from backends.cuda import CudaAttentionBackend

    with pytest.raises(ConfigError, match="unknown KV cache dtype|kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp4")
    cuda = CudaAttentionBackend.__new__(CudaAttentionBackend)  # (its rule needs no library)
    with pytest.raises(ValueError, match="cannot keep this model's KV cache in int8"):
        kvc.resolve_kv_cache_dtype("int8", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="cannot keep this model's KV cache in float32"):
        kvc.resolve_kv_cache_dtype("float32", cuda, torch.bfloat16)


def test_a_model_dtype_the_backend_cannot_run_is_refused_before_loading():
    """The cpu kernels take float32 and bfloat16 rows: float16 served /health, then failed the
    first request and the engine with it."""
    with pytest.raises(ConfigError, match=r"the cpu backend cannot run a model in torch.float16 \(it runs "
                                          r"torch.float32, torch.bfloat16\)"):
        EngineCore(EngineConfig(backend="cpu", dtype="float16", model="/nonexistent.gguf"))


@pytest.mark.parametrize("argv, words", [
    (["--kv-cache-dtype", "fp4"], "invalid choice: 'fp4'"),
    (["--backend", "cuda", "--kv-cache-dtype", "int8"], "the cuda backend cannot keep its KV cache in int8; "
                                                        "it can do float32, bfloat16, float16, fp8_e4m3, fp8_e5m2"),
])
def test_bad_kv_cache_dtypes_are_one_line_and_exit_2(argv, words):
    result = subprocess.run([sys.executable, "-m", "engine.api", "--port", "0", *argv], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_every_type_serves_through_prefix_caching_preemption_and_windows(model, kv_cache_dtype):
    """A cache too small for the batch (preemption and recompute), shared prefixes (cache hits),
    prompts longer than a step (chunked prefill) and a sliding-window layer: every block comes
    back, and greedy output is that of each request alone in a roomy cache of the same type up
    to where the two part, which is only where the roomy run's top two tokens were within
    NEAR_TIE of each other (float32 sums differ in their last bits between batch layouts, and
    a rounded cache can turn that into a step of its rounding)."""
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 256, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 256, (n,), generator=gen).tolist() for n in (3, 30, 70, 9)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)

    def run(**fields):
        core = EngineCore(EngineConfig(backend="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype,
                                       max_num_batched_tokens=32, **fields), model=model)
        outputs = run_prompts(core, prompts, params)
        return ({str(i): t for i, (t, _) in enumerate(outputs)}, {str(i): lp for i, (_, lp) in enumerate(outputs)},
                core)

    tight, _, core = run(num_kv_blocks=20, max_num_seqs=4)  # (blocks of one layer: a global and a sliding group)
    stats = core.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    roomy, roomy_logprobs, _ = run(num_kv_blocks=64, max_num_seqs=1)
    for request_id, expected in roomy.items():
        got = tight[request_id]
        assert len(got) == len(expected) == 40
        part = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        if part is not None:
            top = dict(zip(roomy_logprobs[request_id][part].top_ids, roomy_logprobs[request_id][part].top_logprobs))
            assert got[part] in top and top[expected[part]] - top[got[part]] < NEAR_TIE, (request_id, part, top)


NEAR_TIE = 0.05


def run_alone(core: EngineCore, prompt: list[int], params: SamplingParams) -> tuple[list[int], int]:
    """One request to its end: its tokens, and the most blocks in use after any step (the
    bookkeeping checked at the end)."""
    core.add_request("a", prompt, params)
    tokens, most = [], 0
    while core.has_unfinished_requests:
        for delta in core.step():
            tokens += delta.new_token_ids
        most = max(most, core.block_manager.num_used_blocks)
    core.block_manager.check_invariants()
    return tokens, most


def test_a_long_request_on_a_sliding_window_model_holds_only_its_window():
    """Every layer windowed (as Mistral, Phi-3): a request four times as long as the whole cache
    runs to the end without preemption, since the blocks its window has passed go back as it
    goes, and gives the tokens it gives with nothing given back (a roomy cache)."""
    windowed = small_model((40, 40), seed=4, lively=True)
    prompt = torch.randint(3, 256, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(temperature=0, max_tokens=340, ignore_eos=True)

    def run(num_kv_blocks: int, sliding: bool) -> tuple[list[int], int, int]:
        core = EngineCore(EngineConfig(backend="cpu", dtype="float32", num_kv_blocks=num_kv_blocks,
                                       max_model_len=400, max_num_batched_tokens=32), model=windowed)
        if not sliding:
            core.block_manager.windows, core.block_manager.sliding_window = (None,), None  # (keeps every block)
        tokens, most = run_alone(core, prompt, params)
        return tokens, most, core.stats().num_preemptions

    tokens, most, preemptions = run(num_kv_blocks=7, sliding=True)  # 400 tokens would need 25 blocks
    assert len(tokens) == 340 and preemptions == 0
    # the keys a step can need, from its first query's window to its last new token, over whole blocks
    assert most <= -(-(40 + 32 - 1) // 16) + 1
    expected, most_kept, _ = run(num_kv_blocks=25, sliding=False)
    assert most_kept == 25 and tokens == expected


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_long_request_on_a_hybrid_model_holds_only_the_window_in_its_sliding_layers(backend):
    """Global and sliding layers mixed (as Gemma 2): each layer group has its own block table
    (engine/kv_groups.py), and the sliding group's table holds only its window. A request of
    400 tokens runs without preemption in 32 blocks of two layers, where one table for all four
    layers needs 25 blocks of four (100 layer-blocks, not 64), with the same tokens; at the
    hybrid cache's bytes one table holds 256 tokens."""
    hybrid = small_model((40, None, 40, None), seed=4, lively=True)
    prompt = torch.randint(3, 256, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(temperature=0, max_tokens=340, ignore_eos=True)

    def run(num_kv_blocks: int, **fields) -> tuple[list[int], int, EngineCore]:
        core = EngineCore(EngineConfig(backend=backend, dtype="float32", num_kv_blocks=num_kv_blocks, max_model_len=400,
                                       max_num_batched_tokens=32, **fields), model=hybrid)
        tokens, most = run_alone(core, prompt, params)
        assert core.stats().num_preemptions == 0 and core.block_manager.num_free_blocks == num_kv_blocks
        return tokens, most, core

    # 25 places: 25 global blocks, and the sliding keys a step can need, as above
    tokens, most, core = run(num_kv_blocks=32)
    assert core.block_manager.windows == (None, 40) and len({id(c) for c in core.runner.kv_caches}) == 2
    assert len(tokens) == 340 and most <= 25 + -(-(40 + 32 - 1) // 16) + 1
    expected, most_kept, single = run(num_kv_blocks=25, disable_hybrid_kv_cache_manager=True)
    assert single.block_manager.windows == (None,) and len({id(c) for c in single.runner.kv_caches}) == 4
    assert most_kept == 25 and tokens == expected
    with pytest.raises(ConfigError, match=r"does not fit in the KV cache \(256 tokens\)"):
        run(num_kv_blocks=16, disable_hybrid_kv_cache_manager=True)
    # (tokens that follow what the layers see: the same weights with no windows give others)
    hybrid = small_model((None,) * 4, seed=4, lively=True)
    assert len(set(tokens)) > 50 and run(num_kv_blocks=32)[0] != tokens


def test_fewer_blocks_than_layer_groups_are_refused_at_start(model):
    with pytest.raises(ConfigError, match="1 KV blocks cannot hold a token: this model's layers are in 2 groups"):
        EngineCore(EngineConfig(backend="cpu", dtype="float32", num_kv_blocks=1), model=model)


def test_a_kv_cache_past_the_machines_memory_is_refused_at_start(model):
    """Not a start that builds block lists until the machine runs out (1e15 bytes, 1e9 blocks did)."""
    from engine.core.engine_core import device_free_memory

    past = 2 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # (twice the machine: never free)
    assert 0 < device_free_memory("cpu") < past
    with pytest.raises(ConfigError, match=rf"kv_cache_memory {past} bytes is more than this cpu has free "
                                          r"\(\d+ bytes\)"):
        EngineCore(EngineConfig(backend="cpu", dtype="float32", kv_cache_memory=past), model=model)
    with pytest.raises(ConfigError, match=rf"num_kv_blocks {past} \(\d+ bytes\) is more than this cpu has free"):
        EngineCore(EngineConfig(backend="cpu", dtype="float32", num_kv_blocks=past), model=model)
    core = EngineCore(EngineConfig(backend="cpu", dtype="float32", kv_cache_memory=1 << 20), model=model)
    assert core.block_manager.num_blocks > 0  # (a budget the machine has is taken as given)


def test_calculated_fp8_scales_come_from_the_first_pass(model):
    """--calculate-kv-scales: each layer's K and V scales, 1.0 until then, are set by the first
    forward pass (twice its largest K, V value maps to e4m3's 448) and kept after it."""
    core = EngineCore(EngineConfig(backend="cpu", dtype="float32", kv_cache_dtype="fp8_e4m3",
                                   calculate_kv_scales=True, num_kv_blocks=16), model=model)
    assert all(torch.equal(s, torch.ones(2)) for s in core.runner.kv_scales)
    prompt = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    core.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    core.step()
    first = [s.clone() for s in core.runner.kv_scales]
    assert all(bool((s > 0).all()) and not torch.equal(s, torch.ones(2)) for s in first)
    layer = model.layers[0]
    with torch.inference_mode():  # layer 0's V, from its normalized input
        h = model.embed.rows(torch.tensor(prompt))
        h = torch.nn.functional.rms_norm(h, (h.shape[-1],), layer.input_norm, model.config.rms_norm_eps)
        v = layer.qkv_proj(h)[:, model.q_size + model.kv_size:]
    assert float(first[0][1]) == pytest.approx(2 * float(v.abs().max()) / 448, rel=1e-5)
    while core.has_unfinished_requests:
        core.step()
    assert all(torch.equal(a, b) for a, b in zip(first, core.runner.kv_scales))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize(("windows", "num_kv_blocks"), [((40, 40), 7), ((40, None), 24)], ids=["windowed", "hybrid"])
def test_a_prefix_hit_longer_than_the_cache_on_a_sliding_window_model_is_served(backend, windows, num_kv_blocks):
    """The second turn of a chat on a windowed model: its cached prefix alone is about the whole
    cache (of a model windowed everywhere; a hybrid model's global layers keep it all). The
    hits its first new token's window has passed are not taken in the sliding layers (they stay
    cached, or were reused), so it is admitted, and gives the tokens it gives with prefix
    caching off."""
    windowed = small_model(windows, seed=4, hidden_size=64, num_heads=2, num_kv_heads=1, lively=True)
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(3, 256, (100,), generator=gen).tolist()
    second = first + torch.randint(3, 256, (100,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def second_turn(prefix_caching: bool) -> tuple[list[int], EngineCore]:
        core = EngineCore(EngineConfig(backend=backend, dtype="float32", num_kv_blocks=num_kv_blocks,
                                       max_num_batched_tokens=32, enable_prefix_caching=prefix_caching), model=windowed)
        tokens: dict[str, list[int]] = {"first": [], "second": []}
        for request_id, prompt in (("first", first), ("second", second)):
            core.add_request(request_id, prompt, params)
            for _ in range(200):
                if not core.has_unfinished_requests:
                    break
                for delta in core.step():
                    tokens[delta.request_id] += delta.new_token_ids
            assert not core.has_unfinished_requests, f"{request_id} was never served"
        core.block_manager.check_invariants()
        return tokens["second"], core

    tokens, core = second_turn(prefix_caching=True)
    assert core.stats().prefix_cache_hits >= 96 and len(tokens) == 8
    assert tokens == second_turn(prefix_caching=False)[0]


def test_a_library_built_from_other_sources_is_refused():
    from backends import native
    from backends.errors import BackendUnavailableError

    class Stale:
        pa_cpu_abi_version = staticmethod(lambda: native.ABI_VERSION - 1)

    for lib in (object(), Stale()):
        with pytest.raises(BackendUnavailableError, match="built from other sources.*python native/build.py"):
            native.check_abi(lib, "pa_cpu")
    native.check_abi(get_backend_lib(), "pa_cpu")  # the one built from these sources


def get_backend_lib():
    from backends.cpu import CpuAttentionBackend

    return CpuAttentionBackend()._lib
