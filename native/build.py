"""Compile the native libraries: paged attention and packed-weight matrix products, CPU and CUDA.

    python native/build.py [--out DIR] [--no-cuda]

The CPU libraries are always built (system C++ compiler, OpenMP); the CUDA ones when
``nvcc`` is found (sm_80 and sm_90). ``setup.py`` runs this on install; run it by hand
after editing the sources. Outputs: ``libpa_cpu.so``, ``libqm_cpu.so``, ``libpa_cuda.so`` and
``libqm_cuda.so`` in ``backends/lib``.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT.parent / "backends" / "lib"
# PA_CUDA_ARCHS=90 builds one architecture only (quicker, on the GPU machine itself).
CUDA_ARCHS = tuple(os.environ.get("PA_CUDA_ARCHS", "80,90").split(","))


def _run(cmd: list[str]) -> None:
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def build_cpu(out: Path) -> Path:
    """Portable code with AVX2+FMA paths chosen at run time: no -march=native in what is shipped."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX): the cpu attention backend cannot be built")
    target = out / "libpa_cpu.so"
    common = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-fno-math-errno", f"-I{ROOT / 'include'}", f"-I{ROOT / 'cpu'}"]
    with tempfile.TemporaryDirectory() as tmp:
        objects = []
        # The kernel twice: an AVX2+FMA+F16C variant and a portable one; the library picks at load time.
        for variant, flags in (("pa_avx2", ["-mavx2", "-mfma", "-mf16c"]), ("pa_portable", [])):
            if flags and not _is_x86():
                continue
            obj = Path(tmp) / f"kernel_{variant}.o"
            _run([cxx, *common, *flags, f"-DPA_NS={variant}", "-c", str(ROOT / "cpu" / "kernel.cpp"), "-o", str(obj)])
            objects.append(str(obj))
        # The fused layer ops, once for every CPU, rounded as torch rounds (see layer_ops.cpp).
        obj = Path(tmp) / "layer_ops.o"
        _run([cxx, *common, "-ffp-contract=off", "-c", str(ROOT / "cpu" / "layer_ops.cpp"), "-o", str(obj)])
        objects.append(str(obj))
        defines = [] if _is_x86() else ["-DPA_NO_AVX2"]
        _run([cxx, *common, *defines, "-shared", str(ROOT / "cpu" / "paged_attention_cpu.cpp"), *objects,
              "-o", str(target)])
    return target


def build_quant_cpu(out: Path) -> Path:
    """The packed-weight (GGUF Q4_0/Q4_1/Q8_0) matrix library: AVX-512 (with VNNI and BF16, with VNNI, plain),
    AVX2+FMA+F16C and portable variants, the library picking one at load."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX): the packed-weight kernels cannot be built")
    target = out / "libqm_cpu.so"
    # -ffp-contract=off: dequantized values are rounded as GGUF's reference rounds them.
    common = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-fno-math-errno", "-ffp-contract=off",
              f"-I{ROOT / 'include'}", f"-I{ROOT / 'cpu'}"]
    with tempfile.TemporaryDirectory() as tmp:
        objects = []
        avx2 = ["-mavx2", "-mfma", "-mf16c"]
        avx512 = [*avx2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
        for variant, flags in (("qm_avx512_bf16", [*avx512, "-mavx512vnni", "-mavx512bf16"]),
                               ("qm_avx512_vnni", [*avx512, "-mavx512vnni"]), ("qm_avx512", avx512),
                               ("qm_avx2", avx2), ("qm_portable", [])):
            if flags and not _is_x86():
                continue
            obj = Path(tmp) / f"quant_{variant}.o"
            _run([cxx, *common, *flags, f"-DQM_NS={variant}", "-c", str(ROOT / "cpu" / "quant_kernel.cpp"),
                  "-o", str(obj)])
            objects.append(str(obj))
        defines = [] if _is_x86() else ["-DQM_NO_AVX2"]
        _run([cxx, *common, *defines, "-shared", str(ROOT / "cpu" / "quant_matmul.cpp"), *objects, "-o", str(target)])
    return target


def _is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64", "i686")


def find_nvcc() -> str | None:
    for candidate in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).exists():
            return candidate
    return None


# The CUDA libraries: name -> source in cuda/.
CUDA_LIBRARIES = {"pa_cuda": "paged_attention.cu", "qm_cuda": "quant_matmul.cu"}


def build_cuda(out: Path, name: str = "pa_cuda") -> Path | None:
    nvcc = find_nvcc()
    if nvcc is None:
        print(f"nvcc not found: skipping the CUDA library {name}", flush=True)
        return None
    target = out / f"lib{name}.so"
    gencode = [arg for arch in CUDA_ARCHS for arg in ("-gencode", f"arch=compute_{arch},code=sm_{arch}")]
    # --threads 0: one compiler process per architecture, in parallel.
    _run([nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr", "--threads", "0", *gencode,
          f"-I{ROOT / 'include'}", str(ROOT / "cuda" / CUDA_LIBRARIES[name]), "-o", str(target)])
    return target


def build_cuda_host_emulation(out: Path, name: str = "pa_cuda") -> Path:
    """A CUDA library's source compiled for the host (see cuda/host_emulation.h): for tests
    of its kernels on machines without a GPU. Its pointers are host pointers."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"lib{name}_emulated.so"
    # -O1: it builds in 17 s against -O2's 28 (2 cores), and the tests of the emulated kernels
    # then run ~5 s longer: the suite gains ~5 s.
    _run([cxx, "-O1", "-std=c++17", "-fPIC", "-shared", "-x", "c++", "-DPA_CUDA_HOST_EMULATION", "-Wno-unknown-pragmas",
          f"-I{ROOT / 'include'}", f"-I{ROOT / 'cuda'}", str(ROOT / "cuda" / CUDA_LIBRARIES[name]), "-o", str(target)])
    return target


def build_all(out: Path = DEFAULT_OUT, cuda: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    built = [build_cpu(out), build_quant_cpu(out)]
    if cuda:
        built += [lib for name in CUDA_LIBRARIES if (lib := build_cuda(out, name)) is not None]
    return built


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--no-cuda", action="store_true")
    args = parser.parse_args()
    for path in build_all(args.out, cuda=not args.no_cuda):
        print(f"built {path}")
    sys.exit(0)
