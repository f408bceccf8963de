"""Speculative decoding with n-gram (or a draft model's) proposals against none, in the engine (no
HTTP), alternated (at concurrency 1 prompt by prompt, which core goes first alternating: running
each core's eight prompts back to back read 1.11-1.42x on one tree, this machine's drift between
the halves).

Three workloads on the default model (chat-templated prompts, greedy, ``ignore_eos`` off so
answers end where the model ends them, at most ``--max-tokens``):

- ``edit``: copy a few lines of code with one change (most of the answer is in the prompt:
  what prompt lookup is for);
- ``chat``: plain questions (little to look up);
- ``file``: as ``edit``, with whole small files (20-30 lines; ``--max-tokens 512``); not run by default.

At concurrency 1 the prompts run one at a time; at ``--streams`` N (64) every prompt runs
(repeated up to N of them), N in flight, the next joining as one ends (which core goes first
alternating by round). Above ``disable_by_batch_size`` running requests proposals stop, unless
``--force`` sets it to N. Printed: output tok/s per configuration, the ratio to no proposals from
the same round, and the mean tokens per drafted step (kept drafts + 1).

With the cpu backend's default int8 cache the two runs' texts can part: a verifying step computes
its rows in one pass, so their keys and values differ from one-row steps' in the last bits, and
rounding them to int8 turns that into differences of ~1e-2 in a logprob (not ~1e-5 as with a
float32 cache), which flips near-ties. The run says so when the token counts differ;
``--kv-cache-dtype float16`` (or float32) compares equal texts.

``--draft-model PATH`` (``default``: the default model as its own draft) proposes with a draft
model instead (speculative method ``draft_model``), ``--num-speculative-tokens`` a step.

    python bench/spec_decode.py [--rounds 2] [--max-tokens 128] [--streams 64] [--force]
        [--workloads edit,chat,file] [--concurrency 1,streams] [--draft-model PATH] [--kv-cache-dtype auto]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.packed import cpu_name  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.device_thread import DeviceThread  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.models.loader import load_model, resolve_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.tokenizer import tokenizer_for  # noqa: E402

CODE = [
    "def area(width, height):\n    result = width * height\n    return result\n\n\nprint(area(2, 3))\n",
    "for item in items:\n    if item.ready:\n        process(item)\n    else:\n        skip(item)\nreport(items)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "x = load('data.csv')\ny = clean(x)\nz = train(y, epochs=3)\nsave(z, 'model.bin')\nprint('done')\n",
]
# Whole small files (20-30 lines): answers of ~100-500 tokens, most of them copied (run with
# --max-tokens 512).
FILES = [
    "import json\nimport os\n\n\ndef load_config(path):\n    \"\"\"Read the settings file and fill in defaults.\"\"\"\n"
    "    with open(path) as handle:\n        config = json.load(handle)\n"
    "    config.setdefault(\"host\", \"localhost\")\n"
    "    config.setdefault(\"port\", 8080)\n    config.setdefault(\"debug\", False)\n    return config\n\n\n"
    "def save_config(config, path):\n    tmp = path + \".tmp\"\n    with open(tmp, \"w\") as handle:\n"
    "        json.dump(config, handle, indent=2)\n    os.replace(tmp, path)\n\n\ndef main():\n"
    "    config = load_config(\"settings.json\")\n    if config[\"debug\"]:\n        print(\"debug mode on\")\n"
    "    save_config(config, \"settings.json\")\n\n\nif __name__ == \"__main__\":\n    main()\n",
    "class Inventory:\n    def __init__(self):\n        self.items = {}\n\n    def add(self, name, count=1):\n"
    "        self.items[name] = self.items.get(name, 0) + count\n\n    def remove(self, name, count=1):\n"
    "        if self.items.get(name, 0) < count:\n            raise ValueError(\"not enough \" + name)\n"
    "        self.items[name] -= count\n        if self.items[name] == 0:\n            del self.items[name]\n\n"
    "    def total(self):\n        return sum(self.items.values())\n\n    def report(self):\n"
    "        for name, count in sorted(self.items.items()):\n            print(name, count)\n\n\n"
    "store = Inventory()\nstore.add(\"apple\", 3)\nstore.add(\"pear\")\nstore.remove(\"apple\")\nstore.report()\n",
    "def parse_line(line):\n    parts = line.strip().split(\",\")\n    name = parts[0]\n    age = int(parts[1])\n"
    "    city = parts[2]\n    return {\"name\": name, \"age\": age, \"city\": city}\n\n\ndef read_people(path):\n"
    "    people = []\n    with open(path) as handle:\n        for line in handle:\n"
    "            if line.startswith(\"#\"):\n                continue\n            people.append(parse_line(line))\n"
    "    return people\n\n\ndef oldest(people):\n    best = None\n    for person in people:\n"
    "        if best is None or person[\"age\"] > best[\"age\"]:\n            best = person\n    return best\n\n\n"
    "people = read_people(\"people.csv\")\nprint(oldest(people))\n",
    "function fetchUser(id) {\n  return fetch(\"/api/users/\" + id)\n    .then(function (response) {\n"
    "      if (!response.ok) {\n        throw new Error(\"request failed: \" + response.status);\n      }\n"
    "      return response.json();\n    })\n    .then(function (user) {\n      console.log(\"loaded\", user.name);\n"
    "      return user;\n    });\n}\n\nfunction showUser(user) {\n  const box = document.getElementById(\"user\");\n"
    "  box.textContent = user.name + \" (\" + user.email + \")\";\n}\n\n"
    "fetchUser(42).then(showUser).catch(function (error) {\n  console.error(error);\n});\n",
]
EDITS = ["rename the variables", "add a comment at the top", "use single quotes"]
QUESTIONS = ["Tell me about the sea.", "What is a lighthouse?", "Why do leaves fall in autumn?",
             "Write a short poem about the moon.", "How do trains work?", "What is bread made of?",
             "Explain chess to a child.", "Why is the sky blue?"]


def workloads() -> dict[str, list[str]]:
    edit = [f"Copy this with one change ({change}):\n\n{code}" for code in CODE for change in EDITS[:2]]
    file = [f"Copy this with one change ({change}):\n\n{code}" for code in FILES for change in EDITS[:2]]
    return {"edit": edit, "chat": QUESTIONS, "file": file}


@attrs.define
class Run:
    """One configuration's run: output tokens, seconds, and (one prompt at a time) the time of
    the steps that gave a prompt its first token (its prefill) and the other steps' count and time."""

    tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_seconds: float = 0.0

    def __iadd__(self, other: Run) -> Run:
        for field in attrs.fields(Run):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))
        return self


def run(core: EngineCore, prompts: list[list[int]], params: SamplingParams, concurrency: int = 1) -> Run:
    """The prompts in order, ``concurrency`` of them in flight (the next one joining as one ends)."""
    result, start = Run(), time.perf_counter()
    waiting, in_flight = list(prompts), 0
    first = True  # (one prompt at a time: its steps up to its first token are its prefill)
    while waiting or in_flight:
        while waiting and in_flight < concurrency:
            core.add_request(f"{time.perf_counter_ns()}-{len(waiting)}", waiting.pop(0), params)
            in_flight += 1
        step_start = time.perf_counter()
        deltas = core.step()
        took = time.perf_counter() - step_start
        tokens = sum(len(d.new_token_ids) for d in deltas)
        result.tokens += tokens
        if first and concurrency == 1:
            result.prefill_seconds += took
            first = tokens == 0
        else:
            result.decode_steps += 1
            result.decode_seconds += took
        ended = sum(d.finish_reason is not None for d in deltas)
        in_flight -= ended
        assert in_flight == 0 or core.has_unfinished_requests, "a request ended without a finishing delta"
        first = first or ended > 0
    result.seconds = time.perf_counter() - start
    return result


def ceiling(none: Run, ngram: Run) -> float:
    """The most n-gram proposals could give here if a verifying step cost no more than a one-token
    step: no proposals' run time over the prefills and the proposals' decode steps at the one-token
    step's time (each drafted step still costs one). Two things bound it: the tokens a step gains
    where the answer is no copy of the prompt (1 a step), and the prefill both runs share."""
    step = none.decode_seconds / none.decode_steps
    return none.seconds / (ngram.prefill_seconds + ngram.decode_steps * step + (ngram.seconds - ngram.prefill_seconds
                                                                               - ngram.decode_seconds))


def speculative_config(args: argparse.Namespace) -> dict:
    """``--speculative-config`` of the run with proposals, from the command line."""
    if args.draft_model:
        draft = str(resolve_model(None).path) if args.draft_model == "default" else args.draft_model
        spec = {"method": "draft_model", "model": draft}
    else:
        spec = {"method": "ngram", "prompt_lookup_min": args.prompt_lookup_min,
                "prompt_lookup_max": args.prompt_lookup_max}
    spec["num_speculative_tokens"] = args.num_speculative_tokens
    if args.force:
        spec["disable_by_batch_size"] = args.streams
    return spec


def compare(cores: dict[str, EngineCore], batch: list[list[int]], params: SamplingParams, concurrency: int,
            tag: str, round_: int = 0) -> None:
    """One round: each core over ``batch`` (one prompt at a time: in turns, prompt by prompt), its
    rate printed, then the ratio (and, one prompt at a time, where the time went and the ceiling)."""
    method = [key for key in cores if key != "none"][0]
    before = {key: core.stats() for key, core in cores.items()}
    runs = {key: Run() for key in cores}
    # One prompt at a time, the cores take turns per prompt (the first one alternating), so that
    # this machine's drift over a round falls on both alike; several at once, the first alternates by round.
    one = concurrency == 1
    for i, part in enumerate([[prompt] for prompt in batch] if one else [batch], start=round_):
        for key in (list(cores) if i % 2 == 0 else list(cores)[::-1]):
            runs[key] += run(cores[key], part, params, concurrency)
    rates = {}
    for key, core in cores.items():
        result, after = runs[key], core.stats()
        rates[key] = result.tokens / result.seconds
        drafted = after.spec_num_drafts - before[key].spec_num_drafts
        kept = after.spec_num_accepted_tokens - before[key].spec_num_accepted_tokens
        per_step = f", {1 + kept / drafted:.2f} tokens per drafted step" if drafted else ""
        print(f"{tag}: {key:11s} {rates[key]:7.1f} output tok/s ({result.tokens} tokens){per_step}")
    none, drafted = runs["none"], runs[method]
    line = f"{tag}: {method} / none = {rates[method] / rates['none']:.2f}x"
    if one:
        line += (f"; prefill {none.prefill_seconds / none.seconds:.0%} of none's time, "
                 f"{drafted.tokens / (drafted.decode_steps + len(batch)):.2f} tokens a step with "
                 f"proposals, {none.tokens / (none.decode_steps + len(batch)):.2f} without; "
                 f"at most {ceiling(none, drafted):.2f}x if verifying cost a one-token step")
    print(line)
    if drafted.tokens != none.tokens:
        print(f"{tag}: the texts differ ({none.tokens} vs {drafted.tokens} tokens), so the ratio compares "
              "different answers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=3)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--force", action="store_true", help="proposals at --streams too (disable_by_batch_size)")
    parser.add_argument("--workloads", default="edit,chat", help="comma-separated: edit, chat, file")
    parser.add_argument("--concurrency", default="1,streams", help="comma-separated: 1, streams")
    parser.add_argument("--draft-model", help="a draft model's proposals instead of n-gram ('default': the model)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="the cache's element type (auto: the cpu backend's int8; float16 or float32 keep "
                             "the two runs' texts equal, see the module docstring)")
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}, torch threads {torch.get_num_threads()}")
    model = DeviceThread.shared().run_sync(load_model, resolve_model(None), "auto", torch.float32, "cpu", 0)
    config = EngineConfig(backend="cpu", dtype="float32", max_num_seqs=max(args.streams, 1), enable_prefix_caching=False,
                          kv_cache_dtype=args.kv_cache_dtype)
    tokenizer = tokenizer_for(config)
    spec = speculative_config(args)
    cores = {"none": EngineCore(config, model=model),
             spec["method"]: EngineCore(attrs.evolve(config, speculative_config=spec), model=model)}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for name, messages in workloads().items():
        if name not in args.workloads.split(","):
            continue
        prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                                                  add_generation_prompt=True), add_special_tokens=False)
                   for m in messages]
        # N streams: every prompt (repeated up to N of them), N in flight.
        shapes = {"1": ("1 stream", prompts, 1),
                  "streams": (f"{args.streams} streams", (prompts * args.streams)[:max(args.streams, len(prompts))],
                              args.streams)}
        for label, batch, concurrency in (shapes[c] for c in args.concurrency.split(",")):
            for round_ in range(args.rounds):
                compare(cores, batch, params, concurrency, f"{name:5s} {label:11s} round {round_ + 1}", round_)


if __name__ == "__main__":
    main()
