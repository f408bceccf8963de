"""The model's matrix products behind one small interface (vLLM calls it a linear method):
dense weights, or weights kept packed as the GGUF file stores them.

The forward pass calls ``layer(x)`` and never looks at how the weight is held; the loader
picks the kind per tensor.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Protocol

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from backends import packed as packed_kernels
from engine.errors import ConfigError

# Up to a crossover in rows of x, the packed kernel (each block read once for every row) beats
# dequantizing the weight and a GEMM; above it, the weight is dequantized a tile of rows at a
# time into a scratch buffer and multiplied by torch's GEMM. The kernel (AVX2): up to 12 rows,
# each block is dequantized in registers and fed to 5-12 rows at once (under 5, its offset is
# folded out); from 13 rows, six output rows at a time are dequantized into an L1 panel and
# multiplied as a small GEMM (16 x 6 blocks of y in registers, slabs of 16 rows of x; up to 8
# rows past the last whole slab in the row tiles); AVX-512 dequantizes into 16-lane tiles of
# 2-15 rows and takes panels from 16 rows (quant_kernel.cpp says why). The crossover differs
# by machine, so it is measured once per process (packed_max_rows). Measured on the default model's layer shapes (2
# threads): AMD EPYC Zen 3, ms for four layers: M=64 kernel 3.22-3.26 / tiled 3.68 / fp32 3.09;
# M=96 5.04 / 4.87 / 4.31; M=128 7.1 / 6.1 / 5.5 (crossover ~90). AMD EPYC family 23, the seven
# layers of a block: M=64 8.30 / 11.78 / 9.35; M=128 16.6 / 20.7 / 18.8; M=256 33.5 / 34.3 / 31.9
# (the kernel ahead up to 256). There, after the kernel's later work, GFLOP/s kernel /
# tiled at M=512 and 1024: 960 x 576 144 / 107, 139 / 106; 3072 x 576 (gate + up) 119 / 101,
# 120 / 96; 576 x 1536 119 / 112, 109 / 126 (the one shape the probe's 1536 x 576 does not speak
# for): prefill steps of 512 / 1024 prompt tokens ran 1.13-1.20x / 1.12-1.13x as fast with the
# kernel (bench/step_cost.py --decodes 1).
# One layer timed alone flatters dequantize + GEMM: its dequantized tile stays in cache, and in
# the model a batch past the crossover also leaves the cpu backend's one native call for the
# decoder stack (an op at a time from Python). AMD EPYC Zen 3 (family 25), 2026-12-05: alone,
# kernel / tiled 0.75 / 0.87 / 0.95 / 1.03 at 128 / 256 / 512 / 1024 rows (warm; 0.84-1.02 at 128
# in a fresh process, so a 0.9 bar picked 64 or 128 by chance); in the engine, 60 decodes +
# 96 / 196 / 452 / 964 prompt tokens, kernel up to 1024 rows against up to 64: 297 / 445 / 893 /
# 1929 ms against 417 / 564 / 940 / 1863 (bench/step_cost.py). So the kernel keeps a size
# unless the probe finds dequantize + GEMM clearly faster there.
PACKED_MAX_ROWS = 64  # the least crossover: what packed_max_rows starts from
TILED_CLEARLY_FASTER = 1.1  # kernel time / dequantize + GEMM time above which a size goes to the GEMM
# --activation-quantization int16 rounds x to int16 for batches of up to this many rows (decode
# of one or two streams), where integer dot products are faster; from 4 rows fp32 activations are
# as fast. AMD EPYC family 23 (Zen 1), 2 threads, packed kernel ms fp32 / int16 activations:
# Q4_1 1536 x 576 M=1 0.165 / 0.125, M=2 0.197 / 0.160, M=4 0.199 / 0.188; 576 x 1536 M=1 0.099 /
# 0.078, M=4 0.195 / 0.202; the Q8_0 LM head (49152 x 576) M=1 3.13 / 2.26, M=2 4.12 / 3.21.
INT16_ACTIVATION_MAX_ROWS = 2
# --activation-quantization bf16 rounds x to bf16 for batches of at least this many rows, where
# the products are compute-bound and AVX512_BF16's dot products do twice the multiply-adds of an
# fp32 FMA per instruction (bench/packed.py --paths); below it the products stream the weights
# and rounding x gains nothing.
BF16_ACTIVATION_MIN_ROWS = 16
_CROSSOVER_CANDIDATES = (128, 256, 512, 1024)
# Rows of the dequantized tile hold at most this many floats (16 MiB): the LM head of a large
# vocabulary is never dequantized whole.
_TILE_FLOATS = 4 * 1024 * 1024


@attrs.frozen(eq=False)
class PackedWeight:
    """A weight as the GGUF file stores it: ``data`` is ``[out, row_bytes]`` uint8 in ``kind``'s
    block format, ``shape`` is (out, in) in values."""

    data: torch.Tensor
    kind: str
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        return packed_kernels.dequantize_range(self.data, self.kind, self.shape[1], 0, self.shape[0])

    @property
    def nbytes(self) -> int:
        return _bytes(self.data)


def quantize_q8_m(weight: torch.Tensor) -> PackedWeight:
    """``weight`` ``[out, in]`` as Q8_M (``--quantization int8``): per 32 values an fp16 scale
    ``d = (max - min) / 255`` and minimum ``m``, and uint8 ``q`` with value ``q * d + m``.

    Asymmetric: the 256 levels span each block's own range, so the step is at most what a
    symmetric int8 scale (max |w| / 127) gives, and often half of it. Measured on the default
    model's layers, teacher-forced over 3000 tokens (tests/test_packed.py): Q8_0 agreed with
    fp32 on 98.0% of top-1 tokens, Q8_M on 99.8%. Part of that margin is the model's Q4_1
    origin, whose 16 levels per block Q8_M holds almost exactly.
    """
    out_features, in_features = weight.shape
    if in_features % packed_kernels.BLOCK:
        raise ValueError(f"int8 needs rows of whole {packed_kernels.BLOCK}-value blocks; got {in_features}")
    blocks = weight.detach().to(torch.float32).reshape(-1, packed_kernels.BLOCK)
    if not torch.isfinite(blocks).all() or blocks.abs().max() > 65504:
        raise ValueError("int8 needs finite weights within fp16's range")
    low = blocks.amin(dim=1, keepdim=True).to(torch.float16)
    scale = ((blocks.amax(dim=1, keepdim=True) - low.float()) / 255).to(torch.float16)
    inverse = torch.where(scale == 0, torch.zeros_like(scale, dtype=torch.float32), 1 / scale.float())
    values = ((blocks - low.float()) * inverse).round().clamp(0, 255).to(torch.uint8)
    data = torch.cat([scale.view(torch.uint8), low.view(torch.uint8), values], dim=1)
    return PackedWeight(data.reshape(out_features, -1).contiguous(), "Q8_M", (out_features, in_features))


def q4_k_to_q4_1(data: np.ndarray, out_features: int, in_features: int) -> PackedWeight:
    """GGUF Q4_K rows (super-blocks of 256 values, 144 bytes) as Q4_1 (blocks of 32): the same
    16 levels per 32 values. Each Q4_K sub-block of 32 is ``d * sc * q - dmin * m`` with 6-bit
    ``sc`` and ``m``; as Q4_1 its scale ``d * sc`` and minimum ``-dmin * m`` are rounded to
    fp16 (a relative 2^-12 of a step at most), and its nibbles are reordered."""
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    s = blocks[:, 4:16].astype(np.uint8)
    # The 8 six-bit scales and minimums (ggml's get_scale_min_k4).
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    qs = blocks[:, 16:].reshape(-1, 4, 32)
    # Sub-block 2i holds the low nibbles of qs[i], 2i + 1 the high ones.
    values = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    nibbles = values[:, :, :16] | (values[:, :, 16:] << 4)  # Q4_1: byte t holds values t and t + 16
    scale = (d * sc).astype(np.float16)
    minimum = (-(dmin * mn)).astype(np.float16)
    out = np.concatenate([scale[..., None].view(np.uint8), minimum[..., None].view(np.uint8), nibbles], axis=2)
    return PackedWeight(torch.from_numpy(out.reshape(out_features, -1).copy()), "Q4_1", (out_features, in_features))


class Linear(Protocol):
    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T (+ bias)`` over the last dimension of ``x``."""

    @property
    def nbytes(self) -> int:
        """Bytes the weight (and bias) take in memory."""


class DenseLinear:
    """A weight held as a plain tensor (fp32 or bf16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        self._fixed: packed_kernels.DenseMatrix | None = None  # set by fix_order

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._fixed is None:
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        y = self._fixed.linear(x.reshape(-1, self.in_features).to(torch.float32).contiguous())
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).view(*lead, self.out_features)

    def fix_order(self, fixed: bool = True) -> None:
        """Sum every row of the product in one order whatever the batch (batch invariance): the
        packed library's row tiles over the plain weight instead of torch's GEMM, whose blocking
        (and so each output's sum order) follows the number of rows. CPU, float32 or bfloat16."""
        self._fixed = packed_kernels.DenseMatrix(self.weight) if fixed else None

    def activations_for(self, m: int) -> str | None:
        """``fixed_order`` when the product goes through the packed library's row tiles, else None
        (torch's GEMM): ``PackedLinear.activations_for``'s question."""
        return None if self._fixed is None else "fixed_order"

    @property
    def matrix(self) -> packed_kernels.DenseMatrix | None:
        return self._fixed

    @property
    def nbytes(self) -> int:
        return _bytes(self.weight) + _bytes(self.bias)

    @property
    def kind(self) -> str:
        return str(self.weight.dtype).removeprefix("torch.")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight (when it doubles as an embedding table)."""
        return F.embedding(ids, self.weight)


class PackedLinear:
    """A weight kept in a packed block format (GGUF's Q4_0, Q4_1, Q8_0, or Q8_M): ``[out, row_bytes]`` uint8.

    Computes in fp32 from the stored values (the same values GGUF's reference dequantizes
    to), and returns the dtype of ``x``.
    """

    def __init__(self, packed: torch.Tensor, kind: str, in_features: int, bias: torch.Tensor | None = None, *,
                 max_kernel_rows: int | None = None) -> None:
        if packed.shape[1] != packed_kernels.row_bytes(kind, in_features):
            raise ValueError(f"{kind} rows of {packed.shape[1]} bytes do not hold {in_features} values")
        self.packed, self.kind, self.bias = packed.contiguous(), kind, bias
        self.in_features, self.out_features = in_features, packed.shape[0]
        self._matrix = packed_kernels.PackedMatrix(self.packed, kind, in_features)
        # A weight larger than one tile (the LM head) would be dequantized through many tiles
        # per call: the kernel stays ahead of that up to 4x as many rows (bench/packed.py).
        large = self.out_features * in_features > _TILE_FLOATS
        if max_kernel_rows is None:
            max_kernel_rows = packed_max_rows() * (4 if large else 1)
        self.max_kernel_rows = max_kernel_rows
        # LlamaModel.quantize_activations: batches of up to int16_activation_rows rows round x to
        # int16; of at least bf16_activation_rows (when set), to bf16
        self.int16_activation_rows = 0
        self.bf16_activation_rows: int | None = None
        self.fixed_order = False  # fix_order: the row tiles at every batch size

    def fix_order(self, fixed: bool = True) -> None:
        """Sum every row of the product in one order whatever the batch (batch invariance): the
        kernel's row tiles at every size, never its panels, the dequantized tiles of larger
        batches or rounded activations."""
        self.fixed_order = fixed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == self.in_features and x.is_contiguous():
            return self._linear(x)  # the model's case, with no reshaping (~120 calls a decode step)
        lead = x.shape[:-1]
        y = self._linear(x.reshape(-1, self.in_features).to(torch.float32).contiguous())
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y.view(*lead, self.out_features)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for fp32 contiguous ``x`` ``[M, in_features]``."""
        activations = self.activations_for(x.shape[0])
        y = self._tiled(x) if activations is None else self._matrix.linear(x, activations=activations)
        if self.bias is not None:
            y += self.bias
        return y

    def activations_for(self, m: int) -> str | None:
        """How a product of ``m`` rows takes x in the packed library (``packed.ACTIVATIONS``, or
        ``fixed_order``), or None where it dequantizes tiles for torch's GEMM instead."""
        if self.fixed_order:
            return "fixed_order"
        if m <= self.int16_activation_rows:
            return "int16"
        if self.bf16_activation_rows is not None and m >= self.bf16_activation_rows:
            return "bfloat16"  # (panels at every size: faster than _tiled)
        return "float32" if m <= self.max_kernel_rows else None

    @property
    def matrix(self) -> packed_kernels.PackedMatrix:
        """The weight as the packed library takes it."""
        return self._matrix

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        rows = max(1, min(self.out_features, _TILE_FLOATS // self.in_features))
        tile = _scratch(rows * self.in_features)
        if rows == self.out_features:
            return F.linear(x, packed_kernels.dequantize_range(self.packed, self.kind, self.in_features, 0, rows,
                                                               out=tile))
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        for begin in range(0, self.out_features, rows):
            end = min(self.out_features, begin + rows)
            w = packed_kernels.dequantize_range(self.packed, self.kind, self.in_features, begin, end, out=tile)
            out[:, begin:end] = F.linear(x, w)
        return out

    def dequantize(self) -> torch.Tensor:
        """The whole weight as fp32 ``[out, in]``."""
        return packed_kernels.dequantize_range(self.packed, self.kind, self.in_features, 0, self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` as fp32 (when the weight doubles as an embedding table)."""
        flat = packed_kernels.dequantize_rows(self.packed, self.kind, self.in_features, ids.reshape(-1))
        return flat.view(*ids.shape, self.in_features)

    @property
    def nbytes(self) -> int:
        return _bytes(self.packed) + _bytes(self.bias)


@functools.cache
def packed_max_rows() -> int:
    """The most rows of x for which the packed kernel is used on this machine: ``PACKED_MAX_ROWS``,
    or a larger candidate at which dequantize + GEMM is not clearly faster (``TILED_CLEARLY_FASTER``),
    timed once per process on a layer of the default model's largest shape (1536 x 576, Q4_1; about
    0.3 s). ``QM_PACKED_MAX_ROWS`` in the environment sets it instead."""
    override = os.environ.get("QM_PACKED_MAX_ROWS")
    if override:
        try:
            return max(1, int(override))
        except ValueError:
            why = (f"QM_PACKED_MAX_ROWS={override!r}: expected a number of rows (the most a packed kernel "
                   "multiplies before dequantize + GEMM)")
            raise ConfigError("QM_PACKED_MAX_ROWS", why) from None
    out_features, in_features = 1536, 576
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (out_features, packed_kernels.row_bytes("Q4_1", in_features)), dtype=torch.uint8,
                         generator=generator)
    data.view(-1, 20)[:, :4] = torch.tensor([0x00, 0x2c, 0x00, 0xac], dtype=torch.uint8)  # d = 1/16, m = -1/16
    probe = PackedLinear(data, "Q4_1", in_features, max_kernel_rows=0)
    inputs = [torch.randn(rows, in_features, generator=generator) for rows in _CROSSOVER_CANDIDATES]
    kernel, tiled = probe._matrix.linear, probe._tiled
    kernel(inputs[-1]), tiled(inputs[-1])  # warm: the thread pool, the GEMM library, the whole scratch tile
    best = PACKED_MAX_ROWS
    for rows, x in zip(_CROSSOVER_CANDIDATES, inputs):
        # A clear margin, so that a near tie does not flip the choice (and the order of sums) between runs.
        kernel_s, tiled_s = _best_of_alternated(lambda: kernel(x), lambda: tiled(x))
        if kernel_s > TILED_CLEARLY_FASTER * tiled_s:
            break
        best = rows
    return best


def _best_of_alternated(first, second, repeat: int = 5) -> tuple[float, float]:
    """The least time of each of two calls, run in turn ``repeat`` times (a slow moment of a
    shared machine then falls on both)."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for run, taken in zip((first, second), times):
            start = time.perf_counter()
            run()
            taken.append(time.perf_counter() - start)
    return min(times[0]), min(times[1])


# Up to this many rows the CUDA kernel (each block read once per 8 rows of x) is used, above
# it a dequantized weight and cuBLAS. Not yet measured on a GPU: bench/gpu_check.sh runs
# bench/packed.py --cuda, which prints both paths at M = 1, 8, 32, 128.
CUDA_PACKED_MAX_ROWS = 16
# Dequantized tiles on the GPU hold at most this many values (an LM head is never dequantized whole).
_CUDA_TILE_VALUES = 64 * 1024 * 1024


class CudaPackedLinear:
    """A packed weight on the GPU (``libqm_cuda.so``): the kernel for small batches, dequantized
    tiles and torch's GEMM for large ones; returns the dtype of ``x`` (fp32 sums)."""

    def __init__(self, packed: torch.Tensor, kind: str, in_features: int, bias: torch.Tensor | None = None,
                 lib=None) -> None:
        self.kind, self.bias, self.in_features, self.out_features = kind, bias, in_features, packed.shape[0]
        self._lib = lib
        self._matrix = packed_kernels.CudaPackedMatrix(packed.contiguous(), kind, in_features, lib)
        self.packed = self._matrix.data

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        if x2.shape[0] <= CUDA_PACKED_MAX_ROWS:
            y = self._matrix.linear(x2)
        else:
            rows = max(1, min(self.out_features, _CUDA_TILE_VALUES // self.in_features))
            y = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype, device=x.device)
            for begin in range(0, self.out_features, rows):
                end = min(self.out_features, begin + rows)
                y[:, begin:end] = F.linear(x2, self._matrix.dequantize(begin, end, x.dtype))
        if self.bias is not None:
            y += self.bias.to(y.dtype)
        return y.view(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The whole weight as fp32 ``[out, in]``."""
        return self._matrix.dequantize(0, self.out_features, torch.float32)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` as fp32 (when the weight doubles as an embedding table)."""
        picked = packed_kernels.CudaPackedMatrix(self.packed[ids.reshape(-1)], self.kind, self.in_features, self._lib)
        return picked.dequantize(0, ids.numel(), torch.float32).view(*ids.shape, self.in_features)

    @property
    def nbytes(self) -> int:
        return _bytes(self.packed) + _bytes(self.bias)


_local = threading.local()


def _scratch(floats: int) -> torch.Tensor:
    """This thread's dequantization tile (at most ``_TILE_FLOATS``), kept between calls: a
    fresh buffer of megabytes per product costs page faults on every step."""
    tile = getattr(_local, "tile", None)
    if tile is None or tile.numel() < floats:
        tile = _local.tile = torch.empty(floats, dtype=torch.float32)
    return tile[:floats]


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
