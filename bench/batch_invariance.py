"""What batch invariance costs: the engine (no HTTP) on the default model with and without
``--batch-invariant``, alternated in one sitting, at 1 / 8 / 32 / 64 streams.

At N streams, N requests (random prompts of ``--prompt-len`` tokens, ``--output-len`` tokens out,
greedy, ``ignore_eos``) are queued at once and run to the end; printed per round: output tok/s
of each configuration and the ratio invariant / default. The two engines hold two copies of the
model (fixing a model's summation order is a property of the model object).

    python bench/batch_invariance.py [--streams 1,8,32,64] [--rounds 2] [--prompt-len 128] [--output-len 64]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.packed import cpu_name  # noqa: E402
from bench.spec_decode import run as run_at_once  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.device_thread import DeviceThread  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.models.loader import load_model, resolve_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,8,32,64")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    print(f"CPU: {cpu_name()}, torch threads {torch.get_num_threads()}")
    config = EngineConfig(backend="cpu", max_num_seqs=max(streams), enable_prefix_caching=False)
    cores = {}
    for name, invariant in (("default", False), ("invariant", True)):
        model = DeviceThread.shared().run_sync(load_model, resolve_model(None), "auto", torch.float32, "cpu", 0)
        cores[name] = EngineCore(attrs.evolve(config, batch_invariant=invariant), model=model)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for core in cores.values():  # (warm both)
        run_at_once(core, [[rng.randrange(100, 40000) for _ in range(16)]], params, True)
    for n in streams:
        prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(n)]
        for round_ in range(args.rounds):
            order = list(cores) if round_ % 2 == 0 else list(cores)[::-1]  # alternated
            rates = {}
            for name in order:
                result = run_at_once(cores[name], prompts, params, True)
                rates[name] = result.tokens / result.seconds
            print(f"{n:3d} streams, round {round_ + 1}: default {rates['default']:7.1f}, invariant "
                  f"{rates['invariant']:7.1f} output tok/s: invariant / default = "
                  f"{rates['invariant'] / rates['default']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
