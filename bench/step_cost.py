"""What one engine step costs against its number of tokens, measured in the engine.

``D`` requests decode (128-token prompts); before each step a fresh prompt of ``p`` tokens
may join it (a mixed step of D + p tokens), for p over a range, in shuffled order, three
times each. Prints the median step time per token count and its ratio to a decode-only step:
the curve that decides how much prefill a decoding step can carry before every stream's
inter-token latency grows (``bench/schedule_sim.py --curve`` replays the scheduler on it).

    python bench/step_cost.py --decodes 64
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--decodes", type=int, default=64)
    parser.add_argument("--prefill", default="0,8,16,32,48,64,96,128,192,256", help="prompt sizes joining a step")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="of the decoding requests (0, greedy, as bench/serve.py sends by default)")
    args = parser.parse_args()

    core = EngineCore(EngineConfig(model=args.model, backend=args.backend, max_num_seqs=args.decodes + 8,
                                   max_num_batched_tokens=4096))
    rng = random.Random(0)
    vocab = core.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    for i in range(args.decodes):
        core.add_request(f"d{i}", tokens(128), SamplingParams(temperature=args.temperature, max_tokens=2048,
                                                                   ignore_eos=True))
    for _ in range(3):  # admission, then decode steps
        core.step()
    sizes = [int(p) for p in args.prefill.split(",")] * args.repeat
    rng.shuffle(sizes)
    seconds: dict[int, list[float]] = {}
    for k, p in enumerate(sizes):
        if p:  # one output token: the prompt leaves the batch after its prefill step
            core.add_request(f"p{k}", tokens(p), SamplingParams(temperature=args.temperature, max_tokens=1))
        plan = core.schedule()
        start = time.perf_counter()
        result = core.execute(plan)
        seconds.setdefault(plan.num_batched_tokens, []).append(time.perf_counter() - start)
        core.update(plan, result)
    decode = statistics.median(seconds[args.decodes])
    print(f"{args.decodes} decoding requests (temperature {args.temperature}), backend {args.backend}; step time (device work) by tokens in the step:")
    for n in sorted(seconds):
        t = statistics.median(seconds[n])
        print(f"{n:6d} tokens {t * 1e3:9.1f} ms  {t / decode:5.2f}x the decode-only step")


if __name__ == "__main__":
    main()
