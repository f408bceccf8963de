"""Cost of the prefix cache's SHA-256 block hashes against the prefill they serve.

Times, in one run: hashing one block, hashing every block of a long prompt (what admission
does), the old ``hash()`` of a tuple for comparison, and one prefill step of that prompt on
a random-weight model of the default shape (no model file needed).

    python bench/prefix_hash.py --prompt-len 1000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sched.kv_cache import block_hash  # noqa: E402
from engine.sched.request import Request  # noqa: E402


def best_of(fn, repeats: int) -> float:
    """Fastest wall time of ``fn`` over ``repeats`` calls (seconds)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def hash_prompt(tokens: list[int], block_size: int, salt: str | None) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(tokens) // block_size):
        hashes.append(block_hash(hashes[-1] if hashes else None, tokens[i * block_size:(i + 1) * block_size], salt))
    return hashes


def python_hash_prompt(tokens: list[int], block_size: int) -> list[int]:
    hashes: list[int] = []
    for i in range(len(tokens) // block_size):
        hashes.append(hash((hashes[-1] if hashes else None, tuple(tokens[i * block_size:(i + 1) * block_size]))))
    return hashes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    tokens = [(i * 7919) % 49152 for i in range(args.prompt_len)]
    bs = args.block_size
    num_blocks = args.prompt_len // bs

    one = best_of(lambda: block_hash(b"\0" * 32, tokens[:bs]), 2000)
    sha = best_of(lambda: hash_prompt(tokens, bs, "tenant-a"), 200)
    old = best_of(lambda: python_hash_prompt(tokens, bs), 200)

    core = EngineCore(EngineConfig(load_format="dummy", backend=args.backend, block_size=bs,
                                   max_num_batched_tokens=max(1024, args.prompt_len), num_kv_blocks=num_blocks + 4))

    def prefill() -> None:
        core.add_request("p", tokens, SamplingParams(max_tokens=1))
        while core.has_unfinished_requests:
            core.step()
        core.block_manager.reset_prefix_cache()

    prefill()  # warm-up
    step = best_of(prefill, 3)
    print(f"block_size {bs}, {num_blocks} full blocks in a {args.prompt_len}-token prompt; backend {core.backend.name}")
    print(f"  SHA-256 block hash:        {one * 1e6:8.2f} us per block")
    print(f"  every block of the prompt: {sha * 1e6:8.1f} us  (python hash() of tuples: {old * 1e6:.1f} us, "
          f"{sha / old:.1f}x)")
    print(f"  prefill of the prompt:     {step * 1e3:8.1f} ms  -> hashing is {sha / step:.4%} of it")
    request = Request("r", tokens, SamplingParams(), 1, None, 0)
    assert hash_prompt(tokens, bs, None) == [block_hash(p, c) for p, c in _chain(request, bs)]


def _chain(request: Request, bs: int):
    """(parent, block tokens) pairs as the block manager hashes them (a self-check of the loop above)."""
    parent = None
    for i in range(request.num_tokens // bs):
        chunk = request.token_ids[i * bs:(i + 1) * bs]
        yield parent, chunk
        parent = block_hash(parent, chunk)


if __name__ == "__main__":
    main()
