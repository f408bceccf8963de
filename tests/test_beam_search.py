"""Beam search (engine/frontend/beam_search.py): transformers' beams, exact scores, and the
search's limits, offline and over HTTP."""

from __future__ import annotations

import pytest
import torch
import trio

from engine.api import BeamSearchParams, Engine, SamplingParams
from engine.errors import EngineOverloadedError, InvalidParameterError
from tests.conftest import serve_http, tiny_engine_core

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.slow
def test_without_end_tokens_the_beams_are_transformers(llm, hf_oracle):
    """ignore_eos: no beam finishes early, so the search is transformers' beam search token for
    token (scores: its length-normalized ones, times the length)."""
    tokenizer = llm.get_tokenizer()
    prompts = ["The capital of France is", "def add(a, b):"]
    outputs = llm.beam_search([{"prompt": p} for p in prompts],
                              BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer.encode(prompt)
        with torch.inference_mode():  # (an end token no beam reaches: transformers' search runs to the end)
            ref = hf_oracle.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)), num_beams=3,
                                           num_return_sequences=3, max_new_tokens=8, do_sample=False, eos_token_id=49151,
                                           pad_token_id=2, output_scores=True, return_dict_in_generate=True,
                                           top_k=None, top_p=None, temperature=None)
        assert [s.tokens for s in output.sequences] == ref.sequences.tolist()
        assert [s.cum_logprob for s in output.sequences] == pytest.approx((ref.sequences_scores * 8).tolist(), abs=1e-3)
        assert all(s.finish_reason == "length" and s.text == tokenizer.decode(s.tokens)  # (vLLM's: the prompt too)
                   for s in output.sequences)


@pytest.mark.slow
def test_beams_end_at_the_end_token_with_the_models_log_probabilities(llm):
    """A beam that picks EOS is finished, whatever its rank among the step's candidates (vLLM's
    rule: here the short answer wins at length_penalty 0, where transformers' rule loses it);
    every score is the model's own sum over the beam (teacher-forced), best first."""
    tokenizer = llm.get_tokenizer()
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    (output,) = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=16, length_penalty=0.0))
    best = output.sequences[0]
    assert best.finish_reason == "stop" and best.tokens[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(best.tokens[len(ids):], skip_special_tokens=True) == " Paris."
    assert [s.cum_logprob for s in output.sequences] == sorted((s.cum_logprob for s in output.sequences), reverse=True)
    for seq in output.sequences:
        forced = llm.generate({"prompt_token_ids": seq.tokens}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        model = sum(position[token].logprob for position, token in
                    zip(forced.prompt_logprobs[len(ids):], seq.tokens[len(ids):]))
        assert seq.cum_logprob == pytest.approx(model, abs=1e-3)
        assert len(seq.logprobs) == len(seq.tokens) - len(ids)
    question = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France? One word."}],
                                             tokenize=False, add_generation_prompt=True)
    (ranked,) = llm.beam_search({"prompt": question}, BeamSearchParams(beam_width=3, max_tokens=12))
    asked = len(tokenizer.encode(question))
    scores = [s.cum_logprob / (len(s.tokens) - asked) for s in ranked.sequences]  # (the end token counted)
    assert scores == sorted(scores, reverse=True)
    assert [s.finish_reason for s in ranked.sequences] == ["stop", "stop", "length"]  # (the first two: 8, 11 tokens)
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    (one,) = llm.beam_search(prompt, BeamSearchParams(beam_width=1, max_tokens=6))
    assert one.sequences[0].tokens[len(ids):] == greedy.token_ids  # one beam is greedy search
    assert llm.engine.block_manager.num_used_blocks == 0


def test_bad_beam_search_params_are_named():
    for fields, param in [(dict(beam_width=11, max_tokens=4), "beam_width"), (dict(beam_width=0, max_tokens=4), "beam_width"),
                          (dict(beam_width=2, max_tokens=0), "max_tokens"),
                          (dict(beam_width=2, max_tokens=4, length_penalty="x"), "length_penalty")]:
        with pytest.raises(InvalidParameterError) as exc:
            BeamSearchParams(**fields)
        assert exc.value.param == param


async def test_beam_search_over_http_gives_n_beams_per_prompt(tiny_vocab_core, tokenizer):
    body = {"prompt": ["Hi", "Once upon a time"], "max_tokens": 5, "n": 3, "use_beam_search": True,
            "return_token_ids": True, "ignore_eos": True}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        response = await server.http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        direct = [await server.client.beam_search(p, BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
                  for p in body["prompt"]]
        assert [c["index"] for c in choices] == list(range(6))
        assert [c["token_ids"] for c in choices] == [o.token_ids for d in direct for o in d.outputs]
        assert len({tuple(c["token_ids"]) for c in choices[:3]}) == 3  # three beams, not one thrice
        assert response.json()["usage"]["completion_tokens"] == 30
        chat = await server.http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4, "n": 2, "use_beam_search": True,
                                                                    "length_penalty": 0.5})
        assert chat.status_code == 200 and len(chat.json()["choices"]) == 2, chat.text
        assert server.client.stats().kv_blocks_used == 0


@pytest.mark.parametrize("body, param", [
    ({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"), ({"logprobs": 0}, "logprobs"),
    ({"logprobs": 0, "echo": True}, "logprobs"), ({"stop": ["x"]}, "stop"), ({"n": 11}, "n"),
    ({"top_p": 0.5}, "top_p"), ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
])
async def test_what_beam_search_does_not_use_is_refused_by_name(tiny_vocab_core, tokenizer, body, param):
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        response = await server.http.post("/v1/completions", json={"prompt": "Hi", "use_beam_search": True, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


async def test_a_beam_search_request_is_held_to_the_waiting_limit_as_a_whole(tiny_vocab_model, tokenizer):
    """Prompts x beams against max_waiting_requests, as prompts x n without beam search: a
    request that fits exactly runs; one that can never fit is a 400 naming n, not a 503 to retry."""
    body = {"prompt": ["Hi", "Yo"], "max_tokens": 3, "use_beam_search": True, "ignore_eos": True}
    async with serve_http(tiny_engine_core(tiny_vocab_model, max_waiting_requests=4), tokenizer) as server:
        response = await server.http.post("/v1/completions", json={**body, "n": 2})
        assert response.status_code == 200 and len(response.json()["choices"]) == 4, response.text
        response = await server.http.post("/v1/completions", json={**body, "n": 3})
        assert response.status_code == 400 and response.json()["error"]["param"] == "n", response.text
        assert server.client.num_waiting_sequences == 0 and server.client.stats().kv_blocks_used == 0


def _on_step(client, step: int, act) -> None:
    """Call ``act()`` when the search queues its ``step``-th step (counted from 1), just after."""
    real, calls = client.add_requests, 0

    async def add_requests(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == step:
            act("before")
        queued = await real(*args, **kwargs)
        if calls == step:
            act("after")
        return queued

    client.add_requests = add_requests


async def test_a_search_cancelled_mid_step_aborts_that_steps_requests(tiny_vocab_core, tokenizer):
    """Leaving (a disconnect, a deadline) cancels the search: the step in flight is aborted, and
    nothing is left queued or held."""
    async with Engine(tiny_vocab_core, tokenizer).serve() as client:
        aborted, real_abort = [], client.abort
        client.abort = lambda ids: (aborted.append(ids), real_abort(ids))[1]
        with trio.CancelScope() as scope:
            _on_step(client, 3, lambda when: when == "after" and scope.cancel())
            await client.beam_search("Hi", BeamSearchParams(beam_width=4, max_tokens=50, ignore_eos=True), request_id="s")
        assert scope.cancelled_caught
        assert sorted(aborted) == [f"s-2-{i}" for i in range(4)]  # the third step's four beams
        with trio.fail_after(10):
            await client.wait_idle()
        assert client.stats().kv_blocks_used == 0 and client.num_waiting_sequences == 0


async def test_a_running_search_holds_room_for_its_beams_between_steps(tiny_vocab_model, tokenizer):
    """max_waiting_requests counts a search's beams while it runs, not only while a step waits
    (between steps nothing of it waits: searches admitted then went past the limit at once),
    and counts them once while a step's requests are queued (they wait in the search's room)."""
    core = tiny_engine_core(tiny_vocab_model, max_waiting_requests=4)
    async with Engine(core, tokenizer).serve() as client:
        seen = []

        def at_step(when):
            seen.append(client.num_waiting_sequences)
            with pytest.raises(EngineOverloadedError):
                client.check_room(2)
            client.check_room(1)  # (room for one more: 3 + 1)

        _on_step(client, 3, at_step)
        await client.beam_search("Hi", BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
        assert seen == [3, 3] and client.num_waiting_sequences == 0
        with pytest.raises(InvalidParameterError) as exc:  # (more beams than the server ever queues)
            await client.beam_search("Hi", BeamSearchParams(beam_width=5, max_tokens=2))
        assert exc.value.param == "beam_width"
