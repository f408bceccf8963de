"""The HTTP app in-process (no model): 503 while loading or after an engine failure, and a
500 that carries no traceback."""

from __future__ import annotations

import random
import re
import time

import orjson

import pytest
import trio

from api.app import Limits, ServerState, _Handlers, create_app
from engine.errors import ConfigError, InvalidParameterError
from engine.sampling_params import SamplingParams
from tests.conftest import fail_logits_processing, serve_http, tiny_engine_core, until

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


class DeadClient:
    errored = True


class BrokenClient:
    """A client whose tokenizer blows up: an internal error, not the caller's."""

    errored = False
    max_model_len = 100

    @property
    def tokenizer(self):
        raise RuntimeError("secret internal detail")


async def post(state: ServerState, path: str, body: dict):
    app = create_app(state)
    async with app.test_app() as test_app:
        response = await test_app.test_client().post(path, data=orjson.dumps(body),
                                                     headers={"Content-Type": "application/json"})
        return response.status_code, await response.get_data()


def error(data: bytes) -> dict:
    body = orjson.loads(data)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_503_while_the_model_loads():
    status, data = await post(ServerState("m"), "/v1/chat/completions", CHAT)
    assert status == 503 and error(data)["code"] == "model_loading"
    status, _ = await post(ServerState("m"), "/v1/completions", {"prompt": "x"})
    assert status == 503


async def test_503_after_the_engine_died():
    status, data = await post(ServerState("m", client=DeadClient()), "/v1/chat/completions", CHAT)
    assert status == 503 and error(data)["code"] == "engine_dead"


async def test_500_hides_the_traceback():
    status, data = await post(ServerState("m", client=BrokenClient()), "/tokenize", {"prompt": "x"})
    assert status == 500
    assert error(data)["message"] == "internal server error"
    assert b"secret" not in data and b"Traceback" not in data


async def test_cors_headers_for_allowed_origins_only():
    app = create_app(ServerState("m", allowed_origins=("https://ok.example",)))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        allowed = await client.get("/version", headers={"Origin": "https://ok.example"})
        other = await client.get("/version", headers={"Origin": "https://evil.example"})
        preflight = await client.options("/v1/chat/completions", headers={"Origin": "https://ok.example"})
    assert allowed.headers["Access-Control-Allow-Origin"] == "https://ok.example"
    assert "Access-Control-Allow-Origin" not in other.headers
    assert preflight.status_code == 204 and "POST" in preflight.headers["Access-Control-Allow-Methods"]


# ---- the app over a real engine (the tiny random model) on a loopback port ----

TEXT_PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3,"]


def sse_data(lines: list[str]) -> list:
    return [line[6:] if line[6:] == "[DONE]" else orjson.loads(line[6:]) for line in lines if line.startswith("data: ")]


def metric(text: str, name: str, **labels) -> float:
    """The value of the series ``name`` whose labels include ``labels`` (and model_name="tiny")."""
    wanted = {"model_name": "tiny", **labels}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            series, value = line.rsplit(" ", 1)
            have = dict(pair.split("=", 1) for pair in series[len(name) + 1:-1].split(","))
            if all(have.get(k) == f'"{v}"' for k, v in wanted.items()):
                return float(value)
    raise AssertionError(f"{name}{wanted} missing from /metrics")


async def wait_idle(client, timeout: float = 10) -> None:
    with trio.fail_after(timeout):
        while client.stats().num_running or client.stats().num_waiting:
            await trio.sleep(0.01)


async def test_multi_prompt_stream_disconnect_aborts_every_prompt(tiny_vocab_core, tokenizer, monkeypatch):
    slow_steps(tiny_vocab_core, monkeypatch)  # 200 tokens take 4 s: they cannot finish before the disconnect
    body = {"prompt": TEXT_PROMPTS, "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        async with server.http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = 0
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
                if events == 6:
                    break
            assert server.client.stats().num_running == 3
        await wait_idle(server.client)  # leaving the block closed the connection mid-stream
        assert server.client.stats().kv_blocks_used == 0
        metrics = (await server.http.get("/metrics")).text
        assert metric(metrics, "vllm:request_success_total", finished_reason="abort") == 3
        assert metric(metrics, "vllm:e2e_request_latency_seconds_count") == 3


async def test_engine_failure_mid_stream_ends_with_an_error_event(tiny_vocab_core, tokenizer, monkeypatch):
    slow_steps(tiny_vocab_core, monkeypatch)
    fault = fail_when(tiny_vocab_core.runner, "execute")
    body = {"prompt": TEXT_PROMPTS, "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        lines = []
        with trio.fail_after(30):
            async with server.http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    lines.append(line)
                    if len(sse_data(lines)) == 4:
                        fault.set()  # the engine fails in the middle of the stream
        events = sse_data(lines)
        assert response.status_code == 200 and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "engine_dead" and all("choices" in e for e in events[:-2])
        assert (await server.http.get("/health")).status_code == 503
        assert tiny_vocab_core.stats().kv_blocks_used == 0


def fail_when(obj, method: str) -> trio.Event:
    """Make ``obj.method`` raise once the returned event is set (a fault injected at a known moment)."""
    event, real = trio.Event(), getattr(obj, method)

    def failing(*args):
        if event.is_set():
            raise RuntimeError("injected device fault")
        return real(*args)

    setattr(obj, method, failing)
    return event


async def test_a_request_failing_in_the_engine_is_a_500_and_the_server_goes_on(tiny_vocab_core, tokenizer,
                                                                               monkeypatch):
    fail_logits_processing(monkeypatch, lambda r: 13 in r.params.logit_bias,
                           "injected logits-processor fault in /secret/path.py")
    bad = {"prompt": "Hi", "max_tokens": 8, "logit_bias": {"13": 1.0}}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        response = await server.http.post("/v1/completions", json=bad)
        assert response.status_code == 500 and error(response.content)["code"] == "request_failed"
        assert b"secret" not in response.content
        streamed = await server.http.post("/v1/completions", json={**bad, "stream": True})
        events = sse_data(streamed.text.splitlines())
        assert events[-2]["error"]["code"] == "request_failed" and events[-1] == "[DONE]"
        good = await server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8, "ignore_eos": True})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8
        assert (await server.http.get("/health")).status_code == 200
        await wait_idle(server.client)
        assert server.client.stats().kv_blocks_used == 0
        metrics = (await server.http.get("/metrics")).text
        assert metric(metrics, "vllm:request_success_total", finished_reason="error") == 2


async def test_prompt_logprobs_are_returned_as_vllm_does(tiny_vocab_core, tokenizer):
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        ids = tokenizer.encode("one two three four")
        body = {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 2}
        choice = (await server.http.post("/v1/completions", json=body)).json()["choices"][0]
        positions = choice["prompt_logprobs"]
        assert len(positions) == len(ids) and positions[0] is None
        for token, position in zip(ids[1:], positions[1:]):
            assert str(token) in position and 2 <= len(position) <= 3
            assert {"logprob", "rank", "decoded_token"} == set(position[str(token)])
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0}
        reply = (await server.http.post("/v1/chat/completions", json=chat)).json()
        assert reply["prompt_logprobs"][0] is None and len(reply["prompt_logprobs"]) == reply["usage"]["prompt_tokens"]
        streamed = await server.http.post("/v1/completions", json={**body, "stream": True})
        assert streamed.status_code == 400 and error(streamed.content)["param"] == "prompt_logprobs"


def test_completion_top_logprobs_are_the_top_and_the_sampled_token_whatever_a_position_holds():
    """A position may hold more alternatives than asked (an echoed prompt's, by prompt_logprobs)."""
    from api.serving import completion_logprobs
    from engine.outputs import Logprob

    position = {7: Logprob(-0.1, 1, "a"), 8: Logprob(-1.0, 2, "b"), 9: Logprob(-2.0, 3, "c")}
    out = completion_logprobs([None, position, position], [5, 7, 9], 1, 0, decode=lambda ids: "xy")
    assert out["top_logprobs"] == [None, {"a": -0.1}, {"a": -0.1, "c": -2.0}]
    assert out["tokens"] == ["xy", "a", "c"] and out["text_offset"] == [0, 2, 3]
    assert out["token_logprobs"] == [None, -0.1, -2.0]


async def test_completion_top_logprobs_hold_the_sampled_token(tiny_vocab_core, tokenizer):
    """OpenAI: "the logprob of the sampled token, so there may be up to logprobs+1 elements"."""
    body = {"prompt": "Hi", "max_tokens": 12, "temperature": 50.0, "seed": 3, "ignore_eos": True}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        for top in (0, 1):
            for stream in (False, True):
                response = await server.http.post("/v1/completions", json={**body, "logprobs": top, "stream": stream})
                events = sse_data(response.text.splitlines())
                chunks = [e for e in events if e != "[DONE]"] if stream else [response.json()]
                logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
                tokens = [t for lp in logprobs for t in lp["tokens"]]
                tops = [entry for lp in logprobs for entry in lp["top_logprobs"]]
                assert len(tokens) == len(tops) == 12
                assert all(token in entry and 1 <= len(entry) <= top + 1 for token, entry in zip(tokens, tops))
                if top:  # (at so high a temperature the sampled token is seldom the most likely)
                    assert any(len(entry) == 2 for entry in tops)


@pytest.mark.parametrize("echo", [False, True])
async def test_streamed_text_offsets_are_the_whole_responses(tiny_vocab_core, tokenizer, echo):
    """text_offset: where each token's text starts in the choice's text (echoed, the prompt's
    tokens are scored too), the same streamed as at once: the tokens, their logprobs, offsets."""
    body = {"prompt": ["Hi there", "One two"], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "echo": echo}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        whole = (await server.http.post("/v1/completions", json=body)).json()["choices"]
        events = sse_data((await server.http.post("/v1/completions", json={**body, "stream": True})).text.splitlines())
    for choice in whole:
        logprobs, text = choice["logprobs"], choice["text"]
        assert logprobs["text_offset"][0] == (len(text) - len("".join(logprobs["tokens"])))
        for token, offset in zip(logprobs["tokens"], logprobs["text_offset"]):
            assert text[offset:offset + len(token)] == token
        streamed = [c for e in events if e != "[DONE]" for c in e["choices"] if c["index"] == choice["index"]]
        assert "".join(c["text"] for c in streamed) == text
        pieces = [c["logprobs"] for c in streamed if c["logprobs"]]
        def joined(field):
            return [v for lp in pieces for v in lp[field]]

        assert joined("tokens") == logprobs["tokens"] and joined("text_offset") == logprobs["text_offset"]
        assert joined("token_logprobs") == pytest.approx(logprobs["token_logprobs"], abs=1e-4)
        assert [top and list(top) for top in joined("top_logprobs")] == [top and list(top) for top in logprobs["top_logprobs"]]
        assert len(logprobs["tokens"]) == 6 + (len(tokenizer.encode(body["prompt"][choice["index"]])) if echo else 0)


async def test_echo_with_logprobs_scores_the_prompt_too(tiny_vocab_core, tokenizer):
    """OpenAI's legacy completions (and vLLM): echo with logprobs gives the prompt's tokens their
    logprobs as well, the first null (how lm-evaluation-harness scores a continuation). A
    character made of several tokens (the emoji's, the CJK one's) is the text of the token that
    completes it, the ones before "" (vLLM's): the tokens make the text, at their offsets."""
    prompt = "one two 😀 three 中文 four"
    ids = tokenizer.encode(prompt)
    assert sum(tokenizer.decode([t]).endswith("\ufffd") for t in ids) >= 2
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        echoed = (await server.http.post("/v1/completions", json={**body, "echo": True})).json()["choices"][0]
        plain = (await server.http.post("/v1/completions", json={**body, "prompt_logprobs": 1})).json()["choices"][0]
    logprobs = echoed["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 2 and echoed["text"] == body["prompt"] + plain["text"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    prompt_scores = [position[str(token)]["logprob"] for token, position in zip(ids[1:], plain["prompt_logprobs"][1:])]
    assert logprobs["token_logprobs"][1:len(ids)] == pytest.approx(prompt_scores)
    assert logprobs["token_logprobs"][len(ids):] == plain["logprobs"]["token_logprobs"]
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"]):
        assert echoed["text"][offset:offset + len(token)] == token
    assert "".join(logprobs["tokens"]) == echoed["text"]
    assert [p[str(t)]["decoded_token"] for t, p in zip(ids[1:], plain["prompt_logprobs"][1:])] == logprobs["tokens"][1:len(ids)]
    assert all(1 <= len(entry) <= 2 for entry in logprobs["top_logprobs"][1:])



async def test_an_echo_of_max_tokens_0_scores_the_prompt_and_generates_nothing(tiny_vocab_core, tokenizer):
    """OpenAI's legacy completions (and vLLM): echo with max_tokens 0 gives the prompt back with
    its logprobs and no generated token, streamed or not (lm-evaluation-harness's loglikelihood)."""
    ids = tokenizer.encode("one two three four")
    body = {"prompt": "one two three four", "max_tokens": 0, "echo": True, "logprobs": 1,
            "stop_token_ids": list(range(tokenizer.vocab_size))}  # (the token made, dropped, ends it as a stop)
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        scored = (await server.http.post("/v1/completions", json=body)).json()
        plain = (await server.http.post("/v1/completions", json={"prompt": body["prompt"], "max_tokens": 1,
                                                                 "prompt_logprobs": 1})).json()["choices"][0]
        streamed = await server.http.post("/v1/completions", json={**body, "stream": True, "n": 2,
                                                                   "stream_options": {"include_usage": True}})
        bare = (await server.http.post("/v1/completions", json={**body, "logprobs": None})).json()
        beams = await server.http.post("/v1/completions", json={**body, "logprobs": None, "use_beam_search": True})
        unechoed = await server.http.post("/v1/completions", json={**body, "echo": False})
    assert tiny_vocab_core.block_manager.num_used_blocks == 0
    [choice] = scored["choices"]
    assert choice["text"] == body["prompt"] and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        [position[str(token)]["logprob"] for token, position in zip(ids[1:], plain["prompt_logprobs"][1:])])
    assert (scored["usage"]["prompt_tokens"], scored["usage"]["completion_tokens"]) == (len(ids), 0)
    events = sse_data(streamed.text.splitlines())
    for index in (0, 1):
        chunks = [c for e in events[:-1] for c in e["choices"] if c["index"] == index]
        assert "".join(c["text"] for c in chunks) == body["prompt"]
        assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]
    assert events[-2]["usage"]["completion_tokens"] == 0 and events[-1] == "[DONE]"
    assert bare["choices"][0]["text"] == body["prompt"] and bare["choices"][0]["logprobs"] is None
    assert beams.status_code == 400 and beams.json()["error"]["param"] == "max_tokens"
    assert unechoed.status_code == 400 and unechoed.json()["error"]["param"] == "max_tokens"  # (nothing to give)

async def test_chat_echo_leads_with_the_final_assistant_message_in_either_content_form(tiny_vocab_core, tokenizer):
    """echo (vLLM's) with continue_final_message: the answer starts with the last assistant
    message's text, given as a string or as text parts, streamed or not."""
    said = "1,\n2,"  # (text parts are joined one per line, as vLLM joins them)
    forms = [said, [{"type": "text", "text": "1,"}, {"type": "text", "text": "2,"}]]
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        answers = []
        for content in forms:
            body = {"messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": content}],
                    "max_tokens": 3, "temperature": 0, "echo": True, "continue_final_message": True,
                    "add_generation_prompt": False}
            whole = (await server.http.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
            events = sse_data((await server.http.post("/v1/chat/completions", json={**body, "stream": True}))
                              .text.splitlines())
            deltas = [e["choices"][0]["delta"] for e in events if e != "[DONE]" and e["choices"]]
            assert deltas[0]["content"] == said and whole["content"].startswith(said)
            assert "".join(d.get("content") or "" for d in deltas) == whole["content"]
            answers.append(whole["content"])
        assert answers[0] == answers[1] and len(answers[0]) > len(said)


async def test_chat_template_kwargs_set_the_templates_switches_and_nothing_of_the_servers(tiny_vocab_core, tokenizer):
    """As vLLM: add_generation_prompt and continue_final_message in chat_template_kwargs override
    the request's fields (it was a 400 quoting a Python TypeError); arguments the server sets
    itself (tokenize, chat_template...) are a 400 naming chat_template_kwargs."""
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    base = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        async def usage_and_text(body):
            reply = await server.http.post("/v1/chat/completions", json={**base, **body})
            assert reply.status_code == 200, reply.text
            return reply.json()["usage"]["prompt_tokens"], reply.json()["choices"][0]["message"]["content"]

        for switches in ({"add_generation_prompt": False}, {"continue_final_message": True,
                                                             "add_generation_prompt": False}):
            assert await usage_and_text({"chat_template_kwargs": switches}) == await usage_and_text(switches)
        switched = {"chat_template_kwargs": {"add_generation_prompt": False}}
        without_generation_prompt = (await usage_and_text(switched))[0]
        assert without_generation_prompt != (await usage_and_text({}))[0]
        for kwargs in ({"tokenize": True}, {"chat_template": "{{ 1 }}"}, {"messages": []},
                       {"add_generation_prompt": "no"}, {"sanitize_control_tokens": False}):
            refused = await server.http.post("/v1/chat/completions", json={**base, "chat_template_kwargs": kwargs})
            assert refused.status_code == 400 and error(refused.content)["param"] == "chat_template_kwargs"
            assert "TypeError" not in refused.text and "()" not in error(refused.content)["message"]
    # the server's default kwargs may set a switch too (--default-chat-template-kwargs)
    async with serve_http(tiny_vocab_core, tokenizer,
                          default_chat_template_kwargs={"add_generation_prompt": False}) as server:
        reply = await server.http.post("/v1/chat/completions", json=base)
        assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == without_generation_prompt


# Shows each message's role, reasoning and content, and a variable of chat_template_kwargs.
SHOWING_TEMPLATE = ("{% for m in messages %}[{{ m.role }}|{{ m.reasoning_content or '' }}|{{ m.content }}]"
                    "{% endfor %}{% if add_generation_prompt %}[assistant|{% endif %}{{ flavour or '' }}")


async def test_messages_reach_the_template_as_vllm_gives_them_in_chat_and_tokenize(tiny_vocab_core, tokenizer):
    """Text parts one per line, developer as system, an earlier turn's reasoning (under its name
    in responses, or reasoning_content); /tokenize renders messages with every option a chat
    completion takes (continue_final_message, chat_template_kwargs), to the same tokens."""
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes", "reasoning": "hmm"},
                {"role": "user", "content": "Go"}, {"role": "assistant", "content": "Gone", "reasoning_content": "ok"}]
    async with serve_http(tiny_vocab_core, tokenizer, chat_template=SHOWING_TEMPLATE) as server:
        for options, text in [
                ({"chat_template_kwargs": {"flavour": "!"}},
                 "[system||Be\nbrief.][user||Hi][assistant|hmm|Yes][user||Go][assistant|ok|Gone][assistant|!"),
                ({"continue_final_message": True, "add_generation_prompt": False},
                 "[system||Be\nbrief.][user||Hi][assistant|hmm|Yes][user||Go][assistant|ok|Gone")]:
            reply = await server.http.post("/tokenize", json={"messages": messages, "return_token_strs": True,
                                                              **options})
            assert reply.status_code == 200, reply.text
            tokens = reply.json()["tokens"]
            assert tokenizer.decode(tokens) == text
            assert reply.json()["token_strs"] == tokenizer.convert_ids_to_tokens(tokens)
            chat = await server.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                                        **options})
            assert chat.json()["usage"]["prompt_tokens"] == len(tokens)



# Lists the tools it is given, then the messages.
LISTING_TEMPLATE = ("{% for t in tools or [] %}<{{ t.function.name }}>{% endfor %}"
                    "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}")


@pytest.mark.parametrize("exclude", [False, True])
async def test_tool_choice_none_renders_the_tools_unless_the_server_excludes_them(tiny_vocab_core, tokenizer,
                                                                                  exclude):
    """As vLLM: with tool_choice none the template still gets the tools (the model knows them,
    is not asked to call one), unless --exclude-tools-when-tool-choice-none; no call is read."""
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
    body = {"messages": [{"role": "user", "content": "Go"}], "tools": [tool], "tool_choice": "none",
            "max_tokens": 1}
    async with serve_http(tiny_vocab_core, tokenizer, chat_template=LISTING_TEMPLATE,
                          exclude_tools_when_tool_choice_none=exclude) as server:
        reply = await server.http.post("/v1/chat/completions", json=body)
        bare = await server.http.post("/v1/chat/completions", json={**body, "tools": None, "tool_choice": None})
    rendered = "[user|Go]" if exclude else "<lookup>[user|Go]"
    assert reply.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert bare.json()["usage"]["prompt_tokens"] == len(tokenizer.encode("[user|Go]", add_special_tokens=False))
    assert reply.json()["choices"][0]["message"].get("tool_calls") in (None, [])

async def test_a_request_s_chat_template_is_refused_unless_the_server_trusts_them(tiny_vocab_core, tokenizer):
    """vLLM's request field chat_template: a 400 naming it (it was dropped in silence: the reply
    rendered with another template), used with --trust-request-chat-template; a template that
    fails is a 400 naming it."""
    body = {"messages": [{"role": "user", "content": "Go"}], "chat_template": "{{ messages[0].content }}!"}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        for path, extra in [("/v1/chat/completions", {"max_tokens": 1}), ("/tokenize", {})]:
            refused = await server.http.post(path, json={**body, **extra})
            assert refused.status_code == 400 and error(refused.content)["param"] == "chat_template"
            assert "--trust-request-chat-template" in error(refused.content)["message"]
    async with serve_http(tiny_vocab_core, tokenizer, trust_request_chat_template=True) as server:
        reply = await server.http.post("/tokenize", json=body)
        assert tokenizer.decode(reply.json()["tokens"]) == "Go!"
        chat = await server.http.post("/v1/chat/completions", json={**body, "max_tokens": 1})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == reply.json()["count"]
        for failing in ("{{ raise_exception('no') }}", "{{ 1 / 0 }}"):
            reply = await server.http.post("/tokenize", json={**body, "chat_template": failing})
            assert reply.status_code == 400 and error(reply.content)["param"] == "chat_template", reply.text


async def test_a_long_detokenize_is_checked_and_decoded_in_a_worker_thread(tiny_vocab_core, tokenizer, monkeypatch):
    from api import app as app_module

    calls = []
    real = app_module.trio.to_thread.run_sync

    def run_sync(fn, *args, **kwargs):
        if fn.__name__ == "decode":
            calls.append(fn)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(app_module.trio.to_thread, "run_sync", run_sync)
    ids = tokenizer.encode("Hello world, and more. ") * 1000
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        reply = await server.http.post("/detokenize", json={"tokens": ids})
        assert reply.json()["prompt"] == tokenizer.decode(ids) and len(calls) == 1
        bad = await server.http.post("/detokenize", json={"tokens": [*ids, 10**6]})
        assert bad.status_code == 400 and error(bad.content)["param"] == "tokens" and len(calls) == 2
        short = await server.http.post("/detokenize", json={"tokens": ids[:5]})
        assert short.json()["prompt"] == tokenizer.decode(ids[:5]) and len(calls) == 2  # (on the loop)


async def test_cached_tokens_of_a_multi_prompt_completion_are_summed(tiny_vocab_core, tokenizer):
    prompts = [[100] * 40, [300 + i for i in range(40)]]  # two full blocks each can hit
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        for p in prompts:
            await server.http.post("/v1/completions", json={"prompt": p, "max_tokens": 1})
        both = (await server.http.post("/v1/completions", json={"prompt": prompts, "max_tokens": 1})).json()
        assert both["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


async def test_cache_config_info_says_what_the_kv_cache_is(tiny_vocab_model, tokenizer):
    """vLLM's ``vllm:cache_config_info``: value 1, the cache's configuration in its labels, with the
    dtype as resolved (auto names none) and the bytes a token takes (2 layers x K and V x 2 heads x
    16 elements x 2 bytes in bfloat16)."""
    def info(text: str) -> list[dict[str, str]]:
        head = "vllm:cache_config_info{"
        series = [line for line in text.splitlines() if line.startswith(head)]
        assert all(line.endswith("} 1.0") for line in series), series
        labels = [[pair.split("=", 1) for pair in line[len(head):line.rindex("}")].split(",")] for line in series]
        return [{k: v.strip('"') for k, v in pairs} for pairs in labels]

    core = tiny_engine_core(tiny_vocab_model, kv_cache_dtype="bfloat16", block_size=8, num_kv_blocks=48)
    async with serve_http(core, tokenizer) as server:
        assert info((await server.http.get("/metrics")).text) == [{
            "engine": "0", "num_gpu_blocks": "48", "block_size": "8", "cache_dtype": "bfloat16",
            "enable_prefix_caching": "True", "sliding_window": "None", "kv_bytes_per_token": "256"}]
    core = tiny_engine_core(tiny_vocab_model, enable_prefix_caching=False)  # (auto: float32 on the torch backend)
    async with serve_http(core, tokenizer) as server:
        assert info((await server.http.get("/metrics")).text) == [{
            "engine": "0", "num_gpu_blocks": "64", "block_size": "16", "cache_dtype": "float32",
            "enable_prefix_caching": "False", "sliding_window": "None", "kv_bytes_per_token": "512"}]


def test_each_engines_cache_is_its_own_series():
    """Data parallel: each engine says its own cache (a headless one started apart may differ)."""
    from api.app import _EMPTY_STATS
    from api.metrics import Metrics
    from engine.messages import KVCacheInfo

    caches = [KVCacheInfo(16, 100, "int8", 11520, True, None), KVCacheInfo(32, 50, "float16", 23040, False, 4096)]
    text = Metrics(lambda: [_EMPTY_STATS] * 2, "m", lambda: caches).exposition().decode()
    series = sorted(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert len(series) == 2
    assert 'engine="0"' in series[0] and 'cache_dtype="int8"' in series[0] and 'num_gpu_blocks="100"' in series[0]
    assert 'engine="1"' in series[1] and 'block_size="32"' in series[1] and 'sliding_window="4096"' in series[1]
    assert "vllm:cache_config_info" not in Metrics(lambda: [_EMPTY_STATS], "m").exposition().decode()  # (loading)


async def test_each_of_n_completions_counts_as_a_request_in_the_metrics(tiny_vocab_core, tokenizer):
    """As vLLM's child requests: successes, latencies and token histograms count each
    completion, so they agree with each other; n and the longest completion count the request."""
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        response = await server.http.post("/v1/completions", json={"prompt": "Hi there", "n": 3, "max_tokens": 4,
                                                                  "ignore_eos": True, "temperature": 0})
        after = (await server.http.get("/metrics")).text
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    assert metric(after, "vllm:request_success_total", finished_reason="length") == 3
    for name in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_decode_time_seconds"):
        assert metric(after, f"{name}_count") == 3, name
    assert metric(after, "vllm:inter_token_latency_seconds_count") == 9  # (3 gaps each)
    # (the prompt once in the usage, as OpenAI counts it; once a sequence in the engine, as vLLM)
    assert metric(after, "vllm:request_prompt_tokens_sum") == metric(after, "vllm:prompt_tokens_total") \
        == 3 * prompt_tokens
    assert metric(after, "vllm:request_generation_tokens_sum") == 12
    assert metric(after, "vllm:request_params_n_sum") == 3 and metric(after, "vllm:request_params_n_count") == 1
    assert metric(after, "vllm:request_max_num_generation_tokens_sum") == 4


async def test_a_long_text_with_a_truncation_that_cuts_nothing_is_never_tokenized(tiny_vocab_core, tokenizer,
                                                                                  monkeypatch):
    """truncate_prompt_tokens lets a text of any length in only where it cuts (-1, or 1 to
    max_model_len): an invalid one is refused before the text is rendered or tokenized."""
    longest = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **kw: (longest.append(len(text)), encode(text, *a, **kw))[1])
    text = "word " * 200_000
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        max_model_len = server.client.max_model_len
        for keep in (0, -2, max_model_len + 1):
            for route, body in (("/v1/completions", {"prompt": text}),
                                ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})):
                refused = await server.http.post(route, json={**body, "truncate_prompt_tokens": keep, "max_tokens": 1})
                assert refused.status_code == 400, refused.text
        assert max(longest, default=0) < 1000
        kept = await server.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}],
                                                                   "truncate_prompt_tokens": 4, "max_tokens": 1})
    assert kept.json()["usage"]["prompt_tokens"] == 4 and max(longest) > len(text)  # (the spy sees them)

async def test_latency_metrics_exist_at_start_and_count_non_streamed_requests(tiny_vocab_core, tokenizer):
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        before = (await server.http.get("/metrics")).text
        histograms = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                      "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                      "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                      "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                      "vllm:request_max_num_generation_tokens", "vllm:request_params_n")  # (vLLM's dashboard's names)
        for name in histograms:
            assert metric(before, f"{name}_count") == 0 and f"{name}_bucket{{" in before
        for reason in ("stop", "length", "abort", "error"):
            assert metric(before, "vllm:request_success_total", finished_reason=reason) == 0
        prompt = " ".join(["once upon a time"] * 12)  # (48 tokens: the second request finds 2 blocks cached)
        response = await server.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "ignore_eos": True})
        again = await server.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        after = (await server.http.get("/metrics")).text
    assert metric(after, "vllm:time_to_first_token_seconds_count") == 2
    assert metric(after, "vllm:inter_token_latency_seconds_count") == 7  # non-streamed, yet every gap
    assert metric(after, "vllm:time_per_output_token_seconds_count") == 7
    assert metric(after, "vllm:request_success_total", finished_reason="length") == 2
    assert metric(after, "vllm:time_to_first_token_seconds_sum") < metric(after, "vllm:e2e_request_latency_seconds_sum")
    assert metric(after, "vllm:request_generation_tokens_sum") == 9
    assert metric(after, "vllm:request_max_num_generation_tokens_sum") == 9
    assert metric(after, "vllm:request_params_n_sum") == 2
    prompts = response.json()["usage"]["prompt_tokens"] + again.json()["usage"]["prompt_tokens"]
    assert metric(after, "vllm:request_prompt_tokens_sum") == prompts
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert metric(after, "vllm:prompt_tokens_total") == prompts  # (cached or computed, as vLLM counts them)
    assert metric(after, "vllm:request_prefill_time_seconds_count") == 2
    assert 0 < metric(after, "vllm:request_decode_time_seconds_sum") < metric(after, "vllm:e2e_request_latency_seconds_sum")
    assert 'le="7680.0"' in after and 'le="2560.0"' in after  # (vLLM's buckets)


async def test_special_tokens_in_the_text_are_joined_without_spaces_as_asked_or_not(tiny_vocab_core, tokenizer):
    """spaces_between_special_tokens false is what this server's (fast) tokenizers always give,
    so it is honoured, not refused; true, the default, gives the same (as vLLM's fast path)."""
    body = {"prompt": "Hi", "max_tokens": 6, "allowed_token_ids": [1, 3], "skip_special_tokens": False,
            "return_token_ids": True}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        texts = []
        for spaces in (False, True):
            response = await server.http.post("/v1/completions", json={**body, "spaces_between_special_tokens": spaces})
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            assert choice["text"] == "".join(tokenizer.decode([t]) for t in choice["token_ids"])
            texts.append(choice["text"])
    assert texts[0].startswith("<|") and " " not in texts[0] and len(texts) == 2


async def test_best_of_below_n_is_a_bad_value_above_it_unsupported(tiny_vocab_core, tokenizer):
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        below = await server.http.post("/v1/completions", json={"prompt": "Hi", "n": 2, "best_of": 1})
        above = await server.http.post("/v1/completions", json={"prompt": "Hi", "n": 1, "best_of": 2})
    assert below.status_code == above.status_code == 400
    assert error(below.content) | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                      "param": "best_of", "code": "bad_request"}
    assert "best_of must be at least n (2); got 1" in error(below.content)["message"]
    assert error(above.content)["code"] == "unsupported_parameter"


async def test_add_special_tokens_is_honoured_with_vllms_defaults(tiny_vocab_core, tokenizer):
    """With a tokenizer that adds a BOS (as Llama's): a text prompt has it unless
    add_special_tokens is false, a chat only what its template writes unless it is true; and
    /tokenize counts them alike (it ignored the flag for messages, completions did for prompts)."""
    import copy

    from tokenizers import processors

    bos = copy.deepcopy(tokenizer)
    bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", 0)])
    hello = tokenizer.encode("Hello")
    async with serve_http(tiny_vocab_core, bos) as server:
        async def ids(path: str, body: dict, **flag) -> list[int]:
            response = await server.http.post(path, json={**body, **flag})
            assert response.status_code == 200, response.text
            data = response.json()
            return data["tokens"] if path == "/tokenize" else data.get("prompt_token_ids") or data["choices"][0][
                "prompt_token_ids"]

        prompt = {"prompt": "Hello", "max_tokens": 1, "return_token_ids": True}
        assert await ids("/v1/completions", prompt) == [0, *hello]
        assert await ids("/v1/completions", prompt, add_special_tokens=False) == hello
        assert await ids("/tokenize", {"prompt": "Hello"}) == [0, *hello]
        assert await ids("/tokenize", {"prompt": "Hello"}, add_special_tokens=False) == hello
        chat = await ids("/v1/chat/completions", {**CHAT, "max_tokens": 1, "return_token_ids": True})
        assert chat[0] != 0 and await ids("/tokenize", CHAT) == chat
        assert await ids("/v1/chat/completions", {**CHAT, "max_tokens": 1, "return_token_ids": True},
                         add_special_tokens=True) == [0, *chat]
        assert await ids("/tokenize", CHAT, add_special_tokens=True) == [0, *chat]
        # truncated, a text keeps its BOS in front (as a tokenizer's own truncation): Llama's read
        # without one; ids the caller gave are cut as given
        words = tokenizer.encode(" one two three four five six")
        assert await ids("/v1/completions", {**prompt, "prompt": " one two three four five six",
                                             "truncate_prompt_tokens": 3}) == [0, *words[-2:]]
        given = {**prompt, "prompt": [0, *words], "truncate_prompt_tokens": 3}
        assert await ids("/v1/completions", given) == words[-3:]
        assert await ids("/v1/completions", {**prompt, "prompt": " one two three four five six",
                                             "truncate_prompt_tokens": 3}, add_special_tokens=False) == words[-3:]


async def test_documents_reach_the_chat_template(tiny_vocab_core, tokenizer):
    """vLLM's documents (RAG templates: Command-R, Granite) are the template's ``documents``."""
    template = ("{% for d in documents %}DOC {{ d.title }}: {{ d.text }}\n{% endfor %}"
                "{% for m in messages %}{{ m.content }}\n{% endfor %}")
    documents = [{"title": "t", "text": "The secret is 42"}]
    async with serve_http(tiny_vocab_core, tokenizer, trust_request_chat_template=True) as server:
        response = await server.http.post("/tokenize", json={**CHAT, "chat_template": template, "documents": documents})
        assert response.status_code == 200, response.text
        assert tokenizer.decode(response.json()["tokens"]) == "DOC t: The secret is 42\nhi\n"
        chat = await server.http.post("/v1/chat/completions", json={
            **CHAT, "chat_template": template, "documents": documents, "max_tokens": 1, "return_token_ids": True})
        assert chat.status_code == 200 and chat.json()["prompt_token_ids"] == response.json()["tokens"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "n": 2, "seed": 18446744073709551615}, "seed"),
    ("/v1/completions", {"prompt": "Hi", "seed": -(2**63) - 1}, "seed"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**6}, "max_completion_tokens"),  # past the context
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "Hi", "priority": 1}, "priority"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "Hi", "stream": True, "stream_options": "yes"}, "stream_options"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": [True]}, "stream_options"),
    ("/v1/completions", {"prompt": "Hi", "length_penalty": 0.5}, "length_penalty"),  # (without use_beam_search)
    ("/v1/chat/completions", {**CHAT, "logits_processors": ["x"]}, "logits_processors"),  # (not honoured: never ignored)
    ("/v1/chat/completions", {**CHAT, "use_beam_search": True, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ("/v1/completions", {"prompt": "Hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/chat/completions", {**CHAT, "allowed_token_ids": [10**7]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "allowed_token_ids": [2], "min_tokens": 2}, "allowed_token_ids"),  # (2: EOS)
    ("/v1/chat/completions", {**CHAT, "bad_words": ["w"] * 129}, "bad_words"),
    ("/v1/chat/completions", {**CHAT, "bad_words": "apple"}, "bad_words"),  # (a string is not a list of
    ("/v1/chat/completions", {**CHAT, "guided_choice": "yes"}, "guided_choice"),  # its letters)
    ("/v1/completions", {"prompt": "Hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {**CHAT, "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {**CHAT, "return_tokens_as_token_ids": 3}, "return_tokens_as_token_ids"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "prompt_logprobs": 0}, "prompt_logprobs"),  # (never streamed)
    ("/v1/completions", {"prompt": "Hi", "stream": True, "prompt_logprobs": 0}, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {**CHAT, "modalities": ["text", "image"]}, "modalities"),
])
async def test_accepted_means_honoured_else_400(tiny_vocab_core, tokenizer, path, body, param):
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        response = await server.http.post(path, json=body)
        assert response.status_code == 400, response.text
        assert error(response.content)["param"] == param
        ok = await server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/chat/completions", {**CHAT, "reasoning_effort": "bogus"}, "reasoning_effort",
     "reasoning_effort must be one of none, minimal, low, medium, high"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format", "needs a name"),
    ("/v1/chat/completions", {**CHAT, "guided_json": {"type": "object"}, "guided_whitespace_pattern": " "},
     "guided_whitespace_pattern", "guided_whitespace_pattern"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"structural_tag": {
        "type": "structural_tag", "format": {"type": "bogus"}}}}, "structured_outputs", "Format type not recognized"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be"),
    ("/v1/responses", {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "n", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}}}, "text", "invalid json"),
])
async def test_an_error_names_the_field_in_the_words_of_the_request(tiny_vocab_core, tokenizer, path, body, param,
                                                                     words):
    """The message names the field the request sent (a Responses request's, not the chat field it
    is served by) and says what is wrong in words, not in a library's internals."""
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        response = await server.http.post(path, json=body)
        assert response.status_code == 400, response.text
        err = error(response.content)
        assert err["param"] == param and words in err["message"], err
        assert "Check failed" not in err["message"] and "max_completion_tokens" not in err["message"], err
        assert path != "/v1/responses" or "response_format" not in err["message"], err


async def test_allowed_token_ids_and_bad_words_reach_the_sampler(tiny_vocab_core, tokenizer):
    """vLLM's two restrictions, whatever the (random) model would write: only the allowed ids
    come out, and a bad word's token never does."""
    x, y = tokenizer.encode(" yes no", add_special_tokens=False)
    body = {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        only_x = await server.http.post("/v1/completions", json={**body, "allowed_token_ids": [x]})
        assert only_x.status_code == 200, only_x.text
        assert only_x.json()["choices"][0]["text"] == " yes" * 4
        chat = await server.http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4, "ignore_eos": True,
                                                                    "allowed_token_ids": [x, y], "bad_words": ["yes"]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"] == " no" * 4


async def test_restrictions_a_grammar_leaves_nothing_to_sample_under_are_a_400(tiny_vocab_core, tokenizer):
    """allowed_token_ids that a JSON grammar never allows: only sampling finds that out, and it
    is still the request's parameters at fault: a 400 naming the field (an error event once
    streaming), not a 500; the server goes on."""
    (word,) = tokenizer.encode(" hello", add_special_tokens=False)
    body = {**CHAT, "max_tokens": 4, "allowed_token_ids": [word], "response_format": {"type": "json_object"}}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        whole = await server.http.post("/v1/chat/completions", json=body)
        assert whole.status_code == 400, whole.text
        assert error(whole.content)["param"] == "allowed_token_ids"
        assert "no token is left to sample" in error(whole.content)["message"]
        streamed = await server.http.post("/v1/chat/completions", json={**body, "stream": True})
        (event,) = [e for e in sse_data(streamed.text.splitlines()) if e != "[DONE]" and "error" in e]
        assert event["error"]["type"] == "invalid_request_error" and event["error"]["param"] == "allowed_token_ids"
        ok = await server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200 and server.client.stats().kv_blocks_used == 0


async def test_truncate_prompt_tokens_keeps_the_prompts_end(tiny_vocab_core, tokenizer):
    prompt = "one two three four five six seven eight"
    ids = tokenizer.encode(prompt)
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        text = await server.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "echo": True,
                                                               "truncate_prompt_tokens": 3})
        assert text.status_code == 200, text.text
        assert text.json()["usage"]["prompt_tokens"] == 3
        assert text.json()["choices"][0]["text"].startswith(" six seven eight")  # (the echo: what the model read)
        chat = await server.http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, "truncate_prompt_tokens": 2})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == 2
        whole = await server.http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": -1})
        assert whole.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_token_ids_come_back_when_asked(tiny_vocab_core, tokenizer, path):
    """vLLM's return_token_ids (the prompt's ids once, each choice's output ids) and
    return_tokens_as_token_ids (logprobs name tokens "token_id:N"), whole and streamed."""
    chat = path.endswith("chat/completions")
    body = {**(CHAT if chat else {"prompt": "Hi there"}), "max_tokens": 6, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True, "logprobs": True if chat else 2}
    body |= {"top_logprobs": 2} if chat else {}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        prompt_ids = (await server.http.post("/tokenize", json=CHAT if chat else {"prompt": "Hi there"})).json()
        whole = (await server.http.post(path, json=body)).json()
        async with server.http.stream("POST", path, json={**body, "stream": True}) as response:
            events = sse_data([line async for line in response.aiter_lines()])[:-1]
    (choice,) = whole["choices"]
    ids = choice["token_ids"]
    assert len(ids) == 6 and (whole if chat else choice)["prompt_token_ids"] == prompt_ids["tokens"]
    if chat:
        named = [entry["token"] for entry in choice["logprobs"]["content"]]
        assert [bytes(entry["bytes"]) for entry in choice["logprobs"]["content"]] == \
            [tokenizer.decode([t]).encode() for t in ids]  # (the text's bytes, as vLLM)
        alternatives = [t["token"] for entry in choice["logprobs"]["content"] for t in entry["top_logprobs"]]
    else:
        named = choice["logprobs"]["tokens"]
        alternatives = [t for top in choice["logprobs"]["top_logprobs"] for t in top]
    assert named == [f"token_id:{t}" for t in ids]
    assert alternatives and all(re.fullmatch(r"token_id:\d+", t) for t in alternatives)
    streamed = [c for e in events for c in e["choices"]]
    assert [t for c in streamed for t in c.get("token_ids", [])] == ids
    prompts = [e["prompt_token_ids"] for e in events if "prompt_token_ids" in e] + \
              [c["prompt_token_ids"] for c in streamed if "prompt_token_ids" in c]
    assert prompts == [prompt_ids["tokens"]]  # (once: the first chunk)


async def test_an_assistants_refusal_part_reads_as_its_text(tiny_vocab_core, tokenizer):
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        def conversation(answer):
            return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer},
                                 {"role": "user", "content": "why?"}]}

        as_text = await server.http.post("/tokenize", json=conversation("I cannot help."))
        as_part = await server.http.post("/tokenize", json=conversation([{"type": "refusal",
                                                                         "refusal": "I cannot help."}]))
        assert as_part.status_code == 200, as_part.text
        assert as_part.json()["tokens"] == as_text.json()["tokens"]
        chat = await server.http.post("/v1/chat/completions", json={**conversation([{"type": "refusal",
                                                                                    "refusal": "No."}]),
                                                                    "max_tokens": 2})
        assert chat.status_code == 200, chat.text


async def test_connections_close_when_asked_and_when_idle(tiny_vocab_core, tokenizer):
    """hypercorn under quart-trio left every connection open (api/connections.py): an HTTP/1.0
    stream, which ends only at the close, hung after [DONE]; ``Connection: close`` was ignored;
    idle keep-alive connections were never timed out."""
    async with serve_http(tiny_vocab_core, tokenizer, keep_alive_timeout=1) as server:
        host, port = str(server.http.base_url.host), server.http.base_url.port

        async def exchange(request: bytes) -> tuple[bytes, float]:
            """The whole answer up to the server's close, and the seconds that took."""
            start, answer = time.monotonic(), b""
            with trio.fail_after(5):
                stream = await trio.open_tcp_stream(host, port)
                await stream.send_all(request)
                while chunk := await stream.receive_some():
                    answer += chunk
            return answer, time.monotonic() - start

        body = b'{"prompt": "hi", "max_tokens": 3, "stream": true}'
        streamed, _ = await exchange(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert streamed.startswith(b"HTTP/1.1 200") and streamed.rstrip().endswith(b"data: [DONE]"), streamed
        closed, _ = await exchange(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert closed.startswith(b"HTTP/1.1 200"), closed
        idle, seconds = await exchange(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # (closed within 5 s)
        assert idle.startswith(b"HTTP/1.1 200") and seconds > 0.9, (idle, seconds)  # kept open until idle 1 s


async def test_null_is_the_default_for_the_fields_openai_marks_nullable(tiny_vocab_core, tokenizer):
    """JS SDKs and proxies send every field, unset ones as null: OpenAI's schema marks n, stream,
    logprobs, echo, the penalties and parallel_tool_calls nullable, and a null means the default."""
    nulls = dict.fromkeys(["n", "presence_penalty", "frequency_penalty", "stream", "stream_options", "seed"])
    bodies = {"/v1/chat/completions": {**CHAT, **nulls, "logprobs": None, "parallel_tool_calls": None},
              "/v1/completions": {"prompt": "Hi", **nulls, "echo": None, "logprobs": None},
              "/v1/responses": {"input": "Hi", "stream": None, "parallel_tool_calls": None}}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        for path, body in bodies.items():
            body = {**body, ("max_output_tokens" if "responses" in path else "max_tokens"): 2, "temperature": 0}
            with_nulls = await server.http.post(path, json=body)
            assert with_nulls.status_code == 200, (path, with_nulls.text)
            without = (await server.http.post(path, json={k: v for k, v in body.items() if v is not None})).json()
            reply = with_nulls.json()
            if "choices" in reply:
                assert len(reply["choices"]) == 1 and reply["choices"][0].get("logprobs") is None
                assert reply["choices"][0].get("text", reply["choices"][0].get("message")) == \
                    without["choices"][0].get("text", without["choices"][0].get("message"))
            else:
                assert reply["output"] == without["output"] or reply["output_text"] == without["output_text"]
        missing = await server.http.post("/v1/chat/completions", json={"messages": None, "max_tokens": 2})
        assert missing.status_code == 400 and error(missing.content)["param"] == "messages"


# ---- overload, deadlines, slow clients, faults ----

def slow_steps(core, monkeypatch, seconds: float = 0.02) -> None:
    """Make every engine step take at least ``seconds`` (a model slow enough to queue behind)."""
    real = core.runner.execute

    def slow(*args):
        time.sleep(seconds)
        return real(*args)

    monkeypatch.setattr(core.runner, "execute", slow)


async def stream_forever(server, body: dict) -> None:
    """A streamed completion read to its end (a task that holds a place in the engine)."""
    async with server.http.stream("POST", "/v1/completions", json={"max_tokens": 200, "ignore_eos": True,
                                                                    "stream": True, **body}) as response:
        assert response.status_code == 200
        async for _ in response.aiter_lines():
            pass


async def test_overload_is_a_503_with_retry_after_at_once(tiny_vocab_model, tokenizer, monkeypatch):
    core = tiny_engine_core(tiny_vocab_model, max_num_seqs=1, max_waiting_requests=3)
    slow_steps(core, monkeypatch, 0.05)  # (200 tokens: 10 s, so the streams outlive the refusals)
    async with serve_http(core, tokenizer) as server, trio.open_nursery() as nursery:
        client = server.client
        nursery.start_soon(stream_forever, server, {"prompt": "Hi"})
        await until(lambda: client.num_unfinished == 1 and client.num_waiting_sequences == 0)  # it runs
        for _ in range(3):
            nursery.start_soon(stream_forever, server, {"prompt": "Hi"})
        await until(lambda: client.num_waiting_sequences == 3)  # and three wait behind it
        refused = await server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert error(refused.content)["code"] == "overloaded"
        assert client.num_unfinished == 4  # refused before anything was queued, while the four still run
        nursery.cancel_scope.cancel()


async def test_a_burst_of_streams_past_the_limit_gets_503s_not_200s_that_fail(tiny_vocab_model, tokenizer,
                                                                               monkeypatch):
    """Streams arriving together, past the waiting limit: each is queued, or refused with a 503,
    before its status line. (The check and the queueing were apart: every stream passed the
    check before any was queued, and most got a 200 whose only event was 'overloaded'.)"""
    core = tiny_engine_core(tiny_vocab_model, max_num_seqs=1, max_waiting_requests=3)
    slow_steps(core, monkeypatch, 0.05)  # (200 tokens: 10 s, so the streams outlive the refusals)
    answers = []
    # Whether each stream's requests were in the engine when its response (status line) was made:
    # the order of events that makes the 503 certain, however the tasks interleave.
    queued_before_the_status_line = []
    real_sse_response = _Handlers.sse_response

    def sse_response(chunks, closes, error_event=None):
        queued_before_the_status_line.append(server.client.num_unfinished > 0)
        return real_sse_response(chunks, closes, error_event)

    monkeypatch.setattr(_Handlers, "sse_response", staticmethod(sse_response))

    all_answered = trio.Event()

    async def one(path: str, body: dict, prompts: int) -> None:
        # Each stream stays open, unread, until every one has its status: a stream that ended (or
        # was dropped) early would make room for another.
        async with server.http.stream("POST", path, json={**body, "max_tokens": 200, "ignore_eos": True,
                                                          "stream": True}) as response:
            answers.append((response.status_code, response.headers.get("Retry-After"), prompts))
            if len(answers) == 12:
                all_answered.set()
            await trio.sleep_forever()

    async with serve_http(core, tokenizer) as server:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(12):
                    path, body, prompts = [("/v1/completions", {"prompt": "Hi"}, 1), ("/v1/chat/completions", CHAT, 1),
                                           ("/v1/completions", {"prompt": ["a", "b"]}, 2)][i % 3]
                    nursery.start_soon(one, path, body, prompts)
                await all_answered.wait()
                # Every 200 holds its requests in the engine (none is a stream whose only event
                # will be 'overloaded'); the first of them runs for 10 s, so none has ended yet.
                admitted = sum(prompts for status, _, prompts in answers if status == 200)
                assert server.client.num_unfinished == admitted, answers
                nursery.cancel_scope.cancel()
    statuses = [status for status, _, _ in answers]
    assert 1 <= statuses.count(200) <= 4 and statuses.count(503) >= 8, answers  # 4 sequences: 1 runs, 3 wait
    assert all((status, retry_after) in ((503, "1"), (200, None)) for status, retry_after, _ in answers), answers
    assert set(queued_before_the_status_line) == {True}, queued_before_the_status_line


async def test_every_sequence_counts_against_the_waiting_limit_all_or_none(tiny_vocab_model, tokenizer, monkeypatch):
    core = tiny_engine_core(tiny_vocab_model, max_num_seqs=1, max_waiting_requests=4)
    slow_steps(core, monkeypatch, 0.05)  # (200 tokens: 10 s, so the streams outlive the refusals)
    async with serve_http(core, tokenizer, limits=Limits(max_prompts_per_request=8)) as server, \
            trio.open_nursery() as nursery:
        client = server.client
        # Larger than the queue on its own (prompts x n), or more prompts than one request may hold: a 400.
        for path, body, param in [("/v1/completions", {"prompt": ["Hi"] * 4, "n": 2}, "n"),
                                  ("/v1/completions", {"prompt": [[5, 6]] * 5}, "prompt"),
                                  ("/v1/completions", {"prompt": ["Hi"] * 9}, "prompt"),
                                  ("/v1/chat/completions", {**CHAT, "n": 5}, "n")]:
            response = await server.http.post(path, json={**body, "max_tokens": 2})
            assert response.status_code == 400 and error(response.content)["param"] == param, (body, response.text)
        assert client.num_unfinished == 0 and core.stats().num_steps == 0  # none of it reached the engine
        nursery.start_soon(stream_forever, server, {"prompt": "Hi"})
        await until(lambda: client.num_unfinished == 1 and client.num_waiting_sequences == 0)
        nursery.start_soon(stream_forever, server, {"prompt": ["a", "b"], "n": 2})  # four sequences wait
        await until(lambda: client.num_waiting_sequences == 4)
        for path, body in [("/v1/completions", {"prompt": "Hi"}), ("/v1/completions", {"prompt": ["x", "y"]}),
                           ("/v1/chat/completions", CHAT)]:
            refused = await server.http.post(path, json={**body, "max_tokens": 2})
            assert refused.status_code == 503 and error(refused.content)["code"] == "overloaded"
        assert client.num_unfinished == 3 and client.num_waiting_sequences == 4  # no part of them was queued
        nursery.cancel_scope.cancel()


async def test_health_answers_while_256_requests_wait(tiny_vocab_core, tokenizer, monkeypatch):
    slow_steps(tiny_vocab_core, monkeypatch, 0.005)
    params = SamplingParams(max_tokens=200, ignore_eos=True)  # (a wave of 32 takes 1 s or more to finish)
    async with serve_http(tiny_vocab_core, tokenizer) as server, trio.open_nursery() as nursery:
        async def one(i):
            async for _ in server.client.generate([100 + i % 50] * 20, params):
                pass

        for i in range(300):
            nursery.start_soon(one, i)
        await until(lambda: server.client.stats().num_waiting >= 256)
        for _ in range(20):
            assert (await server.http.get("/health")).status_code == 200
        # All twenty were answered before the queue drained: /health does not wait on the engine.
        assert server.client.stats().num_waiting >= 200
        nursery.cancel_scope.cancel()


async def test_the_deadline_counts_from_the_requests_arrival(tiny_vocab_core, tokenizer, monkeypatch):
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        real = server.client.compile

        async def slow_compile(params):  # compiling (or templating) takes longer than the deadline
            await trio.sleep(1.0)
            return await real(params)

        monkeypatch.setattr(server.client, "compile", slow_compile)
        for path, body in [("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", CHAT)]:
            for stream in (False, True):
                late = await server.http.post(path, json={**body, "max_tokens": 2, "stream": stream,
                                                          "guided_choice": ["yes", "no"]},
                                              headers={"X-Request-Timeout": "0.3"})
                assert late.status_code == 504 and error(late.content)["code"] == "request_timeout", late.text
        assert server.client.num_unfinished == 0 and tiny_vocab_core.stats().num_steps == 0


async def test_a_failure_after_the_headers_ends_the_stream_with_an_error_event(tiny_vocab_core, tokenizer,
                                                                              monkeypatch):
    real_add = tiny_vocab_core.add_request

    def add_request(request_id, prompt, params, *args):  # the core refuses what the front accepted
        if params.max_tokens == 7:
            raise InvalidParameterError("prompt", "refused by the engine core")
        return real_add(request_id, prompt, params, *args)

    monkeypatch.setattr(tiny_vocab_core, "add_request", add_request)
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        for path, body in [("/v1/completions", {"prompt": ["Hi", "there"]}), ("/v1/chat/completions", CHAT)]:
            response = await server.http.post(path, json={**body, "max_tokens": 7, "stream": True})
            events = sse_data(response.text.splitlines())
            assert response.status_code == 200 and events[-1] == "[DONE]", response.text
            assert events[-2]["error"] == {"message": "refused by the engine core", "type": "invalid_request_error",
                                           "param": "prompt", "code": "bad_request"}
        # A bug while building the events (not the engine's, not the request's): a 500 event.
        monkeypatch.setattr("api.app.completion_logprobs", lambda *args: 1 / 0)
        response = await server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "logprobs": 1,
                                                                   "stream": True})
        events = sse_data(response.text.splitlines())
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
        assert b"ZeroDivision" not in response.content
        await wait_idle(server.client)
        assert tiny_vocab_core.stats().kv_blocks_used == 0
        ok = await server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200


async def test_a_request_past_its_deadline_is_aborted_with_504(tiny_vocab_core, tokenizer, monkeypatch):
    slow_steps(tiny_vocab_core, monkeypatch)
    body = {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        late = await server.http.post("/v1/completions", json=body, headers={"X-Request-Timeout": "0.3"})
        assert late.status_code == 504 and error(late.content)["code"] == "request_timeout"
        # (1 s: time for some text first, even on a loaded machine; 200 steps take 4 s or more)
        streamed = await server.http.post("/v1/chat/completions", json={**CHAT, **body, "stream": True},
                                          headers={"X-Request-Timeout": "1.0"})
        events = sse_data(streamed.text.splitlines())
        assert events[-2]["error"]["code"] == "request_timeout" and events[-1] == "[DONE]" and len(events) > 3
        await wait_idle(server.client)
        assert server.client.stats().kv_blocks_used == 0
        for bad in ("soon", "-1", "nan", "inf"):
            response = await server.http.post("/v1/completions", json=body, headers={"X-Request-Timeout": bad})
            assert response.status_code == 400 and error(response.content)["param"] == "X-Request-Timeout"
    async with serve_http(tiny_vocab_core, tokenizer, limits=Limits(request_timeout=0.3)) as server:
        assert (await server.http.post("/v1/completions", json=body)).status_code == 504  # the server's default


async def test_a_client_that_never_sends_its_body_is_timed_out(tiny_vocab_core, tokenizer):
    async with serve_http(tiny_vocab_core, tokenizer, limits=Limits(body_timeout=0.5)) as server:
        host, port = str(server.http.base_url.host), server.http.base_url.port
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 100\r\n\r\n{\"prompt\":")
        with trio.fail_after(10):
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                reply += await stream.receive_some()
        await stream.aclose()
        assert reply.startswith(b"HTTP/1.1 408") and b'"timeout_error"' in reply
        assert b"connection: close" in reply.lower()  # the rest of the body must not become a request
        ok = await server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200


@pytest.mark.parametrize("depth", [40, 5000])
async def test_deeply_nested_json_is_a_400(tiny_vocab_core, tokenizer, depth):
    nested = "[" * depth + "]" * depth
    body = b'{"prompt": "Hi", "chat_template_kwargs": {"x": ' + nested.encode() + b"}}"
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        response = await server.http.post("/v1/completions", content=body,
                                          headers={"Content-Type": "application/json"})
        message = error(response.content)["message"]
        assert response.status_code == 400 and ("nested deeper" in message or "depth limit" in message)


async def test_a_consumer_that_never_reads_does_not_stall_others(tiny_vocab_core, tokenizer):
    body = {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "stream": True, "logprobs": 5}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        async with server.http.stream("POST", "/v1/completions", json=body) as stalled:
            assert stalled.status_code == 200  # and then never read
            # (a stall is for good: the stalled stream is never read. On a loaded 2-core machine
            # these 100 tokens took 5-38 s: torch's two threads wait for each other at every op)
            with trio.fail_after(90):
                for i in range(5):
                    ok = await server.http.post("/v1/completions", json={"prompt": f"{i}", "max_tokens": 20,
                                                                          "ignore_eos": True})
                    assert ok.json()["usage"]["completion_tokens"] == 20


async def test_a_fault_in_the_scheduler_fails_every_request_in_flight(tiny_vocab_core, tokenizer, monkeypatch):
    slow_steps(tiny_vocab_core, monkeypatch)
    fault = fail_when(tiny_vocab_core, "schedule")
    body = {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        results = {}

        async def one(i, stream):
            results[i] = await server.http.post("/v1/completions", json={**body, "stream": stream})

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(6):
                    nursery.start_soon(one, i, i % 2 == 1)
                while tiny_vocab_core.num_running_requests < 6:  # all six in flight, then the fault
                    await trio.sleep(0.01)
                fault.set()
        for i, response in results.items():
            if i % 2:
                events = sse_data(response.text.splitlines())
                assert events[-2]["error"]["code"] == "engine_dead" and events[-1] == "[DONE]"
            else:
                assert response.status_code == 500 and error(response.content)["code"] == "engine_dead"
        assert (await server.http.get("/health")).status_code == 503
        after = await server.http.post("/v1/completions", json=body)
        assert after.status_code == 503 and error(after.content)["code"] == "engine_dead"


async def test_the_api_key_guards_generation_and_tokenizer_routes_only(tiny_vocab_core, tokenizer):
    async with serve_http(tiny_vocab_core, tokenizer, api_key="sesame") as server:
        for method, path, body in [("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
                                   ("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [1]}),
                                   ("GET", "/v1/models", None)]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
                refused = await server.http.request(method, path, json=body, headers=headers)
                assert refused.status_code == 401 and error(refused.content)["code"] == "invalid_api_key"
                assert b"sesame" not in refused.content
            allowed = await server.http.request(method, path, json=body, headers={"Authorization": "Bearer sesame"})
            assert allowed.status_code == 200
        for path in ("/health", "/metrics", "/version", "/openapi.json", "/docs"):  # probes carry no key
            assert (await server.http.get(path)).status_code == 200
        document = (await server.http.get("/openapi.json")).json()
        assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(document["paths"])


def test_every_route_of_the_api_is_in_its_description():
    """Each route and method the app answers (but the page's and the description's own) is in
    /openapi.json, so clients generated from it and the schema-driven fuzzing see all of them."""
    from api.app import create_app
    from api.openapi import openapi_document

    paths = openapi_document("x")["paths"]
    missing = []
    for rule in create_app(ServerState("m")).url_map.iter_rules():
        path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
        if path in ("/", "/static/{name}", "/docs", "/openapi.json"):
            continue
        missing += [f"{method} {path}" for method in sorted(rule.methods - {"HEAD", "OPTIONS"})
                    if method.lower() not in paths.get(path, {})]
    assert missing == []


async def test_a_disconnect_storm_leaves_nothing_behind(tiny_vocab_model, tokenizer):
    """300 streams at concurrency 64, a random half of the clients leaving at random points:
    afterwards nothing runs, waits or holds a block, and every client that stayed got its whole
    answer, greedy-equal to the same prompt run alone (up to a near-tie, judged by the lone
    run's own top-2 logprobs: fp32 results differ in the last bits across batch shapes)."""
    core = tiny_engine_core(tiny_vocab_model, num_kv_blocks=512, max_num_seqs=64, max_num_batched_tokens=512)
    rng = random.Random(7)
    prompts = [f"Story number {i}: once upon a time" for i in range(10)]
    body = {"max_tokens": 24, "ignore_eos": True, "temperature": 0, "logprobs": 2}
    async with serve_http(core, tokenizer) as server:
        alone = [(await server.http.post("/v1/completions", json={**body, "prompt": p})).json()["choices"][0]["logprobs"]
                 for p in prompts]
        stayed: list[tuple[int, list[str]]] = []
        left = []
        limiter = trio.CapacityLimiter(64)

        async def client(i: int) -> None:
            leave_after = rng.randint(1, 20) if rng.random() < 0.5 else None
            # A client that leaves asked for more than it will read: only an abort can end it early.
            request = {**body, "prompt": prompts[i % 10], "stream": True, "max_tokens": 24 if leave_after is None else 200}
            async with limiter, server.http.stream("POST", "/v1/completions", json=request) as r:
                tokens, events = [], 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    events += 1
                    tokens += orjson.loads(line[6:])["choices"][0]["logprobs"]["tokens"]
                    if events == leave_after:
                        left.append(i)
                        return  # the client goes away mid-stream
                stayed.append((i % 10, tokens))

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(300):
                    nursery.start_soon(client, i)
            await wait_idle(server.client)
        metrics = (await server.http.get("/metrics")).text
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            assert metric(metrics, name) == 0, name
        assert metric(metrics, "vllm:request_success_total", finished_reason="abort") == len(left)
    assert 100 < len(stayed) < 200 and len(stayed) + len(left) == 300
    for prompt_index, tokens in stayed:
        assert_greedy_equal(tokens, alone[prompt_index])


def assert_greedy_equal(tokens: list[str], lone: dict) -> None:
    """Equal to the lone run's tokens, or equal up to a position where its top two were a near-tie."""
    for position, (mine, theirs) in enumerate(zip(tokens, lone["tokens"])):
        if mine != theirs:
            top = sorted(lone["top_logprobs"][position].values(), reverse=True)
            assert len(top) == 2 and top[0] - top[1] < 1e-4, f"diverged at {position}: {mine!r} vs {theirs!r}, {top}"
            return
    assert len(tokens) == len(lone["tokens"]) == 24


async def test_cache_salt_keeps_tenants_out_of_each_others_prefix_cache(tiny_vocab_core, tokenizer):
    prompt = [100 + i for i in range(40)]  # two full blocks that could hit

    async def cached(server, **fields) -> int:
        body = {"prompt": prompt, "max_tokens": 1, **fields}
        return (await server.http.post("/v1/completions", json=body)).json()["usage"]["prompt_tokens_details"][
            "cached_tokens"]

    async with serve_http(tiny_vocab_core, tokenizer) as server:
        assert await cached(server, cache_salt="tenant-a") == 0
        assert await cached(server, cache_salt="tenant-b") == 0  # same prompt, other tenant: no hit
        assert await cached(server) == 0  # no salt is a tenant of its own
        assert await cached(server, cache_salt="tenant-a") == 32
        bad = await server.http.post("/v1/completions", json={"prompt": prompt, "cache_salt": ""})
        assert bad.status_code == 400 and error(bad.content)["param"] == "cache_salt"


async def test_a_stream_interval_sends_fewer_larger_events_of_the_same_text(tiny_vocab_model, tokenizer):
    from api.server import build_parser, engine_config

    assert engine_config(build_parser().parse_args(["--stream-interval", "4"])).stream_interval == 4
    body = {"prompt": "Once upon a time", "max_tokens": 13, "temperature": 0, "ignore_eos": True}
    async with serve_http(tiny_engine_core(tiny_vocab_model, stream_interval=4), tokenizer) as server:
        whole = (await server.http.post("/v1/completions", json=body)).json()
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with server.http.stream("POST", "/v1/completions", json=streamed) as response:
            events = sse_data([line async for line in response.aiter_lines()])
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert 2 <= len(chunks) <= 4  # the first token, then 4 at a time (not 13 events)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and events[-2]["usage"]["completion_tokens"] == 13


@pytest.mark.parametrize("argv, words", [
    (["--port", "70000"], "argument --port: a port is 0 to 65535; got 70000"),
    (["--master-port", "0"], "argument --master-port: a port to meet at is 1 to 65535; got 0"),
    (["--data-parallel-rpc-port", "65536"], "argument --data-parallel-rpc-port: a port to meet at is 1 to 65535"),
    (["--seed", str(1 << 70)], "argument --seed: a seed is a 64-bit integer"),
    (["--shutdown-timeout", "nan"], "argument --shutdown-timeout: seconds are a number, 0 or more; got nan"),
    (["--request-timeout", "0"], "argument --request-timeout: seconds must be more than 0"),
    (["--request-body-timeout", "-1"], "argument --request-body-timeout: seconds are a number, 0 or more"),
    (["--max-prompts-per-request", "0"], "argument --max-prompts-per-request: must be at least 1; got 0"),
    (["--api-server-count", "-3"], "argument --api-server-count: must be at least 1; got -3"),
])
def test_the_servers_own_flags_are_checked_when_read(argv, words, capsys):
    """Not at SIGTERM (a NaN shutdown timeout), nor at every request (a NaN deadline: 500s)."""
    from api.server import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2 and words in capsys.readouterr().err
    args = build_parser().parse_args(["--port", "0", "--shutdown-timeout", "inf", "--seed", str(-(1 << 63))])
    assert (args.port, args.shutdown_timeout) == (0, float("inf"))  # (the bounds themselves are fine)



def test_an_engine_gone_before_it_was_ready_is_one_line_not_a_traceback(monkeypatch):
    """A front whose engine's link broke while it started (another front read the engine's
    reason and said it) ends with the link's error in one line and status 1."""
    import api.server
    from engine.errors import EngineDeadError

    def broken(args, argv):
        raise EngineDeadError("a remote engine left before it was ready: the link is broken")

    monkeypatch.setattr(api.server, "_run", broken)
    with pytest.raises(SystemExit) as exit_:
        api.server.main(["--port", "0"])
    assert exit_.value.code == "error: a remote engine left before it was ready: the link is broken"

def test_a_bad_environment_default_is_a_usage_error_naming_its_flag(monkeypatch, capsys):
    from api.server import build_parser

    monkeypatch.setenv("NNODES", "abc")
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([])
    assert exit_.value.code == 2 and "argument --nnodes: invalid int value: 'abc'" in capsys.readouterr().err
    monkeypatch.setenv("NNODES", "2")
    assert build_parser().parse_args([]).nnodes == 2


def test_a_vllm_serve_command_line_reads_as_vllm_reads_it(monkeypatch, tmp_path, capsys):
    """What ports of `vllm serve` command lines and manifests pass: the model as the first
    argument, underscore spellings, several API keys or $VLLM_API_KEY, CORS origins as a JSON
    list, an inline chat template, and flags that change nothing here."""
    from api.server import allowed_origins, build_parser, chat_template, server_state

    args = build_parser().parse_args(["/models/m.gguf", "--max_model_len=2048", "--max_num_seqs", "4",
                                      "--api-key", "a", "b", "--trust-remote-code", "--disable-log-requests"])
    assert (args.model, args.max_model_len, args.max_num_seqs, args.api_key) == ("/models/m.gguf", 2048, 4, ["a", "b"])
    # Sizes with vLLM's suffixes: k thousands (fractions too), K 1024s
    args = build_parser().parse_args(["--max-model-len", "32k", "--max-num-batched-tokens", "2K",
                                      "--kv-cache-memory", "1.5g"])
    assert (args.max_model_len, args.max_num_batched_tokens, args.kv_cache_memory) == (32000, 2048, 1_500_000_000)
    assert build_parser().parse_args(["--max-model-len", "25.6k"]).max_model_len == 25600
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-model-len", "1.5K"])
    assert "argument --max-model-len: a fraction takes k, m, g or t" in capsys.readouterr().err
    assert build_parser().parse_args(["--served-model-name", "x", "y"]).served_model_name == ["x", "y"]
    with pytest.raises(SystemExit) as exit_code:
        build_parser().parse_args(["/models/m.gguf", "--model", "/models/other.gguf"])
    assert exit_code.value.code == 2 and "the model is given twice" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_API_KEY", "from-env")  # (a Kubernetes secret is often given so)
    assert build_parser().parse_args([]).api_key == ["from-env"]
    assert build_parser().parse_args(["--api-key", "given"]).api_key == ["given"]
    assert server_state(build_parser().parse_args(["--api-key", ""]), "m").api_key is None  # (vLLM: no key)
    assert server_state(build_parser().parse_args(["--api-key", "", "k"]), "m").api_key == ("k",)
    assert allowed_origins('["http://a.example", "*"]') == ("http://a.example", "*") == allowed_origins("http://a.example,*")
    with pytest.raises(InvalidParameterError):
        allowed_origins('["unclosed"')
    assert chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}").startswith("{% for")
    assert chat_template("{{ a }}\\n{{ b }}") == "{{ a }}\n{{ b }}"  # (a typed \n is a newline, as vLLM)
    (tmp_path / "{dir}").mkdir()
    (tmp_path / "{dir}" / "t.jinja").write_text("{{ messages }}")
    assert chat_template(str(tmp_path / "{dir}" / "t.jinja")) == "{{ messages }}"  # (a file first, braces or not)
    for wrong, said in ((str(tmp_path / "missing.jinja"), "missing.jinja: No such file or directory"),
                        (str(tmp_path), "Is a directory"),
                        ("{% for m in messages %}{{ m }", "does not compile: unexpected '}' (line 1)")):
        with pytest.raises(ConfigError, match=re.escape(said)):  # (at start: the server exits 2, one line)
            chat_template(wrong)
    (tmp_path / "latin1.jinja").write_bytes("{{ 'café' }}".encode("latin-1"))
    with pytest.raises(ConfigError, match="latin1.jinja: not UTF-8 text"):
        chat_template(str(tmp_path / "latin1.jinja"))
    kept = build_parser().parse_args(["--chat-template", "--- a_b {{ x_y }}", "--default_chat_template_kwargs", "{}"])
    assert kept.chat_template == "--- a_b {{ x_y }}"  # (a value is not an option's name)
    with pytest.raises(SystemExit):  # (the model last, after a flag of several values)
        build_parser().parse_args(["--api-key", "k", str(tmp_path / "{dir}" / "t.jinja")])
    capsys.readouterr()


async def test_several_served_model_names_are_each_a_model(tiny_vocab_core, tokenizer):
    """--served-model-name a b (vLLM's): requests may name either, answers carry the first."""
    async with serve_http(tiny_vocab_core, tokenizer, other_model_names=("alias",)) as server:
        listed = (await server.http.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == ["tiny", "alias"] and {m["root"] for m in listed} == {"tiny"}
        answer = await server.http.post("/v1/completions", json={"model": "alias", "prompt": "Hi", "max_tokens": 1})
        assert answer.status_code == 200 and answer.json()["model"] == "tiny"
        assert (await server.http.get("/v1/models/alias")).json()["id"] == "alias"
        unknown = await server.http.post("/v1/completions", json={"model": "other", "prompt": "Hi"})
        assert unknown.status_code == 404


async def test_sagemakers_routes_and_several_api_keys(tiny_vocab_core, tokenizer):
    async with serve_http(tiny_vocab_core, tokenizer, api_key=("one", "two")) as server:
        assert (await server.http.get("/ping")).status_code == 200
        assert (await server.http.post("/ping")).status_code == 200
        for key in ("one", "two"):
            chat = await server.http.post("/invocations", json={**CHAT, "max_tokens": 2},
                                          headers={"Authorization": f"Bearer {key}"})
            assert chat.status_code == 200 and chat.json()["object"] == "chat.completion", chat.text
        text = await server.http.post("/invocations", json={"prompt": "Hi", "max_tokens": 2},
                                      headers={"Authorization": "Bearer two"})
        assert text.status_code == 200 and text.json()["object"] == "text_completion"
        refused = await server.http.post("/v1/completions", json={"prompt": "Hi"}, headers={"Authorization": "Bearer x"})
        assert refused.status_code == 401
        neither = await server.http.post("/invocations", json={"input": "Hi"}, headers={"Authorization": "Bearer one"})
        assert neither.status_code == 400
        unkeyed = await server.http.post("/invocations", json={"prompt": "Hi"})  # (it generates: keyed as /v1)
        assert unkeyed.status_code == 401
