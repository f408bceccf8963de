"""Packed GGUF weights: the native kernels against fp32 ``F.linear``, and a decode step in the engine.

1. Per layer shape of the default model (SmolLM2-135M) and of Llama-3-8B: the packed kernel
   (Q4_0, Q4_1, Q8_0) at M = 1, 8, 32, 128 rows against ``F.linear`` on the dequantized fp32
   weight, and the tiled path (dequantize + GEMM) the engine takes above the crossover it
   measures at start (``packed_max_rows``). At M = 1: GB/s of packed weights read, as a fraction of this
   machine's copy bandwidth (a large ``Tensor.copy_``, bytes read per second).
2. Each vector path this CPU runs (AVX2, AVX-512, AVX-512 with VNNI), same shapes, fp32 and
   int16 activations, and bf16 activations from 16 rows where the CPU has AVX512_BF16, as
   ratios to the AVX2 path measured alongside (``--paths``).
3. Decode inside the engine, batch 1 (schedule + forward + sample): ms per output token of
   the default model with ``quantization="auto"`` (packed), the same with
   ``activation_quantization="int16"``, and ``"none"`` (fp32), alternated, the lowest of
   ``--repeat`` runs each.

    python bench/packed.py [--repeat 3] [--skip-8b] [--skip-engine] [--paths]
    python bench/packed.py --cuda     # the CUDA library on a GPU (bench/gpu_check.sh runs it)
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends import packed  # noqa: E402
from engine.models.linear import BF16_ACTIVATION_MIN_ROWS, PACKED_MAX_ROWS, PackedLinear, packed_max_rows  # noqa: E402

SMOLLM = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)]
LLAMA_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def best(fn, repeat: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def random_packed(kind: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random blocks of ``kind``: uniform quantized values, scales around 0.01."""
    rng = np.random.default_rng(seed)
    _, block_bytes = packed.TYPES[kind]
    blocks = rng.integers(0, 256, size=(n, k // 32, block_bytes), dtype=np.uint8)
    scales = (rng.random((n, k // 32, 2)) * 0.02 + 0.001).astype(np.float16).view(np.uint8)
    blocks[..., 0:2] = scales[..., 0:2]  # d
    if kind in ("Q4_1", "Q8_M"):
        blocks[..., 2:4] = scales[..., 0:2]  # m
    return torch.from_numpy(blocks.reshape(n, -1))


def copy_bandwidth() -> float:
    src = torch.ones(64 * 1024 * 1024)  # 256 MiB
    dst = torch.empty_like(src)
    return src.numel() * 4 / best(lambda: dst.copy_(src), 5)


def kernels(shapes, label: str, bandwidth: float, rows=(1, 8, 32, 128)) -> None:
    print(f"\n{label}: packed kernel / tiled path / fp32 F.linear (ms), and fp32 time / packed-path time")
    for kind in packed.TYPES:
        for name, n, k in shapes:
            data = random_packed(kind, n, k)
            layer = PackedLinear(data, kind, k)
            weight = layer.dequantize()
            cells = []
            for m in rows:
                x = torch.randn(m, k)
                kernel = best(lambda: packed.linear(x, data, kind, k))
                tiled = best(lambda: layer._tiled(x), 5)
                dense = best(lambda: F.linear(x, weight))
                chosen = kernel if m <= layer.max_kernel_rows else tiled
                cells.append(f"M={m}: {kernel * 1e3:.3f}/{tiled * 1e3:.3f}/{dense * 1e3:.3f} ({dense / chosen:.2f}x)")
                if m == 1:
                    rate = data.numel() / kernel
                    cells[-1] += f" {rate / 1e9:.1f} GB/s = {100 * rate / bandwidth:.0f}% of copy"
            print(f"  {kind} {name:8s} {n:6d}x{k:<6d} " + "; ".join(cells))
            del weight


PATH_KINDS = ("Q4_0", "Q4_1", "Q8_0")  # the types --paths compares (those GGUF files hold)


def vector_paths(shapes, label: str, rows=(1, 2, 5, 8, 16, 64, 128)) -> None:
    """Every vector path this CPU runs on the same weights and x, alternated call by call, as
    ratios to AVX2 (int16: ``--activation-quantization int16``'s kernel, at up to 2 rows; bf16:
    ``--activation-quantization bf16``'s, from 16 rows, where the CPU has AVX512_BF16)."""
    isas = [isa for isa in ("avx2", "avx512", "avx512+vnni") if packed.isa_supported(isa)]
    if len(isas) < 2:
        print(f"\n{label}: only {isas or ['portable']} here: nothing to compare")
        return
    bf16 = "bf16 (x as bf16)" if packed.bf16_supported() else ""
    print(f"\n{label}, ms per call on {' / '.join(isas)}{' / ' + bf16 if bf16 else ''} "
          "(and AVX2's time / each path's)")
    for kind in PATH_KINDS:
        for name, n, k in shapes:
            data = random_packed(kind, n, k)
            cells = []
            for m in rows:
                x = torch.randn(m, k)
                for activations in ("float32", "int16") if m <= 2 else ("float32",):
                    calls = {isa: (isa, activations) for isa in isas}
                    if bf16 and m >= BF16_ACTIVATION_MIN_ROWS:
                        calls["bf16"] = ("best", "bfloat16")
                    times = {path: [] for path in calls}
                    for _ in range(5):  # alternated, so that a noisy moment hits every path
                        for path, (isa, how) in calls.items():
                            times[path].append(best(lambda: packed.linear(x, data, kind, k, isa, how), 4))
                    t = {path: min(v) for path, v in times.items()}
                    ratios = "/".join(f"{t['avx2'] / t[path]:.2f}" for path in list(t)[1:])
                    cells.append(f"M={m}{' int16' if activations == 'int16' else ''}: "
                                 f"{'/'.join(f'{v * 1e3:.3f}' for v in t.values())} ({ratios}x)")
            print(f"  {kind} {name:8s} {n:6d}x{k:<6d} " + "; ".join(cells), flush=True)


def cuda_time(fn, repeat: int = 20) -> float:
    """Seconds per call of ``fn`` on the GPU (CUDA events around ``repeat`` calls, after a warm-up)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def cuda_kernels(shapes, label: str, rows=(1, 8, 32, 128)) -> None:
    """The CUDA library (bf16 activations): kernel and dequantize + cuBLAS against bf16 F.linear."""
    from engine.models.linear import CUDA_PACKED_MAX_ROWS, CudaPackedLinear

    src = torch.ones(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bandwidth = src.numel() / cuda_time(lambda: dst.copy_(src))
    print(f"\n{torch.cuda.get_device_name()}: device copy bandwidth {bandwidth / 1e9:.0f} GB/s (bytes read); "
          f"CUDA_PACKED_MAX_ROWS {CUDA_PACKED_MAX_ROWS}")
    print(f"{label}: packed kernel / dequantize + GEMM / bf16 F.linear (ms), and bf16 time / packed-path time")
    for kind in packed.TYPES:
        for name, n, k in shapes:
            data = random_packed(kind, n, k).cuda()
            layer = CudaPackedLinear(data, kind, k)
            weight = layer.dequantize().to(torch.bfloat16)
            cells = []
            for m in rows:
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                kernel = cuda_time(lambda: layer._matrix.linear(x))
                tiled = cuda_time(lambda: F.linear(x, layer._matrix.dequantize(0, n, torch.bfloat16)))
                dense = cuda_time(lambda: F.linear(x, weight))
                chosen = kernel if m <= CUDA_PACKED_MAX_ROWS else tiled
                cells.append(f"M={m}: {kernel * 1e3:.3f}/{tiled * 1e3:.3f}/{dense * 1e3:.3f} ({dense / chosen:.2f}x)")
                if m == 1:
                    rate = data.numel() / kernel
                    cells[-1] += f" {rate / 1e9:.0f} GB/s = {100 * rate / bandwidth:.0f}% of copy"
            print(f"  {kind} {name:8s} {n:6d}x{k:<6d} " + "; ".join(cells), flush=True)
            del weight, layer


def engine_decode(repeat: int, tokens: int = 128) -> None:
    from engine.api import LLM, SamplingParams

    print(f"\ndecode in the engine, batch 1, {tokens} tokens (default model, cpu backend, float32):")
    configs = {"auto": dict(quantization="auto"),
               "auto, int16 activations": dict(quantization="auto", activation_quantization="int16"),
               "none": dict(quantization="none")}
    llms = {name: LLM(backend="cpu", dtype="float32", num_kv_blocks=256, **c) for name, c in configs.items()}
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    results: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(repeat):
        for name, llm in llms.items():
            llm.reset_prefix_cache()
            llm.generate(["Write a story about a lighthouse keeper."], SamplingParams(temperature=0, max_tokens=2))
            start = time.perf_counter()
            llm.generate(["Tell me about the history of the printing press."], params)
            results[name].append((time.perf_counter() - start) / tokens)
    best = {name: min(times) for name, times in results.items()}
    for name, llm in llms.items():
        kinds, resident = llm.engine.model.weight_summary()
        print(f"  quantization {name:22s}: {best[name] * 1e3:6.2f} ms/token ({best['none'] / best[name]:.2f}x fp32); "
              f"weights {resident / 1e6:.1f} MB ({', '.join(f'{c} {k}' for k, c in kinds.items())})")
    print(f"  packed is {best['none'] / best['auto']:.2f}x faster per token; int16 activations "
          f"{best['auto'] / best['auto, int16 activations']:.2f}x faster than packed alone")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-8b", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--cuda", action="store_true", help="the CUDA library's kernels instead (needs a GPU)")
    parser.add_argument("--paths", action="store_true", help="only the vector paths this CPU runs, against AVX2")
    args = parser.parse_args()
    if args.cuda:
        cuda_kernels(SMOLLM, "SmolLM2-135M shapes")
        cuda_kernels(LLAMA_8B, "Llama-3-8B shapes")
        return
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, packed kernels: {packed.isa()}")
    if args.paths:
        vector_paths(SMOLLM, "SmolLM2-135M shapes")
        if not args.skip_8b:
            vector_paths(LLAMA_8B, "Llama-3-8B shapes", rows=(1, 2, 8, 32))
        return
    # The engine first: the kernels below run OpenMP on this thread too, and a second pool of
    # OpenMP threads (more threads than cores) makes libgomp stop spinning between regions,
    # which slowed the engine's step 1.7x when it ran after them.
    if not args.skip_engine:
        engine_decode(args.repeat)
    bandwidth = copy_bandwidth()
    print(f"\ncopy bandwidth {bandwidth / 1e9:.1f} GB/s; the kernel up to {packed_max_rows()} rows here "
          f"(measured; at least PACKED_MAX_ROWS = {PACKED_MAX_ROWS})")
    kernels(SMOLLM, "SmolLM2-135M shapes", bandwidth)
    if not args.skip_8b:
        kernels(LLAMA_8B, "Llama-3-8B shapes", bandwidth, rows=(1, 8, 32))


if __name__ == "__main__":
    main()
