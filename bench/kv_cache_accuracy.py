"""How much each KV cache element type changes the default model's next-token distributions.

The engine (float32, float32 KV cache) writes greedy continuations of the parity prompts
(tests/test_parity.py) plus a few longer ones; then every sequence (prompt + continuation) is
run through the model once per cache type (``--kv-cache-dtype``), and at every generated
position the next-token distribution is compared with the float32 cache's: mean KL
divergence KL(p_fp32 || p_dtype) and top-1 agreement (the argmax is the same token).

    python bench/kv_cache_accuracy.py [--backend cpu] [--max-tokens 160] [--activations bf16]

``--activations bf16`` (or ``int16``) also rounds every packed product's activations in the runs
compared (the reference keeps float32 activations and cache): the CPU default's arithmetic as a
whole (``--activation-quantization auto`` and ``--kv-cache-dtype auto`` on an AVX512_BF16 CPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends import get_backend  # noqa: E402
from backends import kv_cache as kvc  # noqa: E402
from backends.base import AttentionMetadata  # noqa: E402
from engine.api import LLM, SamplingParams  # noqa: E402
from engine.models.loader import load_model, resolve_model  # noqa: E402
from tests.test_parity import PROMPTS  # noqa: E402

EXTRA_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain step by step how a refrigerator keeps food cold.",
    "List ten facts about the planet Mars, one per line.",
    "A recipe for bread, with quantities and timings:",
]


@torch.inference_mode()
def distributions(model, backend, spec, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Log-probabilities ``[len(token_ids), vocab]`` of one sequence in one prefill with a ``spec`` cache."""
    cfg = model.config
    length = len(token_ids)
    num_blocks = -(-length // block_size)
    shape = backend.kv_cache_shape(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, spec)
    caches = [torch.zeros(shape, dtype=spec.storage) for _ in range(cfg.num_layers)]
    scales = [torch.ones(2) for _ in range(cfg.num_layers)] if spec.is_fp8 else None
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, length], dtype=torch.int32),
                             seq_lens=torch.tensor([length], dtype=torch.int32),
                             block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
                             slot_mapping=torch.arange(length), max_query_len=length, max_seq_len=length)
    ids = torch.tensor(token_ids)
    hidden = model.forward(ids, torch.arange(length), caches, meta, backend, scales)
    return model.compute_logits(hidden).log_softmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=160, help="new tokens per prompt")
    parser.add_argument("--dtypes", default=",".join(kvc.KV_CACHE_DTYPES))
    parser.add_argument("--activations", choices=("none", "int16", "bf16"), default="none",
                        help="round the compared runs' activations too (every product, every row)")
    args = parser.parse_args()
    prompts = PROMPTS + EXTRA_PROMPTS
    llm = LLM(backend=args.backend, dtype="float32", kv_cache_dtype="float32", activation_quantization="none")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    tokenizer = llm.get_tokenizer()
    sequences = []
    for prompt, output in zip(prompts, llm.generate(prompts, params)):
        prompt_ids = tokenizer.encode(prompt)
        sequences.append((len(prompt_ids), prompt_ids + list(output.outputs[0].token_ids)))
    del llm
    generated = sum(len(ids) - start for start, ids in sequences)
    print(f"{len(sequences)} sequences, {generated} generated positions; backend {args.backend}, float32 model")

    model = load_model(resolve_model(None), "auto", torch.float32, "cpu", 0)
    backend = get_backend(args.backend, "cpu")
    reference = [distributions(model, backend, kvc.kv_cache_dtype("float32"), ids)[start - 1:-1]
                 for start, ids in sequences]
    if args.activations != "none":
        model.quantize_activations(args.activations, (1 << 30) if args.activations == "int16" else 1)
        print(f"compared runs: {args.activations} activations in every product")
    for name in args.dtypes.split(","):
        spec = kvc.kv_cache_dtype(name)
        started = time.perf_counter()
        kl_sum, agree, count = 0.0, 0, 0
        for (start, ids), ref in zip(sequences, reference):
            logp = distributions(model, backend, spec, ids)[start - 1:-1]
            kl_sum += float((ref.exp() * (ref - logp)).sum(-1).clamp_min(0).sum())
            agree += int((ref.argmax(-1) == logp.argmax(-1)).sum())
            count += ref.shape[0]
        per_token = spec.bytes_per_token(model.config.num_layers, model.config.num_kv_heads, model.config.head_dim)
        print(f"{name:>9}: {per_token / 1e3:5.1f} KB/token  mean KL {kl_sum / count:.2e}  "
              f"top-1 agreement {agree / count:.2%} ({agree}/{count})  [{time.perf_counter() - started:.0f} s]")


if __name__ == "__main__":
    main()
