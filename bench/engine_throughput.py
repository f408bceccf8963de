"""Engine-core throughput without a tokenizer: random-weight model of the default shape.

Drives ``EngineCore.step()`` directly (no actors, no tokenizer, no model file needed), so
it runs on a bare GPU machine with only torch, attrs, numpy and cffi.

    python bench/engine_throughput.py --backend cuda --num-requests 256
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    args = parser.parse_args()
    core = EngineCore(EngineConfig(load_format="dummy", backend=args.backend, dtype=args.dtype,
                                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens))
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_requests):
        core.add_request(str(i), [rng.randrange(1000, 49000) for _ in range(args.prompt_len)], params)
    start = time.perf_counter()
    generated = 0
    while core.has_unfinished_requests:
        generated += sum(len(d.new_token_ids) for d in core.step())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    stats = core.stats()
    print(f"backend {core.backend.name} on {core.device}: {args.num_requests} requests x ({args.prompt_len} prompt + "
          f"{args.output_len} output) in {elapsed:.2f} s, {stats.num_steps} steps: "
          f"{generated / elapsed:.0f} output tok/s, {(generated + stats.num_prompt_tokens) / elapsed:.0f} total tok/s")


if __name__ == "__main__":
    main()
