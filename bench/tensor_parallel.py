"""Tensor parallelism on this machine: decode step time at ``--tensor-parallel-size`` 1 and 2, the
time split into compute and the collectives rank 0 waits in, and their bytes.

A random-weight Llama (``--hidden``, ``--layers``, heads of 64 values, 4 query heads per KV
head) is saved to a temporary directory; at each batch size B, B requests of 32-token prompts
decode ``--steps`` tokens; the prefill steps are left out. TP 1 runs one process with every core,
TP 2 two processes with half each (gloo over loopback). Printed per (TP, B): ms per decode step,
ms in collectives (all-reduce after the o and down products, the embedding's all-reduce, the
logits' all-gather), the rest (compute), and bytes per step: what the collectives would move
over NCCL on GPUs.

    python bench/tensor_parallel.py [--hidden 1024] [--layers 8] [--batches 1,8] [--steps 32]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.packed import cpu_name  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.models import parallel  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def save_model(directory: str, hidden: int, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = hidden // 64
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(2, heads // 4),
                         head_dim=64, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)


def decode_steps(core: EngineCore, batch: int, steps: int) -> tuple[float, float, int, int]:
    """(seconds, collective seconds, collective calls, collective bytes) over the decode steps."""
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"{time.perf_counter_ns()}-{i}", [rng.randrange(3, 32000) for _ in range(32)], params)
    core.step()  # (the prefill: every prompt fits in one step)
    before = parallel.COLLECTIVES.seconds, parallel.COLLECTIVES.calls, parallel.COLLECTIVES.bytes
    start = time.perf_counter()
    while core.has_unfinished_requests:
        core.step()
    elapsed = time.perf_counter() - start
    stats = parallel.COLLECTIVES
    return elapsed, stats.seconds - before[0], stats.calls - before[1], stats.bytes - before[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--backend", default="cpu", help="cpu (gloo), or cuda / triton on a machine with 2 GPUs (NCCL; "
                                                          "the split is then not timed: collectives return at once)")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as directory:
        save_model(directory, args.hidden, args.layers)
        for size in (1, 2):
            core = EngineCore(EngineConfig(model=directory, tensor_parallel_size=size, backend=args.backend,
                                           dtype=args.dtype, num_kv_blocks=512, max_num_seqs=64))
            try:
                decode_steps(core, 1, 4)  # (warm)
                for batch in (int(b) for b in args.batches.split(",")):
                    seconds, collective, calls, moved = decode_steps(core, batch, args.steps)
                    steps = args.steps
                    print(f"TP {size}, batch {batch:3d}: {1e3 * seconds / steps:7.2f} ms per decode step = "
                          f"{1e3 * (seconds - collective) / steps:7.2f} compute + {1e3 * collective / steps:6.2f} "
                          f"in {calls / steps:.0f} collectives ({moved / steps / 1e3:.1f} kB per step)", flush=True)
            finally:
                core.close()


if __name__ == "__main__":
    main()
