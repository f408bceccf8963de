"""Structured outputs: what a JSON constraint costs in decode throughput, and compile times.

1. Decode throughput (output tok/s, offline ``LLM``, default model, greedy, 64 output tokens
   per request) with every request JSON-constrained against the same requests unconstrained,
   at batch 1, 8 and 32, alternated in one run. The schema (40 integers) outlasts 64 tokens,
   so both sides produce exactly the same number of tokens.
2. Compile time per schema over the test corpus (tests/data/json_schemas.json): p50 / p99
   cold (an empty cache) and cached; and of tool-call grammars with 1, 8 and all of the
   corpus's object schemas as functions.

    python bench/structured.py [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.api import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from engine.structured_outputs import StructuredOutputManager  # noqa: E402
from engine.tools import plan_tools  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 40, "maxItems": 40}
OUTPUT_TOKENS = 64


def throughput(llm: LLM, batch: int, constrained: bool) -> float:
    prompts = [[{"role": "user", "content": f"List forty numbers, as a JSON array (#{i})."}] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA) if constrained else None)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.chat(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert tokens == batch * OUTPUT_TOKENS, tokens
    return tokens / elapsed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def compile_times(llm: LLM) -> None:
    schemas = json.loads((ROOT / "tests" / "data" / "json_schemas.json").read_text())["schemas"]
    manager = StructuredOutputManager(llm.tokenizer, llm.engine.vocab_size)
    start = time.perf_counter()
    _ = manager.backend  # the tokenizer's vocabulary, once per process
    print(f"backend set-up (vocabulary of {llm.engine.vocab_size} tokens): {(time.perf_counter() - start) * 1e3:.0f} ms")
    for label in ("cold", "cached"):
        times = []
        for schema in schemas:
            start = time.perf_counter()
            manager.compile(StructuredOutputsParams(json=schema))
            times.append(time.perf_counter() - start)
        print(f"compile, {label:6s} ({len(schemas)} schemas): p50 {percentile(times, 50) * 1e3:7.3f} ms, "
              f"p99 {percentile(times, 99) * 1e3:7.3f} ms")
    # Tool calls: one function per object schema of the corpus, as its parameters.
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": s}}
             for i, s in enumerate(schemas) if s.get("type") == "object"]
    for count in (1, 8, len(tools)):
        for choice in ("auto", "required"):
            params = plan_tools(tools[:count], choice).constrain(SamplingParams()).structured_outputs
            start = time.perf_counter()
            manager.compile(params)
            cold = time.perf_counter() - start
            start = time.perf_counter()
            manager.compile(params)
            print(f"tool-call grammar, {count:2d} functions, tool_choice {choice:8s}: compile cold "
                  f"{cold * 1e3:7.1f} ms, cached {(time.perf_counter() - start) * 1e3:6.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2, help="alternated runs per case; the best is printed")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--compile-only", action="store_true", help="only the compile times")
    args = parser.parse_args()
    llm = LLM(dtype="float32")
    if args.compile_only:
        compile_times(llm)
        return
    throughput(llm, 2, True)  # warm-up: first compile, first steps
    print(f"decode throughput, {OUTPUT_TOKENS} greedy tokens per request (best of {args.repeat}, alternated):")
    for batch in map(int, args.batches.split(",")):
        free, constrained = [], []
        for _ in range(args.repeat):
            free.append(throughput(llm, batch, False))
            constrained.append(throughput(llm, batch, True))
        print(f"  batch {batch:3d}: unconstrained {max(free):7.1f} tok/s, JSON-constrained {max(constrained):7.1f} "
              f"tok/s: {100 * max(constrained) / max(free):5.1f}%")
    compile_times(llm)


if __name__ == "__main__":
    main()
