"""Bad input, in bulk: schemathesis against the server's own /openapi.json (valid and invalid
requests from every operation's schema), hypothesis over raw and structured bodies, and a
list of hostile requests picked by hand. Every answer is a 200 or a 4xx in OpenAI's error
shape, never a 5xx, a traceback or a file path; afterwards the server still answers a normal
request correctly and holds no KV blocks.

The engine is the tiny random model over the default tokenizer's vocabulary, with a short
context, so hundreds of generations stay cheap.
"""

from __future__ import annotations

import json
import re
import time

import hypothesis.strategies as st
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings

from api.app import VERSION
from api.openapi import openapi_document
from api.responses import ResponseStore
from engine.reasoning import REASONING_PARSERS
from tests.conftest import ThreadedServer, tiny_engine_core

MAX_MODEL_LEN = 64

schema = schemathesis.openapi.from_dict(openapi_document(VERSION))

# Where a leak of the server's insides would show: tracebacks, source paths, exception reprs.
LEAKS = re.compile(r"Traceback|File \"|\.py\b|/work/|site-packages|Error\(")


@pytest.fixture(scope="module")
def server(tiny_vocab_model, tokenizer):
    core = tiny_engine_core(tiny_vocab_model, num_kv_blocks=256, max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
                            max_num_batched_tokens=512)
    # The responses store and a reasoning parser on, so that their paths are fuzzed too.
    server = ThreadedServer(core, tokenizer, responses=ResponseStore(16), reasoning_parser=REASONING_PARSERS["qwen3"])
    yield server
    try:
        with requests.Session() as http:  # whichever of this module's tests ran, in whatever order
            assert_whole(server, http)
    finally:
        server.close()


@pytest.fixture(scope="module")
def http():
    with requests.Session() as session:
        yield session


def check_answer(response: requests.Response) -> None:
    """200, or a 4xx naming the problem in OpenAI's error shape; never a 5xx or a leak."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    assert not LEAKS.search(response.text[:100_000]), response.text[:500]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert isinstance(error["type"], str) and (error["code"] is None or isinstance(error["code"], str)), error


@schema.parametrize()
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_schema_driven_requests_never_break_the_server(case, server, http):
    check_answer(case.call(base_url=server.base_url, session=http, timeout=60))


FIELDS = ["prompt", "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
          "stream", "stream_options", "logprobs", "top_logprobs", "logit_bias", "seed", "top_k", "min_p",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop_token_ids", "echo",
          "prompt_logprobs", "priority", "cache_salt", "tools", "tool_choice", "response_format", "user", "tokens",
          "input", "instructions", "text", "max_output_tokens", "previous_response_id", "store", "reasoning",
          "thinking_token_budget", "chat_template_kwargs", "include_reasoning"]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8),
                                                                 inner, max_size=5),
    max_leaves=20)
BODIES = st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=8)
ROUTES = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"])


@given(route=ROUTES, body=BODIES)
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_random_json_bodies_never_break_the_server(server, http, route, body):
    data = json.dumps(body, allow_nan=False).encode()
    check_answer(http.post(server.base_url + route, data=data, headers={"Content-Type": "application/json"},
                           timeout=60))


@given(route=ROUTES, raw=st.binary(max_size=200) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_random_bytes_never_break_the_server(server, http, route, raw):
    check_answer(http.post(server.base_url + route, data=raw, headers={"Content-Type": "application/json"},
                           timeout=60))


PROMPT = "Hi"
HOSTILE = [
    b'{"prompt": "Hi", "max_tokens": 5',  # cut short
    b'\xff\xfe{"prompt": "Hi"}',  # not UTF-8
    b'{"prompt": "\xc3\x28"}',  # invalid UTF-8 inside a string
    b'{"prompt": "\\ud800"}',  # a lone surrogate
    b'{"prompt": "Hi", "temperature": NaN}',
    b'{"prompt": "Hi", "temperature": Infinity}',
    b'{"prompt": "Hi", "top_p": 1e400}',
    b'{"prompt": "Hi", "max_tokens": 100000000000000000000000000000}',
    b'{"prompt": "Hi", "n": -1}',
    b'{"prompt": "Hi", "max_tokens": -5}',
    b'{"prompt": "Hi", "logprobs": -1}',
    b'{"prompt": ""}',
    b'{"prompt": []}',
    b'{"prompt": [[]]}',
    b'{"prompt": [49152]}',  # one past the vocabulary
    b'{"prompt": [-1]}',
    b'{"prompt": [true]}',
    b'{"prompt": "Hi", "stop_token_ids": [99999999]}',
    b'{"prompt": "Hi", "logit_bias": {"99999999": 1}}',
    b'{"prompt": "Hi", "logit_bias": {"abc": 1}}',
    b'{"prompt": "Hi", "unknown_field": {"deeply": [1, {"x": null}]}}',  # ignored, as OpenAI does
    b'{"messages": [{"role": "user", "content": {"not": "a list"}}]}',
    b'{"messages": [{"role": "user"}], "stream": "yes"}',
    b'{"messages": null}',
    b'[]',
    b'"a string"',
    b'null',
    b"",
]


@pytest.mark.parametrize("body", HOSTILE)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_hand_picked_hostile_bodies(server, http, route, body):
    check_answer(http.post(server.base_url + route, data=body, headers={"Content-Type": "application/json"},
                           timeout=60))


RESPONSES_HOSTILE = [
    {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text"}]}]},
    {"input": [{"role": "user", "content": [5]}]},
    {"input": [{"type": "reasoning", "content": 5}, {"role": "user", "content": "x"}]},
    {"input": [{"type": "function_call", "call_id": "a", "name": "f", "arguments": "{"}]},
    {"input": [{"type": "function_call_output", "output": "x"}]},
    {"input": [{"type": "function_call_output", "call_id": "a", "output": {"x": 1}}]},
    {"input": [], "instructions": "x"},
    {"input": "x", "previous_response_id": "resp_nope"},
    {"input": "x", "tools": [{"type": "function"}]},
    {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "str"}], "tool_choice": "required"},
    {"input": "x", "tool_choice": {"type": "function"}, "tools": [{"type": "function", "name": "f"}]},
    {"input": "x", "text": {"format": "json"}},
    {"input": "x", "text": {"format": {"type": "json_schema", "schema": 5}}},
    {"input": "x", "metadata": {"a": 1}},
    {"input": "x", "reasoning": {"effort": 5}, "thinking_token_budget": -1},
    {"input": "x", "max_output_tokens": 0},
    {"input": "x", "stream": True, "max_output_tokens": 100000000},
]


@pytest.mark.parametrize("body", RESPONSES_HOSTILE)
def test_hand_picked_hostile_responses_requests(server, http, body):
    check_answer(http.post(server.base_url + "/v1/responses", json=body, timeout=60))


def post(server, http, body: dict, route: str = "/v1/completions") -> requests.Response:
    response = http.post(server.base_url + route, json=body, timeout=120)
    check_answer(response)
    return response


def test_sizes_at_and_past_their_limits(server, http, tokenizer):
    prompt_len = len(tokenizer.encode(PROMPT))
    room = MAX_MODEL_LEN - prompt_len
    assert post(server, http, {"prompt": PROMPT, "max_tokens": room, "ignore_eos": True}).status_code == 200
    assert post(server, http, {"prompt": PROMPT, "max_tokens": room + 1}).json()["error"]["param"] == "max_tokens"
    assert len(post(server, http, {"prompt": PROMPT, "max_tokens": 2, "n": 128}).json()["choices"]) == 128
    assert post(server, http, {"prompt": PROMPT, "n": 129}).json()["error"]["param"] == "n"
    assert post(server, http, {"prompt": PROMPT, "stop": ["x" * 256] * 64, "max_tokens": 2}).status_code == 200
    assert post(server, http, {"prompt": PROMPT, "stop": ["x" * 257]}).json()["error"]["param"] == "stop"
    assert post(server, http, {"prompt": PROMPT, "stop": [f"s{i}" for i in range(5000)]}).json()["error"]["param"] \
        == "stop"
    assert post(server, http, {"prompt": [5] * MAX_MODEL_LEN}).json()["error"]["param"] == "prompt"
    chat = [{"role": "user", "content": PROMPT}]
    too_long = [{"role": "user", "content": "word " * MAX_MODEL_LEN}]
    assert post(server, http, {"messages": too_long}, "/v1/chat/completions").json()["error"]["param"] == "messages"
    # min_tokens past the room left, max_tokens unset (the default: the room): refused, as vLLM does
    assert post(server, http, {"messages": chat, "min_tokens": MAX_MODEL_LEN}, "/v1/chat/completions"
                ).json()["error"]["param"] == "min_tokens"
    assert post(server, http, {"prompt": PROMPT, "max_tokens": None, "min_tokens": room + 1}).json()["error"]["param"] \
        == "min_tokens"
    assert post(server, http, {"prompt": "word " * 200_000}).json()["error"]["param"] == "prompt"  # never tokenized
    # unless only its last tokens are to be kept: truncate_prompt_tokens takes text of any length
    kept = post(server, http, {"prompt": "word " * 200_000, "truncate_prompt_tokens": 8, "max_tokens": 1})
    assert kept.json()["usage"]["prompt_tokens"] == 8
    kept = post(server, http, {"messages": [{"role": "user", "content": "word " * 200_000}], "max_tokens": 1,
                               "truncate_prompt_tokens": 8}, "/v1/chat/completions")
    assert kept.json()["usage"]["prompt_tokens"] == 8
    # Nor text in a message outside its content: tool calls' arguments, reasoning (a template
    # renders them; tokenizing a megabyte stalls every request of the server).
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "word " * 200_000}}
    for message in ({"role": "assistant", "tool_calls": [call]},
                    {"role": "assistant", "content": "x", "reasoning_content": "word " * 200_000}):
        refusal = post(server, http, {"messages": [{"role": "user", "content": "hi"}, message]},
                       "/v1/chat/completions").json()["error"]
        assert refusal["param"] == "messages" and "characters" in refusal["message"], refusal
    item = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "word " * 200_000}
    refusal = post(server, http, {"input": [{"role": "user", "content": "hi"}, item]}, "/v1/responses").json()["error"]
    assert refusal["param"] == "input" and "characters" in refusal["message"], refusal
    huge = http.post(server.base_url + "/v1/completions", data=b'{"prompt": "' + b"a" * (9 << 20) + b'"}',
                     headers={"Content-Type": "application/json"}, timeout=60)
    check_answer(huge)
    assert huge.status_code == 413 and huge.headers["Connection"] == "close"  # the unread body ends the connection
    assert http.get(server.base_url + "/health", timeout=5).status_code == 200  # (it used to hang a reused one)


def test_oversized_headers_are_refused_by_the_http_server(server, http):
    # h11 refuses a header block over 16 KiB before the app sees it: a bare 4xx, not OpenAI's
    # shape (nothing of the app runs), and the connection is closed.
    response = http.get(server.base_url + "/health", headers={"X-Big": "a" * 70_000}, timeout=60)
    assert 400 <= response.status_code < 500
    assert http.get(server.base_url + "/health", timeout=60).status_code == 200


def assert_whole(server, http) -> None:
    """A normal request is answered correctly (greedy: the same twice) and nothing is held."""
    ok = post(server, http, {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0})
    again = post(server, http, {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0})
    assert ok.json()["usage"]["completion_tokens"] == 8 and ok.json()["choices"][0]["text"] == \
        again.json()["choices"][0]["text"]
    stats = server.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)


def test_after_hostile_requests_and_abandoned_streams_the_server_is_whole(server, http):
    """On its own (the module's fixture checks the same after all its tests)."""
    for route in ("/v1/completions", "/v1/chat/completions"):
        for body in HOSTILE:
            check_answer(http.post(server.base_url + route, data=body, headers={"Content-Type": "application/json"},
                                   timeout=60))
    for _ in range(4):  # streams left after their first event
        with http.post(server.base_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "n": 4,
                                                                 "ignore_eos": True, "stream": True},
                       stream=True, timeout=60) as response:
            assert response.status_code == 200
            next(response.iter_lines())
    deadline = time.monotonic() + 30
    while server.stats().kv_blocks_used and time.monotonic() < deadline:  # (the aborts land a step later)
        time.sleep(0.02)
    assert_whole(server, http)


@pytest.mark.parametrize("method, path", [("GET", "/v1/chat/completions"), ("POST", "/v1/nowhere"),
                                          ("PUT", "/tokenize"), ("OPTIONS", "/tokenize"), ("GET", "/health")])
def test_an_error_before_the_body_is_read_does_not_wedge_the_connection(server, method, path):
    """The unread body of a request refused early (wrong method or route) or answered without
    reading it (OPTIONS, GET) must not be parsed as the next request on a kept-alive
    connection: the next request used to hang."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with requests.Session() as session:  # one kept-alive connection
        refused = session.request(method, server.base_url + path, json=body, timeout=10)
        assert refused.headers["Connection"] == "close"
        after = session.post(server.base_url + "/v1/chat/completions", json=body, timeout=10)
        assert after.status_code == 200
