"""Packed weights (GGUF's Q4_0, Q4_1, Q8_0, and Q8_M for int8): the native kernels against
dequantize-then-F.linear (GGUF's own reference dequantizer; for Q8_M, q * d + m written out
here), each vector path this CPU runs; the linear-layer seam;
the loader's checks; the default model's resident weight size."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

import engine.models.linear as linear_module
from backends import packed
from engine.errors import ConfigError
from engine.models.linear import PackedLinear, quantize_q8_m

KINDS = list(packed.TYPES)
VECTOR_PATHS = ("avx2", "avx512", "avx512+vnni", "avx512+vnni+bf16")  # each needs the one before it
ISAS = [isa for isa in ("portable", *VECTOR_PATHS) if packed.isa_supported(isa)]

# float32 throughout, the KV cache too: these tests hold the model's arithmetic to an oracle.
FP32 = dict(dtype="float32", kv_cache_dtype="float32", activation_quantization="none")


def q8_m_reference(data: torch.Tensor, k: int) -> torch.Tensor:
    """Q8_M blocks (fp16 d, fp16 m, 32 uint8 q) as fp32 q * d + m, rounded after each step."""
    blocks = data.reshape(-1, 36)
    d, m = blocks[:, 0:2].contiguous().view(torch.float16).float(), blocks[:, 2:4].contiguous().view(torch.float16).float()
    return (blocks[:, 4:].float() * d + m).reshape(-1, k)


def packed_weight(kind: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed rows, the reference dequantization of them as fp32)."""
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    if kind == "Q8_M":
        data = quantize_q8_m(torch.from_numpy(w)).data
        return data, q8_m_reference(data, k)
    data = quantize(w, GGMLQuantizationType[kind])
    reference = np.array(dequantize(data, GGMLQuantizationType[kind]), dtype=np.float32).reshape(n, k)
    return torch.from_numpy(data.reshape(n, -1).copy()), torch.from_numpy(reference)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k", [(1, 32), (7, 96), (37, 576), (193, 160)])
def test_the_kernels_match_dequantize_then_linear(kind, isa, n, k):
    data, reference = packed_weight(kind, n, k, seed=n * k)
    # Dequantizing gives GGUF's values bit for bit.
    assert torch.equal(packed.dequantize_range(data, kind, k, 0, n, isa=isa), reference)
    rows = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(packed.dequantize_rows(data, kind, k, rows, isa=isa), reference[rows])
    assert torch.equal(packed.dequantize_range(data, kind, k, n // 2, n, isa=isa), reference[n // 2:])
    # The product: equal up to the order of the sums.
    gen = torch.Generator().manual_seed(k)
    # (AVX2: 1-4 a folded tile, 5-12 a tile of dequantized blocks, 13-15 one padded slab; AVX-512:
    # 1 folded, 2-15 dequantized; 17-21, 24, 39, 40, 200, 517: whole slabs of 16 rows and row
    # tiles after them; 25, 31: a padded slab; from 200: several passes over slabs of x)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 24, 25, 31, 39, 40, 64,
              200, 517):
        x = torch.randn(m, k, generator=gen)
        expected = F.linear(x.double(), reference.double())
        got = packed.linear(x, data, kind, k, isa=isa)
        bound = 1e-5 * (x.abs().double() @ reference.abs().double().T) + 1e-6
        assert ((got.double() - expected).abs() <= bound).all(), (kind, isa, m)


def int16_activations_reference(x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to int16 per block of 32 as the library does (scale max|x| / 32767 in fp32, x
    times its inverse rounded half to even), then multiplied in float64."""
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    d = blocks.abs().amax(-1) / 32767.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None]).clamp(-32767, 32767)
    return F.linear((q.double() * d[..., None].double()).view(m, k), reference.double())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k", [(1, 32), (7, 96), (37, 576), (193, 160)])
def test_the_int16_activation_kernels_match_their_reference(kind, isa, n, k):
    """--activation-quantization int16: the integer dot products equal dequantized weights times
    the int16-rounded x, up to the order of the sums, at every row count the tiles cover."""
    data, reference = packed_weight(kind, n, k, seed=n * k + 1)
    gen = torch.Generator().manual_seed(k + 1)
    for m in (1, 2, 3, 4, 5, 7, 9, 16):
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
        x[0, :32] = 0  # an all-zero block: scale 0
        expected = int16_activations_reference(x, reference)
        got = packed.linear(x, data, kind, k, isa=isa, activations="int16")
        magnitude = x.abs().double() @ reference.abs().double().T
        assert ((got.double() - expected).abs() <= 1e-5 * magnitude + 1e-6).all(), (kind, isa, m)
        # and within the rounding's bound of the fp32 product: half a step of 1/32767 per value
        exact = F.linear(x.double(), reference.double())
        assert ((got.double() - exact).abs() <= 5e-5 * magnitude + 1e-6).all(), (kind, isa, m)


needs_bf16 = pytest.mark.skipif(not packed.bf16_supported(), reason="this CPU has no AVX512_BF16")


@needs_bf16
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k", [(1, 32), (7, 96), (37, 576), (193, 160)])
def test_the_bf16_activation_kernels_match_their_reference(kind, n, k):
    """--activation-quantization bf16: the bf16 dot products equal the dequantized weights (their
    quantized values are exact in bf16) times x rounded to bf16, up to the order of the sums, at
    row counts in one slab, several, and across passes over slabs (200)."""
    data, reference = packed_weight(kind, n, k, seed=n * k + 2)
    gen = torch.Generator().manual_seed(k + 2)
    for m in (1, 5, 16, 17, 64, 200):
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
        rounded = x.bfloat16().double()
        expected = F.linear(rounded, reference.double())
        got = packed.linear(x, data, kind, k, activations="bfloat16").double()
        magnitude = rounded.abs() @ reference.abs().double().T
        assert ((got - expected).abs() <= 1e-5 * magnitude + 1e-6).all(), (kind, m)
        # and within bf16's rounding of the fp32 product: half a step of 2^-8 per value
        exact = F.linear(x.double(), reference.double())
        assert ((got - exact).abs() <= 2 ** -9 * 1.01 * magnitude + 1e-6).all(), (kind, m)


def test_bf16_activations_need_avx512_bf16():
    data, _ = packed_weight("Q4_1", 8, 64)
    for isa in [isa for isa in ISAS if isa != "avx512+vnni+bf16"]:
        with pytest.raises(packed.native.NativeKernelError, match=re.escape(f"need AVX512_BF16; the {isa}")):
            packed.linear(torch.randn(16, 64), data, "Q4_1", 64, isa=isa, activations="bfloat16")
    with pytest.raises(ValueError, match="activations must be one of float32, int16, bfloat16"):
        packed.linear(torch.randn(16, 64), data, "Q4_1", 64, activations="int8")


def test_packed_linear_rounds_activations_only_in_small_batches():
    """Which path a batch took shows in its result: with a large value in every block, int16's
    rounding moves the products by ~1e-2, fp32's sums by ~1e-5."""
    data, reference = packed_weight("Q4_1", 50, 64)
    layer = PackedLinear(data, "Q4_1", 64, max_kernel_rows=64)

    def nearer_int16(x):
        got = layer(x).double()
        to_int16 = (got - int16_activations_reference(x, reference)).abs().max()
        to_fp32 = (got - F.linear(x.double(), reference.double())).abs().max()
        assert min(to_int16, to_fp32) < 1e-3 < max(to_int16, to_fp32), (to_int16, to_fp32)
        return bool(to_int16 < to_fp32)

    def batch(m):
        x = torch.randn(m, 64)
        x[:, ::32] = 100.0
        return x

    assert not nearer_int16(batch(1))
    layer.int16_activation_rows = 2
    assert [nearer_int16(batch(m)) for m in (1, 2, 3, 32)] == [True, True, False, False]


@needs_bf16
def test_packed_linear_rounds_activations_to_bf16_only_in_large_batches():
    """bf16_activation_rows: batches of at least that many rows (past the kernel's crossover
    too) take x rounded to bf16; smaller ones fp32."""
    data, reference = packed_weight("Q4_1", 50, 64)
    layer = PackedLinear(data, "Q4_1", 64, max_kernel_rows=32)
    layer.bf16_activation_rows = 16

    def nearer_bf16(m):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
        got = layer(x).double()
        to_bf16 = (got - F.linear(x.bfloat16().double(), reference.double())).abs().max()
        to_fp32 = (got - F.linear(x.double(), reference.double())).abs().max()
        assert min(to_bf16, to_fp32) < 1e-4 < max(to_bf16, to_fp32), (to_bf16, to_fp32)
        return bool(to_bf16 < to_fp32)

    assert [nearer_bf16(m) for m in (1, 15, 16, 33, 100)] == [False, False, True, True, True]


@pytest.mark.parametrize("isa", [isa for isa in VECTOR_PATHS if isa in ISAS] or [pytest.param("avx2", marks=pytest.mark.skip("this CPU has no AVX2"))])
def test_each_vector_path_agrees_with_the_portable_one(isa):
    data, _ = packed_weight("Q4_1", 64, 576)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(5))
    for int16 in (False, True):
        fast = packed.linear(x, data, "Q4_1", 576, isa=isa, activations="int16" if int16 else "float32")
        portable = packed.linear(x, data, "Q4_1", 576, isa="portable", activations="int16" if int16 else "float32")
        assert torch.allclose(fast, portable, rtol=1e-4, atol=1e-4)  # the same sums; fused multiply-adds


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists() or "QM_CPU_ISA" in os.environ,
                    reason="reads the CPU's flags from /proc/cpuinfo (and QM_CPU_ISA would cap the path)")
def test_the_library_runs_the_best_path_this_cpu_has():
    """The library's own detection (CPUID and XCR0) against the flags Linux reports, which it
    clears for registers the OS does not save."""
    flags = next((set(line.split(":", 1)[1].split()) for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), set())
    expected = "portable"
    for isa, needs in (("avx2+fma", {"avx2", "fma", "f16c"}), ("avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
                       ("avx512+vnni", {"avx512_vnni"}), ("avx512+vnni+bf16", {"avx512_bf16"})):
        if not needs <= flags:
            break
        expected = isa
    assert packed.isa() == expected


def test_qm_cpu_isa_caps_the_path_and_an_unknown_one_is_a_clear_error():
    """QM_CPU_ISA (read when the library loads: a fresh process each) caps the vector path, for a
    machine that reports instructions it will not run."""
    def isa_with(cap: str) -> subprocess.CompletedProcess:
        code = "from backends import packed; print(packed.isa())"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, "QM_CPU_ISA": cap}, cwd=Path(__file__).resolve().parent.parent)

    assert isa_with("portable").stdout.strip() == "portable"
    if "avx2" in ISAS:
        assert isa_with("avx2").stdout.strip() == "avx2+fma"
    # a cap at or above what the CPU runs leaves the best it runs
    assert isa_with("avx512+vnni+bf16").stdout.strip() == packed.isa()
    unknown = isa_with("sse9")
    assert unknown.returncode != 0 and "QM_CPU_ISA='sse9': expected one of" in unknown.stderr
    assert "BackendUnavailableError" in unknown.stderr  # (what the server says in one line, not a traceback)


def test_a_path_the_cpu_does_not_run_or_an_unknown_one_is_refused():
    data, _ = packed_weight("Q8_0", 4, 64)
    x, y = torch.randn(1, 64), torch.empty(1, 4)
    lib, ffi = packed.library(), packed._ffi()
    rc = lib.qm_linear(8, ffi.cast("void *", data.data_ptr()), 4, 64, ffi.cast("float *", x.data_ptr()), 1,
                       ffi.cast("float *", y.data_ptr()), 7)
    assert rc == 1 and ffi.string(lib.qm_last_error()).decode() == "unknown isa 7"
    missing = [isa for isa in VECTOR_PATHS if isa not in ISAS]
    if missing:
        with pytest.raises(packed.native.NativeKernelError, match="this CPU does not run"):
            packed.linear(x, data, "Q8_0", 64, isa=missing[0])


@pytest.mark.parametrize("kind", KINDS)
def test_packed_linear_small_and_tiled_paths_bias_and_dtype(kind, monkeypatch):
    data, reference = packed_weight(kind, 50, 64)
    bias = torch.randn(50)
    layer = PackedLinear(data, kind, 64, bias, max_kernel_rows=linear_module.PACKED_MAX_ROWS)
    monkeypatch.setattr(linear_module, "_TILE_FLOATS", 64 * 16)  # tiles of 16 rows: four of them
    gen = torch.Generator().manual_seed(KINDS.index(kind))
    for m in (1, linear_module.PACKED_MAX_ROWS, linear_module.PACKED_MAX_ROWS + 1, 100):
        x = torch.randn(2, m, 64, generator=gen)
        # equal up to the order of the sums (a bound from the magnitudes, as above: a relative
        # tolerance on a result that cancels to near zero would not hold)
        bound = 1e-5 * (x.abs() @ reference.abs().T + bias.abs()) + 1e-6
        assert ((layer(x) - F.linear(x, reference, bias)).abs() <= bound).all(), m
    assert layer(torch.randn(3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert torch.equal(layer.rows(torch.tensor([[3, 1]])), reference[[3, 1]][None])
    assert layer.nbytes == data.numel() + bias.numel() * 4


@pytest.mark.parametrize("kernel_over_tiled, expected", [
    ((0.8, 0.95, 1.05, 1.2), 512),  # the kernel keeps sizes where the GEMM is not 1.1x faster
    ((1.15, 0.9, 0.9, 0.9), linear_module.PACKED_MAX_ROWS),  # the first size where it is ends the search
    ((1.0, 1.0, 1.0, 1.0), 1024),  # a tie keeps the kernel (it also keeps the one native call)
])
def test_the_crossover_keeps_the_kernel_unless_the_gemm_is_clearly_faster(monkeypatch, kernel_over_tiled, expected):
    ratios = iter(kernel_over_tiled)
    monkeypatch.setattr(linear_module, "_best_of_alternated", lambda kernel, tiled: (next(ratios), 1.0))
    monkeypatch.delenv("QM_PACKED_MAX_ROWS", raising=False)
    linear_module.packed_max_rows.cache_clear()
    try:
        assert linear_module.packed_max_rows() == expected
    finally:
        linear_module.packed_max_rows.cache_clear()


def test_the_kernels_row_crossover_is_measured_once_or_set(monkeypatch):
    monkeypatch.delenv("QM_PACKED_MAX_ROWS", raising=False)  # (tests/conftest.py sets it for the suite)
    linear_module.packed_max_rows.cache_clear()
    try:
        measured = linear_module.packed_max_rows()
        assert measured in (linear_module.PACKED_MAX_ROWS, *linear_module._CROSSOVER_CANDIDATES)
        assert linear_module.packed_max_rows() == measured  # once per process
        data, _ = packed_weight("Q4_0", 8, 64)
        assert PackedLinear(data, "Q4_0", 64).max_kernel_rows == measured
        linear_module.packed_max_rows.cache_clear()
        monkeypatch.setenv("QM_PACKED_MAX_ROWS", "96")
        assert linear_module.packed_max_rows() == 96
        linear_module.packed_max_rows.cache_clear()
        monkeypatch.setenv("QM_PACKED_MAX_ROWS", "abc")  # a start-up error naming it, not a traceback
        with pytest.raises(ConfigError, match="QM_PACKED_MAX_ROWS='abc': expected a number of rows"):
            linear_module.packed_max_rows()
    finally:
        linear_module.packed_max_rows.cache_clear()


def test_the_start_up_log_says_how_activations_are_multiplied():
    from engine.models import loader

    assert loader._activations_line("none", auto=True) == "float32"
    assert loader._activations_line("none", auto=False) == "float32"
    assert loader._activations_line("int16", auto=False) == "int16"
    assert loader._activations_line("bf16", auto=False) == "bf16 in batches of 16+ rows"
    line = loader._activations_line("bf16", auto=True)
    assert line.startswith("bf16 in batches of 16+ rows (auto: this CPU has AVX512_BF16") and "none keeps float32" in line


@pytest.mark.parametrize("bf16_cpu", [False, True])
def test_auto_activations_are_bf16_exactly_where_the_cpu_multiplies_bf16(monkeypatch, bf16_cpu):
    """The default (issue 41): bf16 in batches of 16+ rows on an AVX512_BF16 CPU, float32 elsewhere,
    and float32 without packed weights (where bf16 asked for by name is an error)."""
    import engine.models.loader as loader

    monkeypatch.setattr(loader, "packed_bf16_supported", lambda: bf16_cpu)
    source = loader.resolve_model(None)
    model = loader.load_model(source, "auto", torch.float32, "cpu", 0, activation_quantization="auto")
    packed_linears = [lin for lin in model.linears() if isinstance(lin, PackedLinear)]
    assert len(packed_linears) == 121
    assert {lin.bf16_activation_rows for lin in packed_linears} == ({16} if bf16_cpu else {None})
    assert {lin.int16_activation_rows for lin in packed_linears} == {0}
    dense = loader.load_model(source, "auto", torch.float32, "cpu", 0, quantization="none",
                              activation_quantization="auto")
    assert not any(isinstance(lin, PackedLinear) for lin in dense.linears())


def test_auto_activations_are_the_default_and_float32_under_batch_invariance():
    from api.server import build_parser, engine_config
    from engine.config import EngineConfig

    config = engine_config(build_parser().parse_args([]))
    assert config.activation_quantization == "auto" and config.activations == "auto"
    assert EngineConfig(batch_invariant=True).activations == "none"  # bf16 rounding follows the batch size
    assert EngineConfig(activation_quantization="bf16").activations == "bf16"
    with pytest.raises(ConfigError, match="activation quantization bf16 rounds them by batch size"):
        EngineConfig(batch_invariant=True, activation_quantization="bf16")


def test_bad_arguments_are_clear_errors():
    data, _ = packed_weight("Q8_0", 4, 64)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        packed.row_bytes("Q8_0", 48)
    with pytest.raises(ValueError, match="do not hold 96"):
        packed.linear(torch.randn(1, 96), data, "Q8_0", 96)
    with pytest.raises(ValueError, match="no kernel"):
        packed.linear(torch.randn(1, 64), data, "Q6_K", 64)
    with pytest.raises(ValueError, match="float32"):
        packed.linear(torch.randn(1, 64, dtype=torch.float64), data, "Q8_0", 64)
    with pytest.raises(ValueError, match=r"row ids must be in \[0, 4\)"):
        packed.dequantize_rows(data, "Q8_0", 64, torch.tensor([4]))


# ---- loading ----

def write_gguf(path, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    writer = GGUFWriter(str(path), "llama")
    for name, (values, kind) in tensors.items():
        qtype = GGMLQuantizationType[kind]
        data = quantize(values, qtype) if kind != "F32" else values
        writer.add_tensor(name, data, raw_shape=data.shape if kind == "F32" else None, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_loader_keeps_packed_types_packed_and_names_a_truncated_tensor(tmp_path):
    from engine.models.linear import PackedWeight
    from engine.models.llama import LlamaConfig
    from engine.models.loader import gguf_weights

    rng = np.random.default_rng(0)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, {"blk.0.ffn_up.weight": (rng.standard_normal((8, 64), dtype=np.float32), "Q4_1"),
                      "blk.0.ffn_down.weight": (rng.standard_normal((64, 8 * 32), dtype=np.float32), "Q8_0"),
                      "output_norm.weight": (np.ones(64, dtype=np.float32), "F32")})
    config = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=1,
                         num_kv_heads=1, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
                         tie_word_embeddings=True)
    weights = dict(gguf_weights(path, config, keep_packed=True))
    up = weights["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(up, PackedWeight) and up.kind == "Q4_1" and up.shape == (8, 64)
    assert weights["model.norm.weight"].dtype == torch.float32
    dense = dict(gguf_weights(path, config))
    assert torch.equal(up.dequantize(), dense["model.layers.0.mlp.up_proj.weight"])

    path.write_bytes(path.read_bytes()[:-100])  # the last tensor loses its end
    with pytest.raises(ConfigError, match="tiny.gguf .*truncated or corrupt"):
        list(gguf_weights(path, config, keep_packed=True))


def test_the_loaders_gguf_reader_reads_what_ggufs_own_reader_reads():
    """The loader's reader (gguf's, slicing a plain view of the memmap: 3x faster to open) gives
    every field and tensor of the default model file exactly as gguf's stock reader does."""
    from gguf import GGUFReader

    from engine.models.loader import _gguf_reader, resolve_model

    path = resolve_model(None).path
    ours, stock = _gguf_reader(path), GGUFReader(path)
    assert type(ours) is not GGUFReader  # (this gguf's _get is the one the override was written for)
    assert list(ours.fields) == list(stock.fields)
    for key, field in stock.fields.items():
        assert ours.fields[key].types == field.types and ours.fields[key].contents() == field.contents(), key
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in stock.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, stock.tensors))


def random_q4_k(n: int, k: int, seed: int = 0, d: float = 0.01, dmin: float = 0.003) -> np.ndarray:
    """Random Q4_K rows (super-blocks of 256 values: fp16 d and dmin, 12 bytes of 6-bit scales
    and minimums, 128 bytes of nibbles); gguf can read Q4_K but not write it."""
    raw = np.random.default_rng(seed).integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    raw[..., 0:2] = np.full((n, k // 256, 1), d, np.float16).view(np.uint8)
    raw[..., 2:4] = np.full((n, k // 256, 1), dmin, np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def test_q4_k_converts_to_q4_1_with_its_levels():
    from engine.models.linear import q4_k_to_q4_1

    n, k = 6, 512
    # Scales that are powers of two: every d * sc and dmin * m is exact in fp16, so the
    # conversion must give GGUF's values exactly (any reordering mistake shows).
    raw = random_q4_k(n, k, d=2**-7, dmin=2**-8)
    reference = torch.from_numpy(np.array(dequantize(raw, GGMLQuantizationType.Q4_K), dtype=np.float32).reshape(n, k))
    converted = q4_k_to_q4_1(raw, n, k)
    assert converted.kind == "Q4_1" and converted.data.shape == (n, k // 32 * 20)
    assert torch.equal(converted.dequantize(), reference)
    # Other scales and minimums round to fp16 (half an ulp each, 2^-11 relative): within 2^-10
    # of each sub-block's largest value.
    raw = random_q4_k(n, k, seed=1)
    reference = torch.from_numpy(np.array(dequantize(raw, GGMLQuantizationType.Q4_K), dtype=np.float32).reshape(n, k))
    error = (q4_k_to_q4_1(raw, n, k).dequantize() - reference).abs().reshape(-1, 32)
    assert (error <= reference.abs().reshape(-1, 32).amax(dim=1, keepdim=True) * 2**-10).all()


def test_the_loader_converts_other_quantized_types_and_says_so(tmp_path, caplog):
    from engine.models.linear import PackedWeight
    from engine.models.llama import LlamaConfig
    from engine.models.loader import gguf_weights

    path = tmp_path / "kquants.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", random_q4_k(8, 256), raw_dtype=GGMLQuantizationType.Q4_K)
    w = np.random.default_rng(2).standard_normal((256, 64), dtype=np.float32)
    writer.add_tensor("blk.0.ffn_down.weight", quantize(w, GGMLQuantizationType.Q5_0),
                      raw_dtype=GGMLQuantizationType.Q5_0)
    writer.add_tensor("blk.0.ffn_gate.weight", w.T.astype(np.float16).copy())
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()
    config = LlamaConfig(vocab_size=8, hidden_size=256, intermediate_size=8, num_layers=1, num_heads=4,
                         num_kv_heads=4, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
                         tie_word_embeddings=True)
    dense = dict(gguf_weights(path, config))
    with caplog.at_level("WARNING"):
        weights = dict(gguf_weights(path, config, keep_packed=True))
    up, down = weights["model.layers.0.mlp.up_proj.weight"], weights["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(up, PackedWeight) and up.kind == "Q4_1" and up.shape == (8, 256)
    assert isinstance(down, PackedWeight) and down.kind == "Q8_M" and down.shape == (256, 64)
    for weight, name, steps in ((up, "up", 0), (down, "down", 255)):
        blocks = dense[f"model.layers.0.mlp.{name}_proj.weight"].reshape(-1, 32)
        error = (weight.dequantize().reshape(-1, 32) - blocks).abs().amax(dim=1)
        # Q4_K -> Q4_1 keeps the levels (fp16 rounding of the scales only); Q5_0 -> Q8_M lands
        # within half of its 255 steps per block (and the same fp16 rounding).
        half_step = (blocks.amax(dim=1) - blocks.amin(dim=1)) / steps / 2 if steps else 0
        assert (error <= half_step + blocks.abs().amax(dim=1) * 2**-10).all(), name
    gate = weights["model.layers.0.mlp.gate_proj.weight"]
    assert gate.dtype == torch.float32  # a float matrix is never re-quantized
    assert "1 Q4_K tensors have no kernel of their own: converted to Q4_1" in caplog.text
    assert "1 Q5_0 tensors have no kernel of their own: converted to Q8_M" in caplog.text
    assert "1 F16 tensors have no kernel of their own: converted to float32" in caplog.text


@pytest.mark.slow
def test_the_default_models_weights_stay_within_their_file_size(shared_llm):
    from engine.models.loader import _gguf_reader, resolve_model

    file_bytes = sum(int(t.n_bytes) for t in _gguf_reader(resolve_model(None).path).tensors)
    kinds, resident = shared_llm.engine.model.weight_summary()
    assert kinds == {"Q4_1": 120, "Q8_0": 1}
    assert resident <= 1.2 * file_bytes, (resident, file_bytes)


# ---- int8 weight-only ----

def test_int8_keeps_every_value_within_half_a_step_of_its_blocks_own_range():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(3)) * 0.05
    w[3, :32], w[5, 7] = 0, 0.5  # an all-zero block; an outlier
    w[9] = 0.2 + 0.1 * torch.rand(96, generator=torch.Generator().manual_seed(4))  # all positive
    packed_w = quantize_q8_m(w)
    assert packed_w.kind == "Q8_M" and packed_w.data.shape == (64, 3 * 36)
    got = packed_w.dequantize()
    assert torch.equal(got, q8_m_reference(packed_w.data, 96))
    blocks, values = w.reshape(-1, 32), got.reshape(-1, 32)
    step = (blocks.amax(1) - blocks.amin(1)) / 255
    error = (values - blocks).abs().amax(1)
    assert (error <= 0.51 * step + blocks.abs().amax(1) * 2 ** -10).all()
    assert torch.equal(got[3, :32], torch.zeros(32))
    # A block away from zero gets levels over its own range: a step of 0.1/255, where a
    # symmetric scale (max |w| / 127) would step 0.3/127.
    assert error.reshape(64, 3)[9].max() < 0.3 / 127 / 4
    with pytest.raises(ValueError, match="finite"):
        quantize_q8_m(torch.full((2, 32), float("nan")))


def test_int8_on_a_quantized_file_is_a_clear_error():
    from engine.models.loader import load_model, resolve_model

    with pytest.raises(ConfigError, match="already quantized"):
        load_model(resolve_model(None), "auto", torch.float32, "cpu", 0, quantization="int8")


@pytest.mark.parametrize("kind", ["int16", "bf16"])
def test_activation_quantization_needs_packed_weights_on_cpu(kind):
    from engine.models.loader import load_model, resolve_model

    with pytest.raises(ConfigError, match=f"activation quantization {kind} needs packed weights") as error:
        load_model(resolve_model(None), "auto", torch.float32, "cpu", 0, quantization="none",
                   activation_quantization=kind)
    assert error.value.param == "activation_quantization"


def test_bf16_activations_on_a_cpu_without_avx512_bf16_are_a_clear_error(monkeypatch):
    import engine.models.loader as loader

    monkeypatch.setattr(loader, "packed_bf16_supported", lambda: False)
    with pytest.raises(ConfigError, match="needs a CPU with AVX512_BF16; this one runs the") as error:
        loader.load_model(loader.resolve_model(None), "auto", torch.float32, "cpu", 0, activation_quantization="bf16")
    assert error.value.param == "activation_quantization"


def test_the_flag_turns_int16_activations_on_for_decodes_of_one_or_two_streams():
    from api.server import build_parser, engine_config
    from engine.api import LLM, SamplingParams
    from engine.models.linear import INT16_ACTIVATION_MAX_ROWS

    config = engine_config(build_parser().parse_args(["--activation-quantization", "int16"]))
    assert config.activation_quantization == "int16"
    llm = LLM(backend="cpu", **dict(FP32, activation_quantization="int16"), num_kv_blocks=64)
    linears = llm.engine.model.linears()
    assert len(linears) == 121 and {lin.int16_activation_rows for lin in linears} == {INT16_ACTIVATION_MAX_ROWS}
    prompts = ["The capital of France is", "One, two, three,"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]  # decodes of two rows
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]  # of one
    assert together == alone and all(len(t) == 8 for t in together)


@needs_bf16
def test_the_flag_turns_bf16_activations_on_for_batches_of_16_rows_or_more():
    from api.server import build_parser, engine_config
    from engine.api import LLM, SamplingParams
    from engine.models.linear import BF16_ACTIVATION_MIN_ROWS

    config = engine_config(build_parser().parse_args(["--activation-quantization", "bf16"]))
    assert config.activation_quantization == "bf16"
    llm = LLM(backend="cpu", **dict(FP32, activation_quantization="bf16"), num_kv_blocks=64)
    linears = llm.engine.model.linears()
    assert {(lin.bf16_activation_rows, lin.int16_activation_rows) for lin in linears} == {(BF16_ACTIVATION_MIN_ROWS, 0)}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    fp32 = LLM(backend="cpu", **FP32, num_kv_blocks=64)
    prompt = "The capital of France is a city of many bridges, museums and"  # a prefill of 16+ rows
    tokens = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert len(tokens) == 8 and tokens == fp32.generate(prompt, params)[0].outputs[0].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("kind, rows", [("int16", 1 << 30), ("bf16", 1)])
def test_rounded_activations_agree_with_fp32_activations_over_the_projects_own_text(tokenizer, kind, rows):
    """The default model's packed weights, teacher-forced over the README and the benchmark notes
    (read now), with every product's activations rounded to int16 (the engine does it only for
    batches of one or two rows; here for every prefill row, to judge it over 3000 positions) or
    to bf16 (every batch here, of 16 rows or more in the engine) against fp32 activations: top-1
    agreement >= 99%, only near-ties flip, perplexity within 2%. (int8 activations, as
    llama.cpp rounds them, changed 121 of these 2999 top-1 tokens: 96.0%.)"""
    if kind == "bf16" and not packed.bf16_supported():
        pytest.skip("this CPU has no AVX512_BF16")
    import math
    from pathlib import Path

    from engine.api import LLM, SamplingParams

    root = Path(__file__).resolve().parent.parent
    text = (root / "README.md").read_text() + (root / "bench" / "README.md").read_text()
    ids = tokenizer.encode(text)[:3000]
    assert len(ids) == 3000
    llm = LLM(backend="cpu", **FP32, num_kv_blocks=256)
    results = {}
    for activations in ("none", kind):
        assert llm.engine.model.quantize_activations(activations, rows) == 121
        output = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
        positions = [sorted(p.items(), key=lambda item: item[1].rank) for p in output.prompt_logprobs[1:]]
        nll = -sum(dict(p)[t].logprob for p, t in zip(positions, ids[1:])) / len(positions)
        results[activations] = positions, math.exp(nll)
    (fp32, fp32_ppl), (rounded, rounded_ppl) = results["none"], results[kind]
    assert fp32 != rounded  # the rounding did happen
    flips = [a for a, b in zip(fp32, rounded) if a[0][0] != b[0][0]]
    margins = [a[0][1].logprob - next(lp.logprob for _, lp in a if lp.rank == 2) for a in flips]
    assert len(flips) <= 0.01 * len(fp32), len(flips)
    assert all(m < 0.3 for m in margins), max(margins)
    assert abs(rounded_ppl / fp32_ppl - 1) <= 0.02, (rounded_ppl, fp32_ppl)
    print(f"{kind} activations: {len(flips)} of {len(fp32)} top-1 differ (largest fp32 margin {max(margins, default=0):.3f}); "
          f"perplexity {rounded_ppl:.5f} vs {fp32_ppl:.5f}")


@pytest.fixture(scope="module")
def fp32_model_dir(tmp_path_factory, tokenizer):
    """The default model dequantized to fp32, as a Hugging Face directory (safetensors)."""
    import json

    from safetensors.torch import save_file

    from engine.models.loader import _gguf_reader, gguf_config, gguf_weights, resolve_model

    path = resolve_model(None).path
    config = gguf_config(_gguf_reader(path))
    directory = tmp_path_factory.mktemp("fp32-model")
    save_file(dict(gguf_weights(path, config)), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings, "tie_word_embeddings": True,
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}))
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_int8_agrees_with_fp32_over_the_projects_own_text(fp32_model_dir, tokenizer):
    """Teacher-forced over the README and the benchmark notes (read now). Measured: the int8
    model (layers in Q8_M, LM head fp32) picks the fp32 model's top-1 token at 99.8% of 3000
    positions (7 differ, each where fp32's top two were within 0.009 nats); perplexity
    +0.005%. With a symmetric int8 scale (Q8_0) it was 98.0%; with the LM head in Q8_M too,
    99.0%. (This fp32 model is the dequantized Q4_1 file, whose 16 levels per block Q8_M's 256
    nearly hold; on a copy with its weights moved off that grid, Q8_0 and Q8_M agreed on
    96.9% and 97.2%: that model has twice the near-ties.)"""
    import math
    from pathlib import Path

    from engine.api import LLM, SamplingParams

    root = Path(__file__).resolve().parent.parent
    text = (root / "README.md").read_text() + (root / "bench" / "README.md").read_text()
    ids = tokenizer.encode(text)[:3000]
    assert len(ids) == 3000
    results = {}
    for quantization in ("none", "int8"):
        llm = LLM(str(fp32_model_dir), backend="cpu", **FP32, num_kv_blocks=256, quantization=quantization)
        assert llm.engine.model.weight_summary()[0] == ({"Q8_M": 120, "float32": 1} if quantization == "int8" else {"float32": 121})
        output = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
        positions = [sorted(p.items(), key=lambda item: item[1].rank) for p in output.prompt_logprobs[1:]]
        nll = -sum(dict(p)[t].logprob for p, t in zip(positions, ids[1:])) / len(positions)
        results[quantization] = positions, math.exp(nll)
    (fp32, fp32_ppl), (int8, int8_ppl) = results["none"], results["int8"]
    flips = [a for a, b in zip(fp32, int8) if a[0][0] != b[0][0]]
    margins = [a[0][1].logprob - next(lp.logprob for _, lp in a if lp.rank == 2) for a in flips]
    assert len(flips) <= 0.01 * len(fp32), len(flips)
    assert all(m < 0.3 for m in margins), max(margins)  # only near-ties flip
    assert abs(int8_ppl / fp32_ppl - 1) <= 0.02, (int8_ppl, fp32_ppl)
