"""KV cache a long request holds on a model that mixes global and sliding-window layers: a block
table per layer group (the default, engine/kv_groups.py) against one table for every layer
(--disable-hybrid-kv-cache-manager), measured as the most bytes of blocks in use while one
request of --tokens tokens runs, on random weights of a Gemma 2 or Gemma 3 layer pattern
(transformers builds the model from its config; its hidden size is small, its layer count and
window are the family's unless given).

    python bench/kv_held.py [--family gemma2|gemma3] [--tokens 8192] [--window 4096]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.runner.model_runner import ModelRunner  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

# Layer counts of Gemma 2 2B (every other layer sliding) and Gemma 3 1B (five sliding, one global).
FAMILIES = {
    "gemma2": dict(model_type="gemma2", num_hidden_layers=26, sliding_window=4096),
    "gemma3": dict(model_type="gemma3_text", num_hidden_layers=26, sliding_window=512, sliding_window_pattern=6),
}


def save_model(family: str, window: int | None, directory: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(FAMILIES[family])
    model_type = fields.pop("model_type")
    if window is not None:
        fields["sliding_window"] = window
    config = AutoConfig.for_model(model_type, vocab_size=512, hidden_size=64, intermediate_size=128,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                  max_position_embeddings=1 << 16, **fields)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory, safe_serialization=True)


def held(directory: Path, tokens: int, hybrid: bool) -> tuple[int, int, int, float, str]:
    """(blocks in use while decoding, the most in use, bytes per block, seconds, the groups) for
    one request of ``tokens`` prompt tokens."""
    core = EngineCore(EngineConfig(model=str(directory), backend="cpu", dtype="float32", kv_cache_dtype="float32",
                                   max_model_len=tokens + 8, disable_hybrid_kv_cache_manager=not hybrid,
                                   num_kv_blocks=2 * -(-(tokens + 8) // 16) * 8))
    prompt = torch.randint(3, 500, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    core.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    most = decoding = 0
    start = time.perf_counter()
    while core.has_unfinished_requests:
        core.step()
        used = core.block_manager.num_used_blocks
        most = max(most, used)
        if core.has_unfinished_requests:
            decoding = used
    per_block = ModelRunner.kv_bytes_per_block(core.model, 16, core.kv_dtype, hybrid)
    groups = core.kv_groups
    return decoding, most, per_block, time.perf_counter() - start, f"{groups.num_groups} groups of {groups.size} layers"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="gemma2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=None, help="the sliding window (default: the family's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        save_model(args.family, args.window, Path(tmp))
        results = {hybrid: held(Path(tmp), args.tokens, hybrid) for hybrid in (False, True)}
    for hybrid, (decoding, most, per_block, seconds, groups) in results.items():
        name = "a table per layer group" if hybrid else "one table"
        print(f"{name:24s} {groups:22s} decoding {decoding:5d} blocks x {per_block:6d} B = "
              f"{decoding * per_block / 1e6:8.2f} MB; the most {most * per_block / 1e6:8.2f} MB  ({seconds:.1f} s)")
    one, grouped = ((r[0] * r[2], r[1] * r[2]) for r in (results[False], results[True]))
    print(f"{args.family}, {args.tokens} prompt tokens: a table per group holds {grouped[0] / one[0]:.2f}x the bytes "
          f"of one table while decoding, {grouped[1] / one[1]:.2f}x at the most")


if __name__ == "__main__":
    main()
