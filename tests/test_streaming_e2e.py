"""Streaming on the real model: 64 concurrent streams equal their non-streamed greedy text;
multi-byte text streams intact; stop strings never leak."""

from __future__ import annotations

import pytest
import trio

from engine.frontend.async_engine import Engine
from engine.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.slow

TOPICS = ["the sea", "a robot", "mountains", "coffee", "the moon", "a library", "trains", "winter"]
UNICODE_PROMPTS = ["Écris une phrase en français sur le café ☕ :", "用中文写一句关于月亮的话：",
                   "Reply with three emoji about the ocean 🌊:", "日本語で挨拶してください：",
                   "Spell café with a combining accent: cafe\u0301 means"]


def stream_params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA, **kw)


async def read_stream(channel) -> tuple[str, list[int], object]:
    text, ids, last = "", [], None
    async for output in channel:
        text += output.outputs[0].text
        ids += output.outputs[0].token_ids
        last = output
    return text, ids, last


async def stream_all(client, prompts, params) -> list[tuple[str, list[int], object]]:
    """Stream every prompt concurrently. All are queued before the engine's next step, as the
    offline ``LLM`` queues them, so both see the same batches: fp32 results depend on the
    batch shape, and only equal shapes promise equal tokens."""
    channels = [client.submit(p, params) for p in prompts]
    results: list = [None] * len(prompts)

    async def one(i):
        results[i] = await read_stream(channels[i])

    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
    return results


PROMPTS_64 = [f"Write one sentence about {TOPICS[i % 8]} (#{i}):" for i in range(64)]


@pytest.fixture(scope="module")
def non_streamed(shared_llm):
    """Greedy completions through the offline API (it runs trio itself, so outside the tests'
    loop), each batch from an empty prefix cache, as the streamed runs below start."""
    greedy = SamplingParams(temperature=0, max_tokens=24)
    unicode = SamplingParams(temperature=0, max_tokens=32)

    def cold(prompts, params):
        shared_llm.reset_prefix_cache()
        return shared_llm.generate(prompts, params)

    return {
        "64": [o.outputs[0].text for o in cold(PROMPTS_64, greedy)],
        "unicode": [o.outputs[0] for o in cold(UNICODE_PROMPTS, unicode)],
        "france": cold("The capital of France is", SamplingParams(temperature=0, max_tokens=20))[0].outputs[0],
    }


async def test_64_concurrent_streams_equal_non_streamed_text(llm, non_streamed):
    async with Engine(llm.engine, llm.tokenizer).serve() as client:
        streamed = [text for text, _, _ in await stream_all(client, PROMPTS_64, stream_params(24))]
        assert client.stats().kv_blocks_used == 0
    assert streamed == non_streamed["64"]


async def test_multibyte_text_streams_intact(llm, non_streamed):
    async with Engine(llm.engine, llm.tokenizer).serve() as client:
        results = await stream_all(client, UNICODE_PROMPTS, stream_params(32))
    for (text, ids, last), final in zip(results, non_streamed["unicode"]):
        assert text == llm.tokenizer.decode(ids, skip_special_tokens=True)
        assert text == final.text and ids == final.token_ids
    assert sum(any(ord(ch) > 127 for ch in text) for text, _, _ in results) >= 2  # the model answered in kind


async def test_stop_string_is_never_streamed(llm, non_streamed):
    prompt = "The capital of France is"
    full = non_streamed["france"]
    stop = full.text[full.text.index("answer") - 2:full.text.index("answer") + 3]  # spans tokens: " answ"-ish
    async with Engine(llm.engine, llm.tokenizer).serve() as client:
        [(text, ids, last)] = await stream_all(client, [prompt], stream_params(20, stop=[stop]))
    assert text == full.text[:full.text.index(stop)]
    assert last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == stop
