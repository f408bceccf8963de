"""Offline throughput: the engine against transformers' generate() in static batches.

64 requests with prompt lengths 16-512 and output lengths 16-256 (uniform, fixed seed),
ignore_eos, greedy. transformers runs them in submission order in static batches of
--hf-batch-size (left-padded; each batch generates until its longest request is done), as
a user of transformers would. Throughput counts only the requested output tokens.

    python bench/offline.py [--backend torch] [--num-requests 64] [--hf-batch-size 16]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.api import LLM, SamplingParams  # noqa: E402
from engine.core.device_thread import DeviceThread  # noqa: E402
from engine.models.loader import default_model_path, read_config, resolve_model  # noqa: E402


def make_workload(num_requests: int, seed: int, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    # Token ids above the special tokens (the first few hundred ids of SmolLM2's vocabulary).
    return [([rng.randrange(1000, vocab_size) for _ in range(rng.randint(16, 512))], rng.randint(16, 256))
            for _ in range(num_requests)]


def run_engine(args, workload) -> float:
    llm = LLM(args.model, tokenizer=args.tokenizer, backend=args.backend, load_format=args.load_format,
              max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_mixed_prefill_tokens=args.max_num_mixed_prefill_tokens)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    prompts = [{"prompt_token_ids": ids} for ids, _ in workload]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2)  # warm-up
    before = llm.engine.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [n for _, n in workload]
    stats = llm.engine.stats()
    print(f"engine: {elapsed:.1f} s, {stats.num_steps - before.num_steps} steps, {stats.num_preemptions} preemptions")
    roofline(llm.engine.model, stats.num_prompt_tokens - before.num_prompt_tokens,
             stats.num_generation_tokens - before.num_generation_tokens, elapsed)
    return elapsed


def roofline(model, prompt_tokens: int, generated_tokens: int, elapsed: float) -> None:
    """The engine's matrix-product rate (2 x weights x tokens through them / time) against the
    rate of one large fp32 product of the model's own shape, measured now."""
    def numel(linear) -> int:
        return linear.in_features * linear.out_features

    layer_weights = sum(numel(t) for layer in model.layers
                        for t in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))
    # Every computed token goes through the layers; only sampled positions through the LM head.
    flops = 2 * (layer_weights * (prompt_tokens + generated_tokens) + numel(model.lm_head) * generated_tokens)
    achieved = flops / elapsed / 1e9
    peak = DeviceThread.shared().run_sync(matmul_gflops, model.config.hidden_size,
                                          model.layers[0].gate_up_proj.out_features, model.dtype)
    print(f"engine: {achieved:.1f} GFLOP/s in its matrix products ({prompt_tokens} prompt + {generated_tokens} "
          f"generated tokens), {achieved / peak:.0%} of this CPU's {peak:.1f} GFLOP/s for a 1024-row "
          f"{model.dtype} product of the model's shape (measured now)")


def matmul_gflops(hidden: int, out: int, dtype: torch.dtype, rows: int = 1024) -> float:
    x, w = torch.randn(rows, hidden, dtype=dtype), torch.randn(out, hidden, dtype=dtype)
    best = float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return 2 * rows * hidden * out / best / 1e9


@torch.inference_mode()
def run_transformers(args, workload) -> float:
    from transformers import AutoModelForCausalLM

    path = Path(args.model) if args.model else default_model_path()
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    else:  # a Hugging Face directory
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = model.config.pad_token_id or 0
    start = time.perf_counter()
    for i in range(0, len(workload), args.hf_batch_size):
        batch = workload[i:i + args.hf_batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in batch])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
        new = max(n for _, n in batch)
        model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                       pad_token_id=pad, top_k=None, top_p=None, temperature=None)
    elapsed = time.perf_counter() - start
    print(f"transformers: {elapsed:.1f} s in batches of {args.hf_batch_size}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokenizer", default=None,
                        help="where the tokenizer is, for a model directory without one (e.g. random "
                             "weights saved by transformers); the prompts are token ids either way")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--max-num-mixed-prefill-tokens", type=int, default=None, help="default: the device's")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    source = resolve_model(args.model, allow_missing_default=args.load_format == "dummy")
    workload = make_workload(args.num_requests, args.seed, vocab_size=read_config(source).vocab_size)
    output_tokens = sum(n for _, n in workload)
    print(f"{len(workload)} requests, {sum(len(p) for p, _ in workload)} prompt tokens, {output_tokens} output tokens")
    engine_s = run_engine(args, workload)
    print(f"engine throughput: {output_tokens / engine_s:.1f} output tokens/s")
    if args.skip_transformers:
        return
    # (on the engine's device thread too: torch work on this thread would open a second OpenMP
    # pool beside the engine's idle one, and every parallel region would then wait for a
    # sleeping worker; engine/core/device_thread.py)
    hf_s = DeviceThread.shared().run_sync(run_transformers, args, workload)
    print(f"transformers throughput: {output_tokens / hf_s:.1f} output tokens/s")
    print(f"ratio engine / transformers: {hf_s / engine_s:.2f}x")


if __name__ == "__main__":
    main()
