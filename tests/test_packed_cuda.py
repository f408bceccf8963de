"""The CUDA packed-weight library (native/cuda/quant_matmul.cu) without a GPU: compiled for the
host with the CUDA emulation (native/cuda/host_emulation.h: every CUDA thread a fiber, warp
shuffles and barriers as on the device) and checked against GGUF's reference dequantizer then
F.linear, for each packed type and activation dtype; and the layer that uses it
(``CudaPackedLinear``: the kernel for small batches, dequantized tiles and a GEMM above).

On a machine with a GPU (bench/gpu_check.sh) the same checks run on the real library.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine.models.linear as linear_module
from backends import packed
from engine.models.linear import CudaPackedLinear
from tests.conftest import load_script

KINDS = list(packed.TYPES)

ON_GPU = packed.unavailable_reason("cuda") is None
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Relative to sum |x| |w| of each output: fp32 sums, then one rounding to the output dtype.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module", params=["emulated"] + (["gpu"] if ON_GPU else []))
def target(request, tmp_path_factory):
    """(library, device): the host-compiled library on CPU tensors, or the real one on the GPU."""
    if request.param == "gpu":
        yield packed.cuda_library(), "cuda"
        return
    path = load_script("native/build.py").build_cuda_host_emulation(tmp_path_factory.mktemp("qm_cuda_emulated"), "qm_cuda")
    with pytest.MonkeyPatch.context() as patch:
        # Host pointers and no stream: the emulated library runs each launch to completion in place.
        patch.setattr(packed.CudaPackedMatrix, "device_type", "cpu")
        patch.setattr(packed.CudaPackedMatrix, "_stream", lambda self, t: packed._ffi().NULL)
        yield packed._ffi().dlopen(str(path)), "cpu"


def packed_weight(kind: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(random packed rows of ``kind``, their fp32 values): the reference is the CPU library's
    dequantizer, which tests/test_packed.py holds bit-equal to GGUF's (no gguf package needed
    on a GPU machine)."""
    gen = torch.Generator().manual_seed(seed)
    _, block_bytes = packed.TYPES[kind]
    blocks = torch.randint(0, 256, (n, k // 32, block_bytes), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // 32, 2, generator=gen) * 0.02 + 0.001).to(torch.float16)
    scales[..., 1] *= -1  # a negative minimum for Q4_1 / Q8_M
    blocks[..., 0:4] = scales.view(torch.uint8).view(n, k // 32, 4)[..., : min(4, block_bytes)]
    data = blocks.reshape(n, -1).contiguous()
    return data, packed.dequantize_range(data, kind, k, 0, n)


def close_enough(got: torch.Tensor, x: torch.Tensor, reference: torch.Tensor) -> bool:
    expected = F.linear(x.double(), reference.double())
    bound = TOLERANCE[got.dtype] * (x.abs().double() @ reference.abs().double().T) + 1e-6
    return bool(((got.cpu().double() - expected).abs() <= bound).all())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
# 3 blocks a row (most lanes idle), and 40 (lanes take two blocks); 37 rows: the last CTA's
# warps partly past the end.
@pytest.mark.parametrize("n, k", [(37, 96), (9, 1280)])
def test_cuda_kernel_matches_dequantize_then_linear(target, kind, dtype, n, k):
    lib, device = target
    data, reference = packed_weight(kind, n, k, seed=n + k)
    matrix = packed.CudaPackedMatrix(data.to(device), kind, k, lib)
    # Dequantizing gives GGUF's values bit for bit (and their rounding to the dtype).
    assert torch.equal(matrix.dequantize(0, n, torch.float32).cpu(), reference)
    assert torch.equal(matrix.dequantize(n // 2, n, dtype).cpu(), reference[n // 2:].to(dtype))
    gen = torch.Generator().manual_seed(k)
    for m in (1, 3, 8, 9, 17):  # one pass of 8 rows, and more with a partial last pass
        x = torch.randn(m, k, generator=gen).to(dtype)
        got = matrix.linear(x.to(device))
        assert got.dtype == dtype and got.shape == (m, n)
        assert close_enough(got, x, reference), (kind, dtype, m)


def test_cuda_packed_linear_kernel_and_tiled_paths_bias_and_rows(target, monkeypatch):
    lib, device = target
    data, reference = packed_weight("Q4_1", 50, 64)
    bias = torch.randn(50)
    layer = CudaPackedLinear(data.to(device), "Q4_1", 64, bias.to(device), lib=lib)
    monkeypatch.setattr(linear_module, "_CUDA_TILE_VALUES", 64 * 16)  # tiles of 16 rows: four of them
    for m in (1, linear_module.CUDA_PACKED_MAX_ROWS, linear_module.CUDA_PACKED_MAX_ROWS + 1, 40):
        x = torch.randn(2, m, 64)
        got = layer(x.to(device))
        assert got.shape == (2, m, 50)
        assert torch.allclose(got.cpu(), F.linear(x, reference, bias), rtol=1e-5, atol=1e-5), m
    ids = torch.tensor([[49, 0], [7, 7]])
    assert torch.equal(layer.rows(ids.to(device)).cpu(), reference[ids])
    assert torch.equal(layer.dequantize().cpu(), reference)


def test_cuda_kernel_refuses_bad_arguments(target):
    lib, device = target
    data, _ = packed_weight("Q8_0", 4, 64)
    matrix = packed.CudaPackedMatrix(data.to(device), "Q8_0", 64, lib)
    with pytest.raises(ValueError, match="contiguous"):
        matrix.linear(torch.randn(64, 2, device=device).T)
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        matrix.linear(torch.randn(2, 32, device=device))
    with pytest.raises(ValueError, match="outside"):
        matrix.dequantize(2, 5, torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        packed.CudaPackedMatrix(data.to(device).view(torch.int8), "Q8_0", 64, lib)
    # What the library itself refuses (past the wrapper): an unknown type.
    out = torch.empty(1, 4, device=device)
    x = torch.randn(1, 64, device=device)
    rc = lib.qm_cuda_linear(7, packed._ffi().cast("void *", matrix.data.data_ptr()), 4, 64,
                            packed._ffi().cast("void *", x.data_ptr()), 1, packed._ffi().cast("void *", out.data_ptr()),
                            0, packed._ffi().NULL)
    assert rc == 1 and b"unsupported packed type 7" in packed._ffi().string(lib.qm_cuda_last_error())
