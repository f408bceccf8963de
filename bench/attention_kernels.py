"""Attention kernel microbenchmark: every available backend on the default model's shapes.

Decode over batch sizes x context lengths, plus one prefill case. For each: time per call,
achieved bandwidth (bytes of K/V read / time) and speed-up over the torch reference in the
same run; on CPU also the fraction of the memory bandwidth a large copy reaches in the
same run. With ``--kv-cache-dtypes float32,bfloat16,int8`` each case runs once per cache
element type and the last column is the speed-up over the same backend's first (float32)
cache in the same run (bytes read count the cache's own bytes).

    python bench/attention_kernels.py [--backends torch,cpu] [--dtype float32] [--shape smollm2-135m] [--quick]
                            [--kv-cache-dtypes float32,bfloat16,float16,int8,fp8_e4m3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends import get_backend  # noqa: E402
from backends import kv_cache as kvc  # noqa: E402
from backends.base import AttentionMetadata  # noqa: E402
from backends.errors import BackendUnavailableError  # noqa: E402

# (query heads, KV heads, head size): the default model's, and a larger model's rows
SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3-8b": (32, 8, 128)}
BLOCK_SIZE = 16
BATCHES = (1, 8, 32, 128)
CONTEXTS = (128, 1024, 4096)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device: str, min_time: float = 0.3, max_iters: int = 50) -> float:
    fn()
    sync(device)
    iters, start = 0, time.perf_counter()
    while iters < max_iters and (iters < 3 or time.perf_counter() - start < min_time):
        fn()
        iters += 1
    sync(device)
    return (time.perf_counter() - start) / iters


def device_time(fn, iters: int = 20) -> float | None:
    """Seconds per call on the GPU alone: ``fn`` captured once in a CUDA graph and replayed,
    timed with events, so that host overhead (a few us of Python per call) is left out.
    None if ``fn`` cannot be captured (e.g. it synchronizes)."""
    try:
        fn()  # warm-up: allocations and compilations happen outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return None
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def memory_bandwidth(device: str) -> float:
    """Bytes/s of a large copy (read + write), measured now."""
    n = (512 << 20) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    seconds = device_time(lambda: dst.copy_(src)) if device == "cuda" else None
    seconds = seconds or timeit(lambda: dst.copy_(src), device, max_iters=10)
    return 2 * src.numel() * 4 / seconds


def make_case(num_seqs: int, context: int, query_len: int, dtype: torch.dtype, device: str,
              shape: str = "smollm2-135m", kv_dtype: kvc.KVCacheDtype | None = None):
    num_heads, num_kv_heads, head_size = SHAPES[shape]
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_size, dtype=dtype, device=device)
    if kv_dtype is not None:
        cache = kvc.to_rows(cache, kv_dtype).contiguous()
    tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq).to(torch.int32)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * query_len
    meta = AttentionMetadata(query_start_loc=starts,
                             seq_lens=torch.full((num_seqs,), context, dtype=torch.int32, device=device),
                             block_tables=tables, slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
                             max_query_len=query_len, max_seq_len=context)
    query = torch.randn(num_seqs * query_len, num_heads, head_size, dtype=dtype, device=device)
    kv_bytes = cache.numel() * cache.element_size() * context / (blocks_per_seq * BLOCK_SIZE)
    return query, cache, meta, kv_bytes


def run(args) -> None:
    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backends = {}
    for name in args.backends.split(","):
        try:
            backends[name] = get_backend(name, device)
        except BackendUnavailableError as exc:
            print(f"skipping {name}: {exc}")
    bandwidth = memory_bandwidth(device)
    num_heads, num_kv_heads, head_size = SHAPES[args.shape]
    print(f"device {device}, dtype {args.dtype}, {args.shape} ({num_heads} query heads, {num_kv_heads} KV heads, "
          f"head size {head_size}), copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    kv_dtypes = [kvc.kv_cache_dtype(name) for name in args.kv_cache_dtypes.split(",")] if args.kv_cache_dtypes \
        else [None]
    print(f"{'case':>22} {'backend':>8} {'kv cache':>9} {'time ms':>10} {'GB/s':>8} {'% copy bw':>9} {'vs torch':>9}"
          + (f" {'vs first':>9}" if args.kv_cache_dtypes else "") + ("  timing" if device == "cuda" else ""))
    batches = (1, 32) if args.quick else BATCHES
    contexts = (1024,) if args.quick else CONTEXTS
    cases = [(f"decode b={b} ctx={c}", b, c, 1) for b in batches for c in contexts]
    cases.append(("prefill 4 x 512", 4, 512, 512))
    for label, num_seqs, context, query_len in cases:
        baseline, first = None, {}
        for kv_dtype in kv_dtypes:
            query, cache, meta, kv_bytes = make_case(num_seqs, context, query_len, dtype, device, args.shape,
                                                     kv_dtype)
            out = torch.empty_like(query)
            for name, backend in backends.items():
                meta.scratch.clear()
                if kv_dtype is not None and kv_dtype.name not in backend.kv_cache_dtypes_for(dtype):
                    continue

                def call():
                    backend.attend(query, cache, meta, head_size**-0.5, out)

                seconds, how = (device_time(call), "  graph") if device == "cuda" else (None, "")
                if seconds is None:  # on a GPU, host time per call bounds this for small cases
                    seconds, how = timeit(call, device), ("  host" if device == "cuda" else "")
                if name == "torch" and kv_dtype is kv_dtypes[0]:
                    baseline = seconds
                first.setdefault(name, seconds)
                ratio = f"{baseline / seconds:8.1f}x" if baseline else "       -"
                versus = f" {first[name] / seconds:8.2f}x" if args.kv_cache_dtypes else ""
                rate = kv_bytes / seconds
                cache_name = kv_dtype.name if kv_dtype is not None else args.dtype
                print(f"{label:>22} {name:>8} {cache_name:>9} {seconds * 1e3:10.3f} {rate / 1e9:8.1f} "
                      f"{100 * rate / bandwidth:8.0f}% {ratio}{versus}{how}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = "torch,cpu" if not torch.cuda.is_available() else "torch,cuda,triton"
    parser.add_argument("--backends", default=default, help="comma-separated, torch first (the baseline)")
    parser.add_argument("--kv-cache-dtypes", default=None,
                        help="comma-separated cache element types, the first the baseline of the last column")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--quick", action="store_true", help="a few cases only")
    run(parser.parse_args())
