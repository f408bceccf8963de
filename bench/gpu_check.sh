#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU (an H200, say), in under 10 minutes,
# needing only the project and, if that machine lacks them, wheels in .whl/ (cffi,
# pycparser: see bench/README.md). Builds the CUDA library, runs the cuda and triton
# backend tests on the GPU, the packed-weight kernels (tests, then bench/packed.py --cuda),
# the kernel benchmark (with a device-copy bandwidth baseline
# measured in the same run), the engine on dummy weights, and last a compute-sanitizer
# memcheck of the CUDA kernels; prints every figure.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"

if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

step() { echo; echo "=== $* ($(date +%T))"; }
status=0

step "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || status=1
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" || exit 1

step "build the native libraries"
timeout 180 $PY native/build.py || exit 1

step "cuda and triton backends against the torch reference, kernels and whole engine (on the GPU)"
timeout 240 $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/test_backends.py -k "(cuda or triton) and not emulated" 2>&1 \
  | tee "$OUT/backend_tests.log" | tail -15 || status=1

step "packed weights (GGUF blocks) on the GPU: the CUDA library against the reference, then its speed"
timeout 120 $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/test_packed_cuda.py -k gpu 2>&1 \
  | tee "$OUT/packed_tests.log" | tail -8 || status=1
timeout 150 $PY bench/packed.py --cuda 2>&1 | tee "$OUT/packed_kernels.log" || status=1

step "kernel benchmark: bfloat16, bf16 / fp8 caches (copy bandwidth measured in the same run)"
for shape in smollm2-135m llama-3-8b; do
  timeout 150 $PY bench/kernels.py --backends torch,cuda,triton --dtype bfloat16 --shape "$shape" --quick \
    --kv-cache-dtypes bfloat16,fp8_e4m3,fp8_e5m2 2>&1 \
    | tee -a "$OUT/kernels.log" || status=1
done

step "engine throughput on dummy weights (SmolLM2-135M shape, bf16)"
for backend in cuda triton; do
  timeout 90 $PY bench/engine_throughput.py --backend "$backend" --num-requests 256 --prompt-len 512 \
    --output-len 128 2>&1 | tail -1 | tee -a "$OUT/engine.log" || status=1
done
step "memcheck: the CUDA kernels under compute-sanitizer on a few cases (where the runtime allows it)"
if command -v compute-sanitizer >/dev/null; then
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $PY -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/test_backends.py -k "reference and cuda and not emulated and fp32 and 16-64-9-3" 2>&1 | tail -15 \
    | tee "$OUT/memcheck.log"
  echo "memcheck exit status: ${PIPESTATUS[0]} (9 = errors found; other failures may mean the runtime has no sanitizer support)"
fi
exit $status
