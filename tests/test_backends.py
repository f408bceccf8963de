"""Every runnable attention backend against the torch reference.

Random, shuffled (non-contiguous) block tables; block sizes 16 and 32; head sizes 64 and
128; GQA ratios 1, 3 and 8; pure decode, pure prefill, mixed batches, chunked prefill over
a cached prefix; sequence lengths from 1 to 4096; padding rows with empty (-1) slots;
sliding windows and logit soft-capping; every KV cache element type (backends/kv_cache.py)
each backend keeps, written bit for bit as the torch backend writes it.

Tolerances: float32 1e-4 (only summation order differs); bfloat16 and float16 2e-2 (inputs
are rounded to 16 bits, so every product carries ~3 significant digits; the reference
computes from the same rounded values in fp32 and the backend rounds its output once).

``cuda-emulated`` is the CUDA library's own source compiled for the host with
``native/cuda/host_emulation.h`` (each CUDA thread a fiber, warp shuffles and barriers
emulated): on machines without a GPU it checks the CUDA kernels' indexing, partitioning,
synchronization and numerics, though not their speed.
"""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import pytest
import torch

from backends import get_backend, native
from backends import kv_cache as kvc
from backends.kv_cache_names import KV_CACHE_DTYPE_NAMES
from backends.base import AttentionMetadata
from backends.errors import BackendUnavailableError
from backends.cpu import CpuAttentionBackend
from backends.cuda import CudaAttentionBackend
from backends.reference import TorchAttentionBackend
from tests.conftest import load_script, on_every_core, run_prompts

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
HALF_PRECISION = {"cpu": (torch.bfloat16,), "cpu-portable": (torch.bfloat16,), "cuda": (torch.bfloat16, torch.float16),
                  "triton": (torch.bfloat16, torch.float16), "cuda-emulated": (torch.bfloat16, torch.float16)}

# (cached tokens, new tokens) per sequence
CASES = {
    "decode": [(40, 1), (1, 1), (500, 1), (4095, 1), (15, 1), (16, 1), (17, 1)],
    "prefill": [(0, 1), (0, 37), (0, 200), (0, 16)],
    "mixed": [(40, 1), (0, 37), (100, 1), (0, 5), (63, 1)],
    "chunked": [(50, 20), (128, 64), (0, 33), (300, 1)],
    "long": [(4000, 96), (0, 1), (2000, 1)],
}
# The triton interpreter runs each program in numpy: on the CPU it gets the same kinds of
# batch at a fraction of the size.
INTERPRETER_CASES = {
    "decode": [(40, 1), (1, 1), (17, 1)],
    "prefill": [(0, 1), (0, 9)],
    "mixed": [(20, 1), (0, 7), (33, 1)],
    "chunked": [(20, 5), (0, 3)],
    "long": [(300, 1), (0, 3), (150, 2)],  # key splits merged by a second kernel
}
# The emulated CUDA library runs every CUDA thread as a fiber: full cases but a shorter "long".
EMULATION_CASES = {**CASES, "long": [(1100, 8), (0, 1), (2000, 1)]}


class EmulatedCudaBackend(CudaAttentionBackend):
    """The CUDA backend's wrapper over the host-compiled CUDA library: host pointers, no stream."""

    name = "cuda-emulated"
    device_type = "cpu"

    @staticmethod
    def _stream(t: torch.Tensor):
        return native.ffi().NULL


@pytest.fixture(scope="session")
def emulated_cuda(tmp_path_factory) -> EmulatedCudaBackend:
    path = load_script("native/build.py").build_cuda_host_emulation(tmp_path_factory.mktemp("pa_cuda_emulated"))
    return EmulatedCudaBackend(native.ffi().dlopen(str(path)))


@pytest.fixture(scope="session")
def portable_cpu(tmp_path_factory):
    """The cpu backend on its portable kernels (what a CPU without AVX2+FMA runs): a copy of
    the library loaded with PA_CPU_ISA=portable, which it reads once, when it loads."""
    path = tmp_path_factory.mktemp("pa_cpu_portable") / "libpa_cpu.so"
    shutil.copy(native.LIB_DIR / "libpa_cpu.so", path)
    os.environ["PA_CPU_ISA"] = "portable"
    try:
        lib = native.ffi().dlopen(str(path))
    finally:
        del os.environ["PA_CPU_ISA"]
    backend = CpuAttentionBackend(lib)
    assert backend.isa == "portable"
    return backend


def runnable_backends() -> list[str]:
    names = ["cpu", "cpu-portable"]
    if torch.cuda.is_available():
        names += ["cuda", "triton"]
    elif os.environ.get("TRITON_INTERPRET") == "1":
        names.append("triton")
    if shutil.which(os.environ.get("CXX") or "c++") or shutil.which("g++"):
        names.append("cuda-emulated")
    return names


def device_for(name: str) -> str:
    return "cuda" if name in ("cuda", "triton") and torch.cuda.is_available() else "cpu"


def build_batch(seqs, block_size, num_heads, num_kv_heads, head_size, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 8
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, queries, keys, values, prefix = [], [], [], [], [], []
    for cached, new in seqs:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(table)
        positions = torch.arange(total)
        seq_slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        k = torch.randn(total, num_kv_heads, head_size, generator=gen)
        v = torch.randn(total, num_kv_heads, head_size, generator=gen)
        prefix.append((k[:cached], v[:cached], seq_slots[:cached]))
        keys.append(k[cached:])
        values.append(v[cached:])
        slots.append(seq_slots[cached:])
        queries.append(torch.randn(new, num_heads, head_size, generator=gen))
    width = max(len(t) for t in tables)
    starts = [0]
    for _, n in seqs:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        slot_mapping=torch.cat(slots).to(device),
        max_query_len=max(n for _, n in seqs), max_seq_len=max(c + n for c, n in seqs))
    to = dict(dtype=dtype, device=device)
    return dict(num_blocks=num_blocks, prefix=[(k.to(**to), v.to(**to), s.to(device)) for k, v, s in prefix],
                key=torch.cat(keys).to(**to), value=torch.cat(values).to(**to), query=torch.cat(queries).to(**to),
                meta=meta)


def guarded(shape, dtype, device, fill=0.0):
    """A contiguous tensor of ``shape`` with NaN slabs right before and after it in memory, so
    that a kernel reading past either end (nothing else checks raw pointers) gets NaN into its
    output, and one writing there is caught by ``guards_intact``. (An int8 tensor's slabs are
    0x7f bytes: a write there is caught, a read is not.)"""
    if dtype.is_floating_point and dtype.itemsize > 1:
        storage = torch.full((shape[0] + 2, *shape[1:]), float("nan"), dtype=dtype, device=device)
    else:  # fp8 (0x7f is NaN in both formats) and int8
        storage = torch.full((shape[0] + 2, *shape[1:]), 0x7f, dtype=torch.uint8, device=device).view(dtype)
    inner = storage[1:-1]
    inner.view(torch.uint8).fill_(0) if fill == 0.0 else inner.fill_(fill)
    return inner, storage


def guards_intact(storage) -> bool:
    if storage.dtype.is_floating_point and storage.dtype.itemsize > 1:
        return bool(storage[0].isnan().all() and storage[-1].isnan().all())
    raw = storage.view(torch.uint8)
    return bool((raw[0] == 0x7f).all() and (raw[-1] == 0x7f).all())


def run_backend(backend, batch, block_size, num_kv_heads, head_size, dtype, device, window=None, softcap=None,
                kv_dtype=None, kv_scales=None):
    spec = kv_dtype or kvc.kv_cache_dtype(str(dtype).removeprefix("torch."))
    shape = backend.kv_cache_shape(batch["num_blocks"], block_size, num_kv_heads, head_size, spec)
    cache, cache_storage = guarded(shape, spec.storage, device)
    scales = None if kv_scales is None else kv_scales.to(device)
    for k, v, s in batch["prefix"]:
        if len(s):
            backend.write_kv(k, v, cache, s, scales)
    # a padding row whose slot is -1 must not be written anywhere (the cache's bytes are also
    # held to the torch backend's, which leaves it out)
    pad_k = torch.full_like(batch["key"][:1], 4096.0)
    backend.write_kv(torch.cat([batch["key"], pad_k]), torch.cat([batch["value"], pad_k]), cache,
                     torch.cat([batch["meta"].slot_mapping, torch.tensor([-1], device=device)]), scales)
    if spec.storage.is_floating_point and spec.storage.itemsize > 1:
        assert not (cache == 4096.0).any()
    query, query_storage = guarded(batch["query"].shape, dtype, device)
    query.copy_(batch["query"])
    out, out_storage = guarded(batch["query"].shape, dtype, device, fill=float("nan"))
    backend.attend(query, cache, batch["meta"], head_size**-0.5, out, window=window, softcap=softcap,
                   kv_scales=scales)
    assert guards_intact(cache_storage) and guards_intact(query_storage) and guards_intact(out_storage)
    assert not out.isnan().any()  # every row written, nothing read from outside the tensors
    return out, cache


@pytest.mark.parametrize("backend_name", runnable_backends())
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size, head_size, num_heads, num_kv_heads", [
    (16, 64, 9, 3), (32, 128, 8, 1), (16, 128, 8, 8), (32, 64, 24, 8),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_backend_matches_reference(request, backend_name, case, block_size, head_size, num_heads, num_kv_heads,
                                   dtype):
    check_against_reference(request, backend_name, case, block_size, head_size, num_heads, num_kv_heads, dtype)


# Sliding windows shorter than a block, across several blocks, and longer than every
# sequence; soft-capping on its own and with a window (Gemma 2's layers).
@pytest.mark.parametrize("backend_name", runnable_backends())
@pytest.mark.parametrize("case", ["decode", "chunked", "long"])
@pytest.mark.parametrize("window, softcap", [(5, None), (70, None), (600, 0.5), (None, 0.5), (10_000, None)],
                         ids=["window-5", "window-70", "window-600-softcap", "softcap", "window-10000"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_windows_and_softcap_match_reference(request, backend_name, case, window, softcap, dtype):
    check_against_reference(request, backend_name, case, 16, 64, 9, 3, dtype, window, softcap)


# The cpu kernels' decode path (a sequence's one new token: the cache rows read directly, the
# context split across threads from 64 keys when the batch is smaller than the threads): one
# sequence alone (split) and a few (not split), GQA groups of 2 to 7 query heads a KV head (in
# passes of at most three), head sizes of whole 32-value chunks (32, 64, 96, 256) and one that is
# not (80: the transposed keys instead), blocks of 8 and 24 keys, windows and soft-capping, an
# int8 (scaled rows) and a bf16 cache.
DECODE_CASES = {"lone-decode": [(700, 1)], "decodes": [(63, 1), (1, 1), (300, 1)]}


@pytest.mark.parametrize("case", list(DECODE_CASES))
@pytest.mark.parametrize("block_size, head_size, num_heads, num_kv_heads", [
    (16, 64, 4, 2), (16, 64, 7, 1), (16, 64, 20, 4), (8, 32, 6, 3), (24, 96, 6, 2), (16, 80, 4, 1), (16, 256, 2, 1),
])
@pytest.mark.parametrize("window, softcap", [(None, None), (70, None), (None, 0.5)], ids=["plain", "window", "softcap"])
@pytest.mark.parametrize("kv_name", ["float32", "int8", "bfloat16"])
def test_cpu_decode_rows_match_reference(request, case, block_size, head_size, num_heads, num_kv_heads, window,
                                         softcap, kv_name):
    kv_dtype = None if kv_name == "float32" else kvc.kv_cache_dtype(kv_name)
    on_every_core(check_against_reference, request, "cpu", case, block_size, head_size, num_heads, num_kv_heads,
                  torch.float32, window, softcap, kv_dtype)  # (a lone decode splits its keys across the threads)


def check_against_reference(request, backend_name, case, block_size, head_size, num_heads, num_kv_heads, dtype,
                            window=None, softcap=None, kv_dtype=None, kv_scales=None):
    if dtype != torch.float32 and dtype not in HALF_PRECISION[backend_name]:
        pytest.skip(f"the {backend_name} backend has no {dtype}")
    device = device_for(backend_name)
    seqs = CASES[case] if case in CASES else DECODE_CASES[case]
    if backend_name == "triton" and device == "cpu":
        if case not in INTERPRETER_CASES or dtype != torch.float32:
            pytest.skip("the triton interpreter is slow and has no 16-bit floats: small float32 shapes only on CPU")
        seqs = INTERPRETER_CASES[case]
    if backend_name == "cuda-emulated":
        backend, seqs = request.getfixturevalue("emulated_cuda"), EMULATION_CASES[case]
    elif backend_name == "cpu-portable":
        backend = request.getfixturevalue("portable_cpu")
    else:
        backend = get_backend(backend_name, device)
    if kv_dtype is not None and kv_dtype.name not in backend.kv_cache_dtypes_for(dtype):
        pytest.skip(f"the {backend_name} backend keeps no {kv_dtype.name} cache for a {dtype} model")
    batch = build_batch(seqs, block_size, num_heads, num_kv_heads, head_size, dtype, device)
    out, cache = run_backend(backend, batch, block_size, num_kv_heads, head_size, dtype, device, window, softcap,
                             kv_dtype, kv_scales)
    # The reference runs in fp32 (or bf16) on the CPU from the same, already rounded, values.
    ref_dtype = torch.float32 if dtype == torch.float16 else dtype
    ref_batch = build_batch(seqs, block_size, num_heads, num_kv_heads, head_size, dtype, "cpu")
    ref_batch = {**ref_batch, "prefix": [(k.to(ref_dtype), v.to(ref_dtype), s) for k, v, s in ref_batch["prefix"]],
                 **{name: ref_batch[name].to(ref_dtype) for name in ("key", "value", "query")}}
    ref_out, ref_cache = run_backend(TorchAttentionBackend(), ref_batch, block_size, num_kv_heads, head_size,
                                     ref_dtype, "cpu", window, softcap, kv_dtype or
                                     (None if dtype != torch.float16 else kvc.kv_cache_dtype("float16")), kv_scales)
    if kv_dtype is None and dtype == torch.float16:
        ref_cache = ref_cache.float()
    if kv_dtype is None:
        assert torch.equal(cache.cpu().to(ref_dtype), ref_cache.to(ref_dtype))  # cache writes are exact copies
    else:  # the same bits as the torch backend's conversion
        assert torch.equal(cache.cpu().view(torch.uint8), ref_cache.view(torch.uint8))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().float(), ref_out.float(), atol=tol, rtol=tol)


# Every cache element type against the torch backend's, which dequantizes the same rows: the
# kernels convert in registers and must store and read the same bits. fp8 with layer scales
# other than 1 (K halved, V doubled), int8 with its per-row scales.
@pytest.mark.parametrize("backend_name", runnable_backends())
@pytest.mark.parametrize("case", ["decode", "chunked", "long"])
@pytest.mark.parametrize("kv_name", [name for name in kvc.KV_CACHE_DTYPES if name != "float32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_kv_cache_dtypes_match_reference(request, backend_name, case, kv_name, dtype):
    spec = kvc.kv_cache_dtype(kv_name)
    scales = torch.tensor([0.5, 2.0]) if spec.is_fp8 else None
    check_against_reference(request, backend_name, case, 16, 64, 9, 3, dtype, kv_dtype=spec, kv_scales=scales)


@pytest.mark.parametrize("backend_name", ["cpu", "cpu-portable"])
@pytest.mark.parametrize("kv_name", ["int8", "fp8_e4m3", "bfloat16"])
def test_cpu_kv_cache_dtypes_with_windows_softcap_and_large_heads(request, backend_name, kv_name):
    """The converted rows through the windowed, soft-capped, GQA-8 and head-size-128 paths."""
    spec = kvc.kv_cache_dtype(kv_name)
    check_against_reference(request, backend_name, "chunked", 16, 64, 9, 3, torch.float32, 70, 0.5, kv_dtype=spec)
    check_against_reference(request, backend_name, "mixed", 32, 128, 8, 1, torch.float32, kv_dtype=spec)


def test_kv_conversions_are_the_torch_ones_bit_for_bit():
    """The native libraries' float -> cache conversions (kv_dtype.h) against torch's own:
    values across every binade, subnormals, ties, and past the largest (saturated)."""
    backend = CpuAttentionBackend()
    gen = torch.Generator().manual_seed(3)
    magnitudes = torch.logspace(-12, 6, 4096, base=2.0)
    values = torch.cat([magnitudes, -magnitudes, torch.randn(4096, generator=gen) * 30, torch.zeros(64),
                        torch.tensor([448.0, 464.0, 480.0, 1e9, 57344.0, 61440.0, 2.0 ** -9, 3 * 2.0 ** -10,
                                      2.0 ** -17, 65504.0, 65520.0, 1e-8])])
    tokens = values.numel() // 64
    values = values[:tokens * 64].view(tokens, 1, 64)
    for name in kvc.KV_CACHE_DTYPES:
        spec = kvc.kv_cache_dtype(name)
        shape = backend.kv_cache_shape(tokens, 1, 1, 64, spec)
        mine, theirs = torch.zeros(shape, dtype=spec.storage), torch.zeros(shape, dtype=spec.storage)
        slots = torch.arange(tokens)
        backend.write_kv(values, values, mine, slots)
        TorchAttentionBackend().write_kv(values, values, theirs, slots)
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), name


def test_backends_say_which_kv_cache_dtypes_they_keep():
    from backends.kv_cache import resolve_kv_cache_dtype

    cpu, cuda = CpuAttentionBackend(), CudaAttentionBackend.__new__(CudaAttentionBackend)
    assert tuple(kvc.KV_CACHE_DTYPES) == KV_CACHE_DTYPE_NAMES  # (the package's torch-free names)
    assert resolve_kv_cache_dtype("auto", cpu, torch.float32).name == "int8"
    assert resolve_kv_cache_dtype("fp8", cpu, torch.float32).name == "fp8_e4m3"  # vLLM's alias
    assert resolve_kv_cache_dtype("auto", TorchAttentionBackend(), torch.bfloat16).name == "bfloat16"
    assert resolve_kv_cache_dtype("auto", cuda, torch.bfloat16).name == "bfloat16"
    assert resolve_kv_cache_dtype("fp8_e5m2", cuda, torch.float16).name == "fp8_e5m2"
    with pytest.raises(ValueError, match="cannot keep this model's KV cache in int8; "
                                         "it can do bfloat16, fp8_e4m3, fp8_e5m2"):
        resolve_kv_cache_dtype("int8", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp4'"):
        resolve_kv_cache_dtype("fp4", cpu, torch.float32)


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the CPU's flags from /proc/cpuinfo")
def test_cpu_library_runs_the_fastest_kernels_this_cpu_has():
    expected = ("avx2+fma+f16c" if {"avx2", "fma", "f16c"} <= cpu_flags() and platform.machine() == "x86_64"
                else "portable")
    assert get_backend("cpu", "cpu").isa == expected


def test_auto_backend_and_device_selection(monkeypatch, caplog):
    from engine.config import EngineConfig, resolve_device

    assert resolve_device(EngineConfig(backend="cpu")) == "cpu"
    assert resolve_device(EngineConfig(backend="torch", device="cpu")) == "cpu"
    if not torch.cuda.is_available():
        assert resolve_device(EngineConfig()) == "cpu"
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        assert resolve_device(EngineConfig(backend="cuda")) == "cuda"  # and the backend then says why not
    assert get_backend("auto", "cpu").name == "cpu"
    missing = BackendUnavailableError("the cpu attention backend needs libpa_cpu.so, which is not built")
    monkeypatch.setattr(native, "load_library", lambda *a: (_ for _ in ()).throw(missing))
    with caplog.at_level("WARNING"):
        assert get_backend("auto", "cpu").name == "torch"  # the one fallback, and it says so
    assert "falling back" in caplog.text and "libpa_cpu.so" in caplog.text


def test_auto_dtype_is_bf16_only_where_the_cpu_multiplies_bf16_natively(monkeypatch):
    import engine.config as config_module
    from engine.config import EngineConfig, resolve_dtype

    for amx, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(config_module, "cpu_has_bf16_matrix_units", lambda amx=amx: amx)
        assert resolve_dtype(EngineConfig(), "cpu") is expected
        assert resolve_dtype(EngineConfig(dtype="float32"), "cpu") is torch.float32  # asked for: honoured
    assert resolve_dtype(EngineConfig(), "cuda") is torch.bfloat16
    monkeypatch.undo()
    has_amx = {"amx_tile", "amx_bf16"} <= cpu_flags() if Path("/proc/cpuinfo").exists() else False
    if not has_amx:  # without AMX the answer is certain (with it, the OS may still refuse the tiles)
        assert config_module.cpu_has_bf16_matrix_units() is False


def test_explicit_backends_that_cannot_run_say_why():
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match="cuda backend cannot run"):
            get_backend("cuda", "cpu")
    with pytest.raises(BackendUnavailableError, match="cpu backend runs on CPU"):
        get_backend("cpu", "cuda")


def test_triton_splits_keys_only_when_the_batch_is_small():
    from backends.triton_attention import _splits

    assert _splits(1024, 4096, 16) == (1, 256)  # the batch fills the GPU: one program per row
    assert _splits(3, 4096, 16) == (32, 8)  # one long decode: 32 splits of 128 keys
    assert _splits(6, 301, 16) == (2, 10)  # never shorter than 128 keys
    assert _splits(6, 100, 16) == (1, 7)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match="needs a GPU"):
        get_backend("triton", "cpu")


ENGINE_BACKENDS = ["cpu", "cuda-emulated"] + (["cuda", "triton"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("backend_name", ENGINE_BACKENDS)
@pytest.mark.parametrize("layers", ["global", "gemma2"])
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "int8", "fp8_e4m3"])
def test_engine_matches_the_torch_backend(request, backend_name, layers, kv_cache_dtype, monkeypatch):
    """The model runner driving each backend (fp32, random weights) gives the torch backend's
    greedy tokens and logprobs: chunked prefill, prefix-cache hits, several split-KV
    partitions, and (cuda) the per-step workspace shared by every layer. ``gemma2``: a
    sliding-window layer (shorter than most prompts) before a global one, scores soft-capped.
    The same with an int8 or fp8 cache on both sides (the same rows: the same results)."""
    if backend_name in ("cuda", "cuda-emulated") and kv_cache_dtype == "int8":
        pytest.skip("the cuda backend keeps no int8 cache")
    import engine.core.engine_core
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.models.llama import LlamaConfig, LlamaModel
    from engine.models.loader import dummy_weights
    from engine.sampling_params import SamplingParams

    device = device_for(backend_name)
    config = LlamaConfig(vocab_size=512, hidden_size=192, intermediate_size=256, num_layers=2, num_heads=6,
                         num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=2,
                         **(dict(layer_windows=(37, None), attn_logit_softcapping=3.0) if layers == "gemma2" else {}))
    # Weights 5x the dummy std (0.1): attention is peaked and matters to the logits, so a wrong
    # kernel shows in the logprobs (at std 0.02 attention is near uniform and barely moves them).
    weights = {name: w * 5 if name.startswith("model.layers.") and "norm" not in name else w
               for name, w in dummy_weights(config, seed=1)}
    model = LlamaModel.from_state_dict(config, weights, torch.float32, device)
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 512, (64,), generator=gen).tolist()
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 5, 40, 130, 300)]
    prompts += [shared + [7, 8, 9], shared + [10, 11]]

    def greedy(name: str) -> tuple[list[list[int]], torch.Tensor]:
        """Each prompt's greedy tokens, and the logprob of every one of them."""
        if name == "cuda-emulated":
            emulated = request.getfixturevalue("emulated_cuda")
            monkeypatch.setattr(engine.core.engine_core, "get_backend", lambda *_: emulated)
            name = "torch"  # a valid config value; the patched lookup ignores it
        core = EngineCore(EngineConfig(backend=name, device=device, dtype="float32", num_kv_blocks=128,
                                       max_num_batched_tokens=64, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype),
                          model=model)
        outputs = run_prompts(core, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0))
        assert core.stats().prefix_cache_hits > 0
        return [tokens for tokens, _ in outputs], torch.tensor([p.logprob for _, lps in outputs for p in lps])

    expected_tokens, expected_logprobs = greedy("torch")  # first: the emulated run patches the lookup
    tokens, logprobs = greedy(backend_name)
    assert tokens == expected_tokens
    # A rounded cache: layer 1's outputs differ between backends in the last bits (another sum
    # order), and that can move a layer-2 key or value across one rounding step (1/127 of its
    # row's largest for int8): 2-4e-4 in a few logprobs on an AVX2 AMD EPYC, portable kernel too.
    # A wrong kernel moves them by far more (weights at 5x the dummy std make attention count).
    tolerance = 1e-4 if kv_cache_dtype == "float32" else 2e-3
    torch.testing.assert_close(logprobs, expected_logprobs, atol=tolerance, rtol=tolerance)
