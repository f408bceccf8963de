"""Two or more builds of the packed-weight library, side by side in one process, interleaved.

Each build (a copy of ``libqm_cpu.so``) is loaded from its own path, and ``qm_linear`` runs on
the default model's four layer shapes (qkv, o, gate/up, down) at each row count, the builds
taking turns: 15 rounds of 10 calls, the fastest round kept, summed over the shapes (ms). On
these shared machines two runs of one build differ by more than a kernel change; builds
interleaved in one process see the same machine. Build each variant into the tree, copy it away:

    python native/build.py --no-cuda && cp backends/lib/libqm_cpu.so /tmp/new.so
    python bench/kernel_ab.py /tmp/old.so /tmp/new.so --rows 8,9,12,16,17,24
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends import native, packed  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2-135M: qkv, o, gate/up, down
KINDS = ("Q4_0", "Q4_1", "Q8_0")  # (what gguf quantizes; Q8_M is this project's own)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("libraries", nargs="+", type=Path, help="copies of libqm_cpu.so")
    parser.add_argument("--rows", default="1,4,5,7,8,9,12,13,16,17,20,24,32", help="rows of x")
    parser.add_argument("--type", default="Q8_0", choices=KINDS, help="the weights' packing")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--function", default="qm_linear", choices=("qm_linear", "qm_linear_bf16", "qm_linear_q16"),
                        help="the product timed (float32, bf16 or int16 activations)")
    args = parser.parse_args()

    ffi = native.ffi(packed.HEADER)
    libs = {path: ffi.dlopen(str(path.resolve())) for path in args.libraries}
    rng = np.random.default_rng(0)
    weights = [torch.from_numpy(quantize(rng.standard_normal((n, k), dtype=np.float32),
                                         GGMLQuantizationType[args.type]).reshape(n, -1).copy()) for n, k in SHAPES]
    rows = [int(m) for m in args.rows.split(",")]
    type_id = packed.TYPES[args.type][0]
    totals = {path: [0.0] * len(rows) for path in libs}
    for i, m in enumerate(rows):
        for (n, k), w in zip(SHAPES, weights):
            x, y = torch.randn(m, k), torch.empty(m, n)
            xp, yp, wp = (ffi.cast("float *", x.data_ptr()), ffi.cast("float *", y.data_ptr()),
                          ffi.cast("void *", w.data_ptr()))
            best = dict.fromkeys(libs, float("inf"))
            for _ in range(args.rounds):
                for path, lib in libs.items():
                    start = time.perf_counter()
                    for _ in range(10):
                        if getattr(lib, args.function)(type_id, wp, n, k, xp, m, yp, 0):
                            raise SystemExit(f"{path}: {ffi.string(lib.qm_last_error()).decode()}")
                    best[path] = min(best[path], (time.perf_counter() - start) / 10)
            for path in libs:
                totals[path][i] += best[path]
    first = args.libraries[0]
    print(f"{args.type}, {args.function}, the four layer products of the default model, ms (ratio to build 1):")
    for b, path in enumerate(libs, 1):
        print(f"  build {b}: {path}")
    print("rows" + "".join(f"{f'build {b}':>20}" for b in range(1, len(libs) + 1)))
    for i, m in enumerate(rows):
        cells = "".join(f"{totals[p][i] * 1e3:>11.3f} ({totals[p][i] / totals[first][i]:.2f}x)" for p in libs)
        print(f"{m:>4}{cells}")


if __name__ == "__main__":
    main()
