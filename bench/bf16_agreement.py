"""Greedy agreement of the engine in bfloat16 (and float32) with transformers in float32.

Over the parity tests' prompts (tests/test_parity.py), 24 new tokens each: for each dtype,
how many prompts give transformers' exact tokens, and the share of tokens identical before
the first divergence. bf16 rounds every product, so greedy paths part where two candidates
are close; this measures how often that happens on the default model.

    python bench/bf16_agreement.py [--backend cpu]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.api import LLM, SamplingParams  # noqa: E402
from engine.models.loader import default_model_path  # noqa: E402
from tests.test_parity import MAX_TOKENS, PROMPTS  # noqa: E402


@torch.inference_mode()
def transformers_greedy(prompt_ids: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    outputs = []
    for ids in prompt_ids:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)), do_sample=False,
                             max_new_tokens=MAX_TOKENS, pad_token_id=2, top_k=None, top_p=None, temperature=None)
        outputs.append(out[0, len(ids):].tolist())
    return outputs


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """(prompts identical throughout, share of reference tokens matched before the first divergence)."""
    identical, matched = 0, 0
    for mine, theirs in zip(ours, reference):
        prefix = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        identical += mine == theirs
        matched += prefix
    return identical, matched / sum(len(r) for r in reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    results = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(backend=args.backend, dtype=dtype, activation_quantization="none")  # the dtype alone
        start = time.perf_counter()
        results[dtype] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        print(f"{dtype}: {time.perf_counter() - start:.1f} s")
        prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    reference = transformers_greedy(prompt_ids)
    for dtype, ours in results.items():
        identical, share = agreement(ours, reference)
        print(f"{dtype:>9}: {identical}/{len(PROMPTS)} prompts token-identical to transformers (fp32); "
              f"{share:.1%} of tokens identical before the first divergence")


if __name__ == "__main__":
    main()
