"""Matrix products with weights kept in GGUF's packed block formats (Q4_0, Q4_1, Q8_0; and Q8_M,
which ``--quantization int8`` makes at load), through
the native library ``libqm_cpu.so`` (cffi, ABI mode; AVX-512 with or without VNNI, AVX2+FMA or
portable: the best this CPU runs, chosen at load; ``QM_CPU_ISA`` caps it; AVX512_BF16 also
multiplies activations rounded to bf16).

A packed weight is a uint8 tensor ``[N, row_bytes]``: N output rows of K values each, in
blocks of 32 exactly as the GGUF file stores them.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import torch

from backends import native

HEADER = Path(__file__).resolve().parent.parent / "native" / "include" / "quant_matmul.h"
# type name -> (type id, bytes per block of 32 values): GGUF's ids, and Q8_M (fp16 scale, fp16
# minimum, 32 uint8), which is not a GGUF type (native/include/quant_matmul.h)
TYPES = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34), "Q8_M": (100, 36)}
BLOCK = 32
# vector path -> the C API's isa argument; the names after "best" are also what qm_isa reports
# (with "avx2+fma" for avx2) and what QM_CPU_ISA accepts
ISAS = {"best": 0, "portable": 1, "avx2": 2, "avx512": 3, "avx512+vnni": 4, "avx512+vnni+bf16": 5}
ISA_CAP_VARIABLE = "QM_CPU_ISA"
# How a product takes its fp32 activations -> the kernel: as they are; rounded to int16 per block
# of 32 (integer dot products); rounded to bf16 (bf16 dot products, AVX512_BF16 only)
ACTIVATIONS = {"float32": "qm_linear", "int16": "qm_linear_q16", "bfloat16": "qm_linear_bf16"}
# Every product function of the library by how it takes x: the above, and fixed_order
# (batch invariance: the row tiles at every batch size, x as it is)
KERNELS = {**ACTIVATIONS, "fixed_order": "qm_linear_rows"}
# Plain weights qm_linear_rows also multiplies (batch invariance): torch dtype -> the C API's type id
DENSE_TYPES = {torch.float32: 0, torch.bfloat16: 30}


@cache
def library():
    cap = os.environ.get(ISA_CAP_VARIABLE)
    if cap is not None and cap not in (*list(ISAS)[1:], "avx2+fma"):
        raise native.BackendUnavailableError(f"{ISA_CAP_VARIABLE}={cap!r}: expected one of {', '.join(list(ISAS)[1:])}")
    lib = native.load_library("qm_cpu", "cpu", HEADER, "packed-weight kernels")
    try:
        lib.qm_linear_rows  # (the newest function: a library built before it is stale)
    except AttributeError:
        raise native.BackendUnavailableError(
            f"libqm_cpu.so in {native.LIB_DIR} was built from older sources: run `python native/build.py` "
            "(or reinstall: pip install -e .)") from None
    return lib


def _ffi():
    return native.ffi(HEADER)


def isa() -> str:
    """The vector path the library uses on this CPU ("avx512+vnni+bf16", "avx512+vnni", "avx512",
    "avx2+fma" or "portable")."""
    return _ffi().string(library().qm_isa()).decode()


def isa_supported(name: str) -> bool:
    return bool(library().qm_isa_supported(ISAS[name]))


def bf16_supported() -> bool:
    """Whether this CPU multiplies bf16 activations (AVX512_BF16) on the path the library uses."""
    return isa() == "avx512+vnni+bf16"


def row_bytes(kind: str, k: int) -> int:
    type_id, block_bytes = TYPES[kind]
    if k % BLOCK:
        raise ValueError(f"a {kind} row must hold whole blocks of {BLOCK} values; got {k}")
    return k // BLOCK * block_bytes


def _ptr(tensor: torch.Tensor, kind: str = "void *"):
    return _ffi().cast(kind, tensor.data_ptr())


def _check(packed: torch.Tensor, kind: str, k: int, device_type: str = "cpu") -> int:
    if kind not in TYPES:
        raise ValueError(f"packed type {kind} has no kernel (supported: {', '.join(TYPES)})")
    if (packed.dtype != torch.uint8 or packed.dim() != 2 or not packed.is_contiguous()
            or packed.device.type != device_type):
        raise ValueError(f"a packed weight must be a contiguous 2-d uint8 {device_type.upper()} tensor")
    if packed.shape[1] != row_bytes(kind, k):
        raise ValueError(f"packed rows of {packed.shape[1]} bytes do not hold {k} {kind} values")
    return TYPES[kind][0]


def last_error() -> str:
    """The library's message for its last failed call on this thread."""
    return _ffi().string(library().qm_last_error()).decode()


def _rc(rc: int, what: str) -> None:
    if rc != 0:
        raise native.NativeKernelError(f"{what} failed: {last_error()}")


def linear(x: torch.Tensor, packed: torch.Tensor, kind: str, k: int, isa: str = "best",
           activations: str = "float32") -> torch.Tensor:
    """``x @ W.T`` for fp32 ``x`` ``[M, K]``: the packed kernel (reads each block once for all M
    rows). ``activations``: how the kernel takes ``x`` (``ACTIVATIONS``)."""
    matrix = PackedMatrix(packed, kind, k)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous float32 [M, {k}] tensor; got {x.dtype} {tuple(x.shape)}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}; got {activations!r}")
    return matrix.linear(x, isa, activations)


@cache
def kernel_address(activations: str) -> int:
    """The address of the library's product function for ``activations`` (``KERNELS``): what
    another native library calls the products through (``pa_cpu_decoder_layers``, every step).
    All share ``qm_linear``'s signature."""
    return int(_ffi().cast("uintptr_t", getattr(library(), KERNELS[activations])))


class PackedMatrix:
    """A packed weight bound to the library, checked once: the per-step products skip the
    argument checks of ``linear`` (they run ~120 times a decode step)."""

    def __init__(self, data: torch.Tensor, kind: str, k: int) -> None:
        self._type = _check(data, kind, k)
        self.data, self.kind, self.k = data, kind, k  # data: kept alive while the pointer is used
        self._lib, self._ffi = library(), _ffi()
        self._ptr = self._ffi.cast("void *", data.data_ptr())
        self._n = data.shape[0]
        self._kernels = {kind: getattr(self._lib, name) for kind, name in KERNELS.items()}

    @property
    def type_id(self) -> int:
        """The library's id of the weight's layout (``TYPES``, ``DENSE_TYPES``)."""
        return self._type

    @property
    def n(self) -> int:
        return self._n

    def linear(self, x: torch.Tensor, isa: str = "best", activations: str = "float32") -> torch.Tensor:
        """``x @ W.T`` for ``x`` float32, contiguous, ``[M, K]`` (the caller guarantees it), with
        ``x`` taken as ``activations`` says (``ACTIVATIONS``), or, for ``fixed_order``, as they
        are and every row of the result summed in one order whatever ``M`` (batch-invariant)."""
        m = x.shape[0]
        out = torch.empty(m, self._n, dtype=torch.float32)
        cast = self._ffi.cast
        rc = self._kernels[activations](self._type, self._ptr, self._n, self.k, cast("float *", x.data_ptr()), m,
                    cast("float *", out.data_ptr()), ISAS[isa])
        if rc:
            _rc(rc, "packed linear")
        return out


class DenseMatrix(PackedMatrix):
    """A plain float32 or bfloat16 weight ``[N, K]`` (K a multiple of 32) through the same row
    tiles, for products that must not depend on the batch (``qm_linear_rows``; fixed order only)."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype not in DENSE_TYPES or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"a dense weight for the row tiles must be a 2-d CPU float32 or bfloat16 tensor; "
                             f"got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
        if weight.shape[1] % BLOCK:
            raise ValueError(f"the row tiles take whole blocks of {BLOCK} inputs; this weight has {weight.shape[1]}")
        self._type = DENSE_TYPES[weight.dtype]
        self.data, self.kind, self.k = weight.contiguous(), str(weight.dtype).removeprefix("torch."), weight.shape[1]
        self._lib, self._ffi = library(), _ffi()
        self._ptr = self._ffi.cast("void *", self.data.data_ptr())
        self._n = weight.shape[0]
        self._kernels = {"fixed_order": self._lib.qm_linear_rows}

    def linear(self, x: torch.Tensor, isa: str = "best", activations: str = "fixed_order") -> torch.Tensor:
        if activations != "fixed_order":
            raise ValueError("dense weights go through the row tiles in fixed order only")
        return super().linear(x, isa, activations)


def dequantize_rows(packed: torch.Tensor, kind: str, k: int, rows: torch.Tensor, isa: str = "best") -> torch.Tensor:
    """Rows ``rows`` (int64) of the weight as fp32 ``[len(rows), K]`` (an embedding lookup)."""
    type_id = _check(packed, kind, k)
    rows = rows.to(torch.int64).contiguous()
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= packed.shape[0]):
        raise ValueError(f"row ids must be in [0, {packed.shape[0]})")
    out = torch.empty(rows.numel(), k, dtype=torch.float32)
    _rc(library().qm_dequantize_rows(type_id, _ptr(packed), k, _ptr(rows, "int64_t *"), rows.numel(),
                                     _ptr(out, "float *"), ISAS[isa]), "packed row lookup")
    return out


def dequantize_range(packed: torch.Tensor, kind: str, k: int, begin: int, end: int, out: torch.Tensor | None = None,
                     isa: str = "best") -> torch.Tensor:
    """Rows ``[begin, end)`` as fp32 ``[end - begin, K]``, into ``out`` if given (a reusable tile)."""
    type_id = _check(packed, kind, k)
    if not 0 <= begin <= end <= packed.shape[0]:
        raise ValueError(f"row range [{begin}, {end}) outside [0, {packed.shape[0]}]")
    if out is None:
        out = torch.empty(end - begin, k, dtype=torch.float32)
    elif out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < (end - begin) * k:
        raise ValueError("out must be a contiguous float32 tensor large enough for the rows")
    _rc(library().qm_dequantize_range(type_id, _ptr(packed), k, begin, end, _ptr(out, "float *"), ISAS[isa]),
        "packed dequantize")
    return out[: (end - begin) * k].view(end - begin, k) if out.dim() == 1 else out


@cache
def cuda_library():
    return native.load_library("qm_cuda", "cuda", HEADER, "packed-weight kernels")


def unavailable_reason(device: str) -> str | None:
    """Why packed weights cannot run on ``device`` here, or None if they can: they run on CPU,
    and on a GPU where ``libqm_cuda.so`` is built."""
    if device == "cpu":
        return None
    if device == "cuda":
        return native.cuda_unavailable_reason("qm_cuda")
    return f"no packed kernels on {device}"


class CudaPackedMatrix:
    """A packed weight on the GPU, bound to ``libqm_cuda.so`` (or, in tests, to the library
    compiled for the host, with ``device_type = "cpu"``): the small-batch kernel, and the
    dequantizer that feeds a GEMM for large batches. Activations in fp32, bf16 or fp16."""

    device_type = "cuda"

    def __init__(self, data: torch.Tensor, kind: str, k: int, lib=None) -> None:
        self._type = _check(data, kind, k, self.device_type)
        self.data, self.kind, self.k = data, kind, k
        self._lib = lib if lib is not None else cuda_library()
        self._ffi = _ffi()
        self._ptr = self._ffi.cast("void *", data.data_ptr())
        self._n = data.shape[0]

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for ``x`` ``[M, K]`` on the weight's device."""
        self._check_x(x)
        out = torch.empty(x.shape[0], self._n, dtype=x.dtype, device=x.device)
        rc = self._lib.qm_cuda_linear(self._type, self._ptr, self._n, self.k, self._pointer(x), x.shape[0],
                                      self._pointer(out), native.DTYPE_CODES[x.dtype], self._stream(x))
        self._rc(rc, "packed linear (cuda)")
        return out

    def dequantize(self, begin: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[begin, end)`` of the weight as ``dtype``, ``[end - begin, K]``, on its device."""
        if not 0 <= begin <= end <= self._n:
            raise ValueError(f"row range [{begin}, {end}) outside [0, {self._n}]")
        if dtype not in native.DTYPE_CODES:
            raise ValueError(f"cannot dequantize to {dtype}")
        out = torch.empty(end - begin, self.k, dtype=dtype, device=self.data.device)
        rc = self._lib.qm_cuda_dequantize(self._type, self._ptr, self.k, begin, end, self._pointer(out),
                                          native.DTYPE_CODES[dtype], self._stream(out))
        self._rc(rc, "packed dequantize (cuda)")
        return out

    def _check_x(self, x: torch.Tensor) -> None:
        if (x.dtype not in native.DTYPE_CODES or x.dim() != 2 or x.shape[1] != self.k or not x.is_contiguous()
                or x.device != self.data.device):
            raise ValueError(f"x must be a contiguous float32/bfloat16/float16 [M, {self.k}] tensor on "
                             f"{self.data.device}; got {x.dtype} {tuple(x.shape)} on {x.device}")

    def _pointer(self, t: torch.Tensor):
        return self._ffi.cast("void *", t.data_ptr())

    def _stream(self, t: torch.Tensor):
        return self._ffi.cast("void *", torch.cuda.current_stream(t.device).cuda_stream)

    def _rc(self, rc: int, what: str) -> None:
        if rc != 0:
            message = self._ffi.string(self._lib.qm_cuda_last_error()).decode()
            raise native.NativeKernelError(f"{what} failed: {message}")
