#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU (an H200, say), in about 6 minutes,
# needing only the project and, if that machine lacks them, wheels in .whl/ (cffi, pycparser,
# trio, outcome, sniffio, pytest-trio: see bench/README.md). Correctness first, then speed:
#   1. the native libraries: the ones carried from the build machine if they load, else built here
#      for sm_90 alone;
#   2. the tests that run on a GPU (xdist over 8 workers): the cuda and triton backends against the
#      torch reference, the whole engine on each against the torch backend, the CUDA wrapper's
#      argument checks, the packed-weight kernels, every model family against transformers;
#   3. a compute-sanitizer memcheck of the CUDA attention kernels on a few cases;
#   4. figures: the engine on dummy weights (cuda, triton), the attention kernels (copy
#      bandwidth measured in the same run), the packed-weight kernels.
# Everything printed goes to $OUT/gpu_check.log as well; the tests' report to $OUT/tests.xml.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1

if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

step() { echo; echo "=== $* ($(date +%T))"; }
status=0

step "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || status=1
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())" || exit 1

step "native libraries"
libraries_load() {
  $PY -c "
from backends import get_backend, packed
print(get_backend('cuda', 'cuda').name, get_backend('cpu', 'cpu').isa, packed.cuda_library() is not None, packed.isa())"
}
if ! libraries_load; then
  echo "the carried libraries do not load here: building them (sm_90 only)"
  PA_CUDA_ARCHS=90 timeout 240 $PY native/build.py || exit 1
  libraries_load || exit 1
fi

step "tests on the GPU: backends against the reference, the engine, the CUDA wrapper, packed weights, model families"
timeout 200 $PY -m pytest -q -n 8 -p no:cacheprovider -o addopts="" --timeout 120 -rfE --tb=short \
  --junitxml "$OUT/tests.xml" \
  tests/test_backends.py tests/test_cuda_wrapper.py tests/test_packed_cuda.py tests/test_model_families.py \
  -k "(cuda or triton or gpu) and not emulated and not interpreter" || status=1

step "memcheck: the CUDA attention kernels under compute-sanitizer on a few cases"
if command -v compute-sanitizer >/dev/null; then
  timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 $PY -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/test_backends.py -k "test_backend_matches_reference and cuda and not emulated and (fp32-16-64-9-3 or bf16-32-128-8-1)" 2>&1 | tail -12
  echo "memcheck exit status: ${PIPESTATUS[0]} (9 = errors found)"
fi

step "engine throughput on dummy weights (SmolLM2-135M shape, bf16)"
for backend in cuda triton; do
  timeout 60 $PY bench/engine_throughput.py --backend "$backend" --num-requests 256 --prompt-len 512 \
    --output-len 128 2>&1 | tail -3 || status=1
done

step "attention kernels: bfloat16, bf16 / fp8 caches (copy bandwidth measured in the same run)"
timeout 60 $PY bench/attention_kernels.py --backends torch,cuda,triton --dtype bfloat16 --shape smollm2-135m --quick \
  --kv-cache-dtypes bfloat16,fp8_e4m3 || status=1

step "packed weights (GGUF blocks): the CUDA library's kernels against bf16 F.linear"
timeout 60 $PY bench/packed.py --cuda || status=1

step "tensor parallelism over NCCL (needs 2 GPUs)"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 90 $PY bench/tensor_parallel.py --backend cuda --dtype bfloat16 --batches 1,32 || status=1
else
  echo "one GPU here: no tensor-parallel case"
fi

step "attention kernels, Llama-3-8B's heads"
timeout 60 $PY bench/attention_kernels.py --backends torch,cuda,triton --dtype bfloat16 --shape llama-3-8b --quick \
  --kv-cache-dtypes bfloat16,fp8_e4m3 || status=1

step "done: status $status"
exit $status
