"""The server as a real process on a loopback port, driven by the official openai client and raw HTTP.

Responses are validated against OpenAI's published schemas.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import openai
import pytest

from engine.tokenizer import token_bytes
from tests.conftest import load_script
from tests.openapi_schemas import OpenAISchemas

pytestmark = pytest.mark.slow

API_KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    """A port free a moment ago. Another process may take it before the server binds it: the
    callers retry on a clash (``PortClash``) rather than fail by chance."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortClash(Exception):
    """The server could not bind a port it was given (another process took it first)."""


ADDRESS_IN_USE = "Address already in use"


def _tee(pipe, seen: list[str]) -> None:
    """Copy a server's stderr to ours (pytest shows it with a failure), keeping the first lines."""
    for line in iter(pipe.readline, ""):
        try:
            sys.stderr.write(line)
        except ValueError:  # (pytest's capture of a test that has ended)
            pass
        if len(seen) < 200:
            seen.append(line)
    pipe.close()


def start_server(*flags: str, attempts: int = 5) -> tuple[str, subprocess.Popen, list[int]]:
    """A server process on a free port, once healthy: (base URL, process, /health codes seen).
    A port taken by someone else between ``free_port`` and the bind is tried again with another.

    Raises:
        PortClash: still a clash after ``attempts`` ports (a port among ``flags`` is taken).
    """
    for _ in range(attempts):
        started = _start_server_on(free_port(), flags)
        if started is not None:
            return started
    raise PortClash(f"the server could not bind its ports in {attempts} tries")


def _start_server_on(port: int, flags) -> tuple[str, subprocess.Popen, list[int]] | None:
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "engine.api", "--port", str(port), "--backend", "torch",
                             "--num-kv-blocks", "512", "--log-level", "warning", *flags],
                            cwd=os.path.dirname(os.path.dirname(__file__)), stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    tee = threading.Thread(target=_tee, args=(proc.stderr, seen), daemon=True)
    tee.start()
    health = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            health.append(httpx.get(base + "/health", timeout=2).status_code)
            if health[-1] == 200:
                return base, proc, health
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            tee.join(timeout=10)
            if any(ADDRESS_IN_USE in line for line in seen):
                return None
            pytest.fail("the server exited during start-up")
        time.sleep(0.05)
    proc.kill()
    pytest.fail("server did not become healthy")


@pytest.fixture(scope="module", params=["one-process", "engine-process"])
def server(request):
    """The server as one process, and with its engine core in a process of its own: every test
    that uses it runs against both layouts."""
    base, proc, health = start_server("--api-key", API_KEY, *(["--engine-process"] if request.param ==
                                                               "engine-process" else []))
    yield base, proc, health
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, "the server must exit 0 on SIGTERM"


@pytest.fixture(scope="module")
def schemas():
    return OpenAISchemas()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0)


def post(server, path, body, key=API_KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server[0] + path, content=data, headers={**headers, "Content-Type": "application/json"},
                      timeout=120, **kw)


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


CHAT = [{"role": "user", "content": "Name three fruits."}]


def test_health_is_503_while_loading_then_200(server):
    health = server[2]
    assert health[-1] == 200
    assert 503 in health and set(health[:-1]) == {503}  # it listened while the model loaded


def test_models_and_version(server, client, schemas):
    models = httpx.get(server[0] + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    schemas.validate("ListModelsResponse", models)
    card = models["data"][0]
    assert card["id"] == MODEL and card["max_model_len"] == 8192 and card["root"] == MODEL
    assert [m.id for m in client.models.list()] == [MODEL]
    one = httpx.get(server[0] + f"/v1/models/{MODEL}", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    schemas.validate("Model", one)
    assert one == card and client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("another/model")
    assert missing.value.code == "model_not_found"
    assert httpx.get(server[0] + "/version").json()["version"]


def test_chat_streamed_equals_non_streamed(client, schemas, server):
    # Warm the prefix cache first, so that both compared runs compute the same shapes (its two
    # full blocks hit): fp32 results depend on the batch shape, and so greedy ties could.
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0)
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    schemas.validate("CreateChatCompletionResponse", full.model_dump(exclude_unset=True))
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    usage, expected = chunks[-1].usage, full.usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        expected.prompt_tokens, expected.completion_tokens, expected.total_tokens)
    assert usage.prompt_tokens_details.cached_tokens == 32 == expected.prompt_tokens_details.cached_tokens
    prompt_tokens = post(server, "/tokenize", {"messages": CHAT}).json()["count"]
    assert full.usage.prompt_tokens == prompt_tokens
    raw = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "stream": True,
                                                 "stream_options": {"include_usage": True}})
    events = sse_events(raw)
    assert raw.headers["content-type"].startswith("text/event-stream") and events[-1] == "[DONE]"
    for event in events[:-1]:
        schemas.validate("CreateChatCompletionStreamResponse", event)


def test_completions_streamed_equals_non_streamed(client, schemas, server):
    prompts = ["The capital of France is", "1, 2, 3,"]
    full = client.completions.create(model=MODEL, prompt=prompts, max_tokens=16, temperature=0)
    schemas.validate("CreateCompletionResponse", full.model_dump(exclude_unset=True))
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=16, temperature=0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[0], streamed[1]] == [c.text for c in sorted(full.choices, key=lambda c: c.index)]
    response = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "stream": True})
    events = sse_events(response)
    assert response.status_code == 200 and events[-1] == "[DONE]" and len(events) >= 3
    for event in events[:-1]:
        schemas.validate_completion_chunk(event)
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_n_stop_logprobs_seed(client, schemas):
    two = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, n=2, temperature=1.0, seed=5)
    assert sorted(c.index for c in two.choices) == [0, 1]
    again = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, n=2, temperature=1.0, seed=5)
    assert [c.message.content for c in two.choices] == [c.message.content for c in again.choices]
    full = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=20, temperature=0)
    word = full.choices[0].text.split()[2]
    stopped = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=20,
                                        temperature=0, stop=[word])
    assert stopped.choices[0].text == full.choices[0].text[:full.choices[0].text.index(word)]
    assert stopped.choices[0].finish_reason == "stop"
    lp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                        top_logprobs=3)
    schemas.validate("CreateChatCompletionResponse", lp.model_dump(exclude_unset=True))
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == lp.choices[0].message.content
    legacy = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    assert len(legacy.choices[0].logprobs.tokens) == 3


def test_chat_logprobs_bytes_join_into_characters_split_over_tokens(server, tokenizer):
    """Each token's ``bytes`` are its own (OpenAI: "useful in instances where characters are
    represented by multiple tokens and their byte representations must be combined"): emoji come
    in pieces of two tokens, each piece's text a replacement character, and the joined bytes
    are the answer's text, streamed or not; an alternative's bytes are its own too."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "\U0001f63a" * 8}], "max_tokens": 12,
            "temperature": 0, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    answer = httpx.post(server[0] + "/v1/chat/completions", json=body, headers=headers, timeout=120).json()
    content = answer["choices"][0]["logprobs"]["content"]
    joined = b"".join(bytes(t["bytes"]) for t in content)
    assert "\U0001f63a" in answer["choices"][0]["message"]["content"]
    assert joined.decode("utf-8", errors="replace") == answer["choices"][0]["message"]["content"]
    pieces = [bytes(t["bytes"]) for t in content]
    assert any(piece.decode("utf-8", errors="replace") != piece.decode("utf-8", errors="ignore") for piece in pieces)
    vocabulary = token_bytes(tokenizer)
    for token in content:  # named by id ("token_id:N"): each alternative's bytes are its own token's
        for entry in (token, *token["top_logprobs"]):
            assert bytes(entry["bytes"]) == vocabulary[int(entry["token"].removeprefix("token_id:"))], entry
    events = sse_events(httpx.post(server[0] + "/v1/chat/completions", json={**body, "stream": True},
                                   headers=headers, timeout=120))
    streamed = [t for e in events if e != "[DONE]" for c in e["choices"] if c["logprobs"]
                for t in c["logprobs"]["content"]]
    # The same tokens, bytes and alternatives; the logprobs up to the arithmetic's last bits: the
    # streamed request finds the prompt in the prefix cache and computes only its tail, in fewer
    # rows, and on a CPU with AVX512_BF16 the default activations are bf16 from 16 rows only.
    assert without_logprobs(streamed) == without_logprobs(content)
    assert [t["logprob"] for t in streamed] == pytest.approx([t["logprob"] for t in content], abs=0.05)


def without_logprobs(content: list[dict]) -> list[dict]:
    """Chat logprobs entries with their (and their alternatives') logprob values left out."""
    return [{**{k: v for k, v in t.items() if k != "logprob"},
             "top_logprobs": [{k: v for k, v in a.items() if k != "logprob"} for a in t["top_logprobs"]]}
            for t in content]


def test_prefix_cache_shows_in_usage(client):
    system = [{"role": "system", "content": "You are a terse assistant. " * 20}]
    client.chat.completions.create(model=MODEL, messages=system + CHAT, max_tokens=2)
    second = client.chat.completions.create(model=MODEL, messages=system + CHAT, max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens >= 96


def error_of(response: httpx.Response, schemas, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    schemas.validate("ErrorResponse", body)
    assert "Traceback" not in response.text
    return body["error"]


@pytest.mark.parametrize("body, param, words", [
    (b"{not json", None, "JSON"),
    ({"messages": CHAT, "max_tokens": "ten"}, "max_tokens", "int"),
    ({"messages": CHAT, "temperature": -1}, "temperature", ">= 0"),
    ({"messages": CHAT, "top_p": 2}, "top_p", "top_p"),
    ({"messages": CHAT, "n": 0}, "n", "n"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs", "top_logprobs"),
    ({"messages": "hello"}, "messages", "messages"),
    ({}, "messages", "required"),
    ({"messages": CHAT, "max_tokens": 100000}, "max_tokens", "8192"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not in tools"),
    ({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "json_schema.schema"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "not supported"),
])
def test_chat_errors(server, schemas, body, param, words):
    error = error_of(post(server, "/v1/chat/completions", body), schemas, 400)
    assert error["param"] == param and words in error["message"]


def test_completion_errors(server, schemas):
    assert error_of(post(server, "/v1/completions", {"prompt": "x", "suffix": "y"}), schemas, 400)["param"] == "suffix"
    long = error_of(post(server, "/v1/completions", {"prompt": [5] * 8190, "max_tokens": 100}), schemas, 400)
    assert "8192" in long["message"] and "8290" in long["message"]
    assert error_of(post(server, "/v1/completions", {"prompt": [10**7]}), schemas, 400)["param"] == "prompt"
    assert error_of(post(server, "/v1/completions", {"prompt": [1, "a"]}), schemas, 400)["param"] == "prompt"


def test_auth_model_route_method_size_errors(server, schemas):
    assert error_of(post(server, "/v1/chat/completions", {"messages": CHAT}, key=None), schemas, 401)
    assert error_of(post(server, "/v1/chat/completions", {"messages": CHAT}, key="wrong"), schemas, 401)
    missing = error_of(post(server, "/v1/chat/completions", {"messages": CHAT, "model": "gpt-9"}), schemas, 404)
    assert missing["message"] == "The model `gpt-9` does not exist."
    assert error_of(httpx.get(server[0] + "/v1/nothing-here", headers={"Authorization": f"Bearer {API_KEY}"}),
                    schemas, 404)
    assert error_of(httpx.get(server[0] + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}),
                    schemas, 405)
    huge = b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}'
    assert error_of(post(server, "/v1/completions", huge), schemas, 413)


def test_tokenize_detokenize_roundtrip(server):
    ids = post(server, "/tokenize", {"prompt": "Hello world"}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == "Hello world"
    assert post(server, "/detokenize", {"tokens": [-1]}).status_code == 400


def metric(server, name: str) -> float:
    text = httpx.get(server[0] + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def test_disconnect_mid_stream_frees_everything(server):
    body = {"messages": CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric(server, "vllm:num_requests_running") == 1
    deadline = time.monotonic() + 10
    while metric(server, "vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0


def test_metrics_names(server, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    text = httpx.get(server[0] + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:request_success_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket"):
        assert name in text, name
    assert f'model_name="{MODEL}"' in text
    assert metric(server, "vllm:generation_tokens_total") > 0


def test_a_backend_this_machine_cannot_run_is_one_clear_line():
    if torch_cuda_available():
        pytest.skip("this machine can run the cuda backend")
    result = subprocess.run([sys.executable, "-m", "engine.api", "--backend", "cuda", "--port", "0"],
                            capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode != 0
    assert "error: the cuda backend cannot run" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("argv, words", [
    (["--headless", "--api-server-count", "2"], "--api-server-count does not combine with --headless"),
    (["--api-server-count", "2", "--max-num-seqs", "0"], "max_num_seqs must be a positive integer; got 0"),
    (["--headless", "--max-num-seqs", "0"], "max_num_seqs must be a positive integer; got 0"),
    (["--api-server-count", "2", "--data-parallel-size", "2", "--data-parallel-size-local", "1"],
     "--api-server-count does not combine with engines on other machines"),
    (["--served-model-name", "a", ""], "--served-model-name: a name must not be empty"),
    (["--chat-template", ""], "--chat-template is empty"),
    (["--nnodes", "2", "--node-rank", "1", "--tensor-parallel-size", "2"], "--node-rank 1 runs this machine's "
     "tensor-parallel ranks only: add --headless"),  # (it tried to be a second rank 0)
    (["--data-parallel-size", "2", "--data-parallel-start-rank", "1"], "--data-parallel-start-rank numbers a "
     "--headless machine's engines"),
])
def test_mistakes_in_every_process_layout_are_one_line_and_exit_2(argv, words):
    """Several API servers or a headless node: a wrong flag is argparse's kind of error (it was a
    traceback and exit 1 under --api-server-count; --headless with it served nothing, for good)."""
    result = subprocess.run([sys.executable, "-m", "engine.api", "--port", "0", "--load-format", "dummy", *argv],
                            capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 2 and words in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("layout", [[], ["--api-server-count", "2"]])
def test_a_port_in_use_is_one_line_naming_it(layout):
    """A port another socket holds (one that allows sharing it, too): one line naming the
    address (it was a traceback under --api-server-count, whose socket would also have shared
    the port: SO_REUSEPORT)."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "engine.api", "--host", "127.0.0.1", "--port", str(port),
                                 "--load-format", "dummy", "--max-model-len", "64", *layout],
                                capture_output=True, text=True, timeout=180,
                                cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"error: cannot listen on --host 127.0.0.1 --port {port}: Address already in use", result.stderr
    assert "Traceback" not in result.stderr


def test_the_api_servers_flags_go_before_a_double_dash():
    """``--api-server-count 2 -- MODEL``: each front's own flags come before the "--" (after it
    they were read as positional arguments, and the fronts failed)."""
    from api.cli import build_parser
    from api.launcher import front_command

    command = front_command(["--port", "8000", "--api-server-count", "2", "--", "model.gguf"], 0, 5, [6])
    assert command[-2:] == ["--", "model.gguf"]
    args = build_parser().parse_args(command[3:])
    assert (args.model, args.api_server_count, args.listen_fd, args.engine_fd) == ("model.gguf", 1, 5, [6])


def test_port_0_serves_on_the_port_the_ready_line_names():
    """``--port 0`` binds a port the system picks; the start-up lines name that port, not 0."""
    proc = subprocess.Popen([sys.executable, "-m", "engine.api", "--port", "0", "--backend", "torch",
                             "--num-kv-blocks", "64"],
                            cwd=os.path.dirname(os.path.dirname(__file__)), stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in iter(proc.stderr.readline, ""):
            lines.append(line)
            if "engine.server: serving" in line or len(lines) > 200:
                break
        ready = [line for line in lines if "engine.server: serving" in line]
        assert ready, "".join(lines)
        url = ready[0].split(" on ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0"), ready[0]
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        page = proc.stderr.readline() + proc.stderr.readline()
        assert f"chat page: {url}/ " in page, page
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        proc.stderr.close()


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def test_one_bad_request_then_twenty_good_ones(server):
    """The request that used to kill the engine (an n=2 seed past the 64-bit range) is a 400
    naming ``seed``; a seed at the top of the range with n > 1 is served; and the engine goes
    on serving everyone."""
    bad = post(server, "/v1/completions", {"prompt": "Hi", "n": 2, "seed": 18446744073709551615})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "seed"
    edge = post(server, "/v1/completions", {"prompt": "Hi", "n": 3, "seed": 2**63 - 1, "max_tokens": 4})
    assert edge.status_code == 200 and len(edge.json()["choices"]) == 3
    with ThreadPoolExecutor(max_workers=20) as pool:
        answers = list(pool.map(lambda i: post(server, "/v1/completions", {"prompt": f"Count to {i}:",
                                                                            "max_tokens": 8, "temperature": 0}),
                                range(20)))
    assert [a.status_code for a in answers] == [200] * 20
    assert all(a.json()["usage"]["completion_tokens"] >= 1 for a in answers)
    assert httpx.get(server[0] + "/health").status_code == 200


@pytest.mark.parametrize("layout", ["one-process", "engine-process"])
def test_sigterm_lets_in_flight_requests_finish_then_exits_0(layout):
    # (a grace period no loaded CI machine runs out of: the test is about draining, not speed)
    base, proc, _ = start_server("--shutdown-timeout", "120", *(["--engine-process"] if layout == "engine-process"
                                                                else []))
    engines = child_pids(proc.pid) if layout == "engine-process" else []
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            body = {"prompt": "Tell me a story.", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
            futures = [pool.submit(lambda: httpx.post(base + "/v1/completions", json=body, timeout=60))
                       for _ in range(4)]
            deadline = time.monotonic() + 30
            while metric((base,), "vllm:num_requests_running") < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            answers = [f.result() for f in futures]
        assert [a.status_code for a in answers] == [200] * 4
        assert all(a.json()["usage"]["completion_tokens"] == 24 for a in answers)  # finished, not cut off
        assert proc.wait(timeout=30) == 0
        assert all(gone(pid) for pid in engines)  # the engine process exited, and was reaped
    finally:
        proc.kill()


# ---- the engine in a process of its own: death and shutdown across processes ----

def child_pids(pid: int) -> list[int]:
    """The live children of ``pid`` (Linux /proc)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def gone(pid: int) -> bool:
    """Exited and reaped: no process, not even a zombie."""
    return not os.path.exists(f"/proc/{pid}")


def stream_until_it_ends(base: str, started, max_tokens: int = 3000) -> tuple[list, float]:
    """One long streamed completion: (its data events, when it ended)."""
    body = {"prompt": "Tell me a long story.", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    events = []
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.release() if len(events) == 1 else None
    except httpx.TransportError as exc:  # the server exited under it: also an end
        events.append(f"transport error: {exc}")
    return events, time.monotonic()


@pytest.mark.parametrize("policy", ["exit", "refuse"])
def test_sigkill_of_the_engine_process_ends_every_stream(policy):
    """8 streams in flight, the engine process SIGKILLed: each ends within seconds with an error
    event; /health turns 503 (refuse) or the server exits 1 (exit); no child process is left."""
    import threading

    base, proc, _ = start_server("--engine-process", "--on-engine-failure", policy)
    try:
        (engine,) = child_pids(proc.pid)
        started = threading.Semaphore(0)
        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = [pool.submit(stream_until_it_ends, base, started) for _ in range(8)]
            for _ in range(8):
                assert started.acquire(timeout=60)
            os.kill(engine, signal.SIGKILL)
            killed_at = time.monotonic()
            results = [f.result(timeout=30) for f in futures]
        for events, ended in results:
            assert ended - killed_at < 10
            if events[-1] == "[DONE]":  # the error event, then the end of the stream
                assert json.loads(events[-2])["error"]["code"] == "engine_dead"
            else:  # (exit: the server may be gone before it could write that)
                assert policy == "exit" and events[-1].startswith("transport error")
        if policy == "refuse":
            assert httpx.get(base + "/health", timeout=5).status_code == 503
            # the dead engine's gauges are zero, not its last step's (its counters stay)
            for gauge in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
                assert metric((base,), gauge) == 0, gauge
            assert metric((base,), "vllm:generation_tokens_total") > 0
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        else:
            assert proc.wait(timeout=30) == 1
        assert gone(engine)
    finally:
        proc.kill()


def test_a_dead_front_takes_its_engine_process_with_it():
    base, proc, _ = start_server("--engine-process")
    (engine,) = child_pids(proc.pid)
    proc.kill()
    proc.wait(timeout=10)
    assert all_exit([engine], 15)  # (reaping it is now the job of whatever adopted it)


def all_exit(pids: list[int], timeout: float) -> bool:
    """Whether every process of ``pids`` exits within ``timeout`` seconds (reaped or a zombie)."""
    deadline = time.monotonic() + timeout
    while not all(exited(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(exited(pid) for pid in pids)


def exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "(zombie)" in f.read()
    except FileNotFoundError:
        return True


def metric_by_engine(base: str, name: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            values[engine] = float(line.rsplit(" ", 1)[1])
    return values


def metric_total(base: str, name: str) -> float:
    """A metric's value added up over all its series (engines, finish reasons...)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(base + "/metrics").text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


NUMBER_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
WEATHER_TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def constrained(base: str, headers: dict | None = None, exact: bool = True) -> list:
    """A JSON-schema answer and a required tool call, streamed and not (the grammar is compiled
    in the front and again in the engine process that runs it): (content, calls) of each.
    ``exact``: the stream says what the same request said at once (greedy in float32; in
    bfloat16 the second request's prefix-cache hit changes its sums, so only the shape is checked)."""
    ask = [{"role": "user", "content": "What is the weather in Paris? Give a number."}]
    bodies = [{"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": NUMBER_SCHEMA}}},
              {"tools": WEATHER_TOOL, "tool_choice": "required"}]
    results = []
    for body in bodies:
        body = {"messages": ask, "max_tokens": 40, "temperature": 0, **body}
        reply = httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert reply.status_code == 200, reply.text
        message = reply.json()["choices"][0]["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        results.append((message["content"], calls))
        with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}, headers=headers,
                          timeout=120) as r:
            deltas = [e["choices"][0]["delta"] for e in sse_events(r) if e != "[DONE]" and e.get("choices")]
        streamed = [(c.get("function") or {}) for d in deltas for c in d.get("tool_calls") or []]
        content = "".join(d.get("content") or "" for d in deltas) or None
        names = [f["name"] for f in streamed if f.get("name")]
        arguments = "".join(f.get("arguments") or "" for f in streamed)
        if exact:
            assert (content, names, arguments) == (message["content"], [n for n, _ in calls],
                                                   "".join(a for _, a in calls)), body
        elif "tools" in body:
            assert content is None and names == ["get_weather"] * len(names) and arguments, (content, names)
        else:
            assert isinstance(json.loads(content)["n"], int) and not names, content
    assert isinstance(json.loads(results[0][0])["n"], int) and results[1][0] is None and results[1][1]
    return results


def test_structured_outputs_and_tools_in_both_layouts(server):
    constrained(server[0], {"Authorization": f"Bearer {API_KEY}"}, exact=False)  # (the fixture's dtype is auto)


def test_only_the_first_api_server_logs_the_activity_line():
    """--api-server-count N: each front reads the engines' whole counters, so the fronts after the
    first run with --disable-log-stats (one activity line every 10 s, not N copies)."""
    from api.launcher import front_command

    argv = ["--port", "8000"]
    first, second = (front_command(argv, i, 5, [6 + i]) for i in range(2))
    assert "--disable-log-stats" not in first and second.count("--disable-log-stats") == 1
    assert second[-3:] == ["--engine-fd", "7", "--disable-log-stats"]
    assert front_command(["--disable-log-stats"], 1, 5, [6]).count("--disable-log-stats") == 1
    assert first[first.index("--listen-fd") + 1] == "5" and first[first.index("--engine-fd") + 1] == "6"


def test_data_parallel_and_several_api_servers_serve_32_streams_as_one_engine_does():
    """--data-parallel-size 2 and --api-server-count 2: 32 concurrent streamed chats give the
    same greedy text from two engines as from one engine behind two fronts; /metrics adds up
    (each engine's counters; every front's requests); SIGTERM ends every process of the server,
    and so does SIGKILL of the launcher of the API servers."""
    def run(base):
        def one(i):
            body = {"messages": [{"role": "user", "content": f"Say something about the number {i}."}],
                    "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as response:
                events = [e for e in sse_events(response) if e != "[DONE]"]
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
            return text, [e["choices"][0].get("finish_reason") or e.get("error") for e in events
                          if e.get("error") or (e.get("choices") and e["choices"][0].get("finish_reason"))]
        with ThreadPoolExecutor(max_workers=32) as pool:
            answers = list(pool.map(one, range(32)))
        assert [ends for _, ends in answers] == [["length"]] * 32, [ends for _, ends in answers]
        return [text for text, _ in answers]

    outputs = {}
    # (one engine, one front: the plain server, which most tests of this file start)
    layouts = {"data parallel": ["--data-parallel-size", "2"], "two API servers": ["--api-server-count", "2"]}
    for layout, flags in layouts.items():
        # The two layouts batch the 32 streams differently (16 an engine, or 32 in one), so: batch
        # invariance (each row's sums in an order of its own: the same bits in any batch), float32
        # (on a CPU with AMX, auto is bfloat16) and float32 activations (auto's are bf16 in steps of
        # 16+ rows on AVX512_BF16 CPUs)
        base, proc, _ = start_server("--dtype", "float32", "--activation-quantization", "none", "--batch-invariant",
                                     *flags)
        children = child_pids(proc.pid)
        try:
            outputs[layout] = run(base)
            # (a front reads the engines' counters from each step's output: the last may still be on its way)
            deadline = time.monotonic() + 10
            while metric_total(base, "vllm:generation_tokens_total") < 32 * 12 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert metric_total(base, "vllm:generation_tokens_total") == 32 * 12, (layout, httpx.get(
                base + "/metrics").text)
            (_check_two_engines if layout == "data parallel" else _check_two_fronts)(base, children)
            outputs[layout + ", constrained"] = constrained(base)
        finally:
            # SIGTERM drains the server; a launcher killed outright takes its fronts and engine along
            # (before the fronts' lifeline, they served on, orphans sharing the port)
            killed = layout == "two API servers"
            proc.send_signal(signal.SIGKILL if killed else signal.SIGTERM)
            assert proc.wait(timeout=60) == (-signal.SIGKILL if killed else 0)
        assert all_exit(children, 30), layout
    assert outputs["data parallel"] == outputs["two API servers"]
    assert outputs["data parallel, constrained"] == outputs["two API servers, constrained"]


def _check_two_engines(base: str, children: list[int]) -> None:
    """--data-parallel-size 2: two engine processes, each with its counters, its cache and its
    share of the cores (engine.transport.processes.device_shares), or the user's setting."""
    generated = metric_by_engine(base, "vllm:generation_tokens_total")
    assert set(generated) == {"0", "1"} and all(v > 0 for v in generated.values())
    # (each engine's cache, told in its ready message)
    assert metric_by_engine(base, "vllm:cache_config_info") == {"0": 1.0, "1": 1.0}
    assert len(children) == 2  # two engine processes
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // 2))).encode()
    for pid in children:
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert b"OMP_NUM_THREADS=" + threads in f.read().split(b"\0")


def _check_two_fronts(base: str, children: list[int]) -> None:
    """--api-server-count 2: two fronts (one logging stats) and the engine; whichever front
    answers, the request counter is the whole server's, and the engine's cache is told."""
    assert len(children) == 3  # two fronts and the engine
    commands = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in children]
    fronts = [c for c in commands if b"--listen-fd" in c]
    assert len(fronts) == 2 and sum(b"--disable-log-stats" in c for c in fronts) == 1  # one logs
    assert all(metric_total(base, "vllm:request_success_total") == 32 for _ in range(4))
    assert all(metric_by_engine(base, "vllm:cache_config_info") == {"0": 1.0} for _ in range(4))


def test_a_headless_engine_joins_the_server_over_tcp():
    """--data-parallel-size 2 with one local engine: the other is started apart with --headless
    (as on another machine) and joins over TCP; both serve, and both processes end cleanly."""
    for _ in range(3):  # (the RPC port may be taken between free_port and the front's bind)
        try:
            return _headless_engine_joins(free_port())
        except PortClash:
            continue
    pytest.fail("no free RPC port in 3 tries")


def _headless_engine_joins(port: int) -> None:
    # (the 8 answers are compared, batched by arrival: batch invariance, float32 weights (auto is
    # bfloat16 on a CPU with AMX) and activations (auto's are bf16 in steps of 16+ rows on
    # AVX512_BF16 CPUs))
    group = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-rpc-port", str(port),
             "--dtype", "float32", "--activation-quantization", "none", "--batch-invariant"]
    headless = subprocess.Popen([sys.executable, "-m", "engine.api", "--headless", "--backend", "torch",
                                 "--num-kv-blocks", "512", "--log-level", "warning", *group],
                                cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        base, proc, _ = start_server(*group, attempts=2)
        try:
            body = {"prompt": "Count with me: one, two,", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            with ThreadPoolExecutor(max_workers=8) as pool:
                answers = list(pool.map(lambda _: httpx.post(base + "/v1/completions", json=body, timeout=120),
                                        range(8)))
            assert [a.status_code for a in answers] == [200] * 8
            assert len({a.json()["choices"][0]["text"] for a in answers}) == 1  # greedy: the same on both engines
            generated = metric_by_engine(base, "vllm:generation_tokens_total")
            assert set(generated) == {"0", "1"} and all(v > 0 for v in generated.values())
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        assert headless.wait(timeout=30) == 0  # its engine ended when the server closed its link
    finally:
        headless.kill()


def test_a_headless_node_with_no_front_stops_on_sigint_or_says_so_in_one_line():
    """Waiting for its front, a --headless node stops on SIGINT at once and cleanly, and when no
    front ever answers it ends with one line naming the address (not a traceback)."""
    import trio

    from engine.config import EngineConfig
    from engine.errors import ConfigError
    from engine.transport.processes import run_headless

    port = free_port()  # (nobody listens there)
    headless = subprocess.Popen([sys.executable, "-m", "engine.api", "--headless", "--backend", "torch",
                                 "--data-parallel-size", "2", "--data-parallel-size-local", "1",
                                 "--data-parallel-rpc-port", str(port)], stderr=subprocess.PIPE, text=True,
                                cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        said = []
        for line in headless.stderr:  # (once it waits: trio handles the signals by then)
            said.append(line)
            if "waiting for the API server at" in line:
                break
        headless.send_signal(signal.SIGINT)
        assert headless.wait(timeout=30) == 0
        assert "Traceback" not in "".join(said) + headless.stderr.read()
    finally:
        headless.kill()
    config = EngineConfig(backend="torch", data_parallel_size=2, data_parallel_size_local=1,
                          data_parallel_rpc_port=port)
    with pytest.raises(ConfigError, match=f"no API server took this node's engines at 127.0.0.1:{port} within 1 s"):
        trio.run(run_headless, config, 1.0)


# ---- the server's life cycle, in this process (faults are injected) ----

def server_args(*flags: str):
    from api.server import build_parser

    return build_parser().parse_args(["--port", str(free_port()), "--backend", "torch", "--load-format", "dummy",
                                      "--max-model-len", "256", "--num-kv-blocks", "64", "--log-level", "warning",
                                      *flags])


def fail_the_engine_at_step(monkeypatch, step: int) -> None:
    from engine.core.engine_core import EngineCore

    real, calls = EngineCore.execute, 0

    def failing(self, plan):
        nonlocal calls
        calls += 1
        if calls == step:
            raise RuntimeError("injected device fault")
        return real(self, plan)

    monkeypatch.setattr(EngineCore, "execute", failing)


@asynccontextmanager
async def server_in_this_process(*flags: str):
    """run_server in this trio run: yields (an httpx client for it, the list its result lands in).
    A port taken between ``free_port`` and the bind is tried again with another."""
    import errno

    import trio

    from api.server import run_server

    for _ in range(5):
        args = server_args(*flags)
        outcome = []
        started = False

        async def serve(task_status=trio.TASK_STATUS_IGNORED):
            outcome.append(await run_server(args, task_status=task_status))

        try:
            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    await nursery.start(serve)
                    started = True
                    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{args.port}", timeout=30) as http:
                        yield http, outcome
            return
        except* OSError as group:  # (the bind's error sits in nested groups: subgroup walks them)
            if started or group.subgroup(lambda e: isinstance(e, OSError) and e.errno != errno.EADDRINUSE):
                raise
    pytest.fail("no free port in 5 tries")


async def test_an_engine_failure_ends_requests_and_exits_nonzero(monkeypatch):
    fail_the_engine_at_step(monkeypatch, 3)
    async with server_in_this_process() as (http, outcome):
        response = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 20, "ignore_eos": True})
        assert response.status_code == 500 and response.json()["error"]["code"] == "engine_dead"
    assert outcome == [True]  # run_server returns True and main() exits with status 1


async def test_on_engine_failure_refuse_keeps_answering_503(monkeypatch):
    import trio

    fail_the_engine_at_step(monkeypatch, 3)
    async with server_in_this_process("--on-engine-failure", "refuse") as (http, outcome):
        first = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 20, "ignore_eos": True})
        assert first.status_code == 500
        await trio.sleep(0.5)
        assert (await http.get("/health")).status_code == 503
        later = await http.post("/v1/completions", json={"prompt": "Hi"})
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_dead"
        os.kill(os.getpid(), signal.SIGTERM)  # the server's own signal handler stops it
    assert outcome == [False]


def test_sigterm_past_the_grace_period_ends_requests_cleanly_and_exits_0():
    base, proc, _ = start_server("--shutdown-timeout", "1")
    try:
        body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["code"] == "shutting_down"
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_sigterm_while_waiting_for_a_headless_engine_exits_0_with_every_child():
    """A front waiting for an engine to join over TCP (which may never come) stops on SIGTERM:
    the wait ended only with two SIGINTs, its local engine left behind."""
    for _ in range(5):  # (another process may take a free port first: then with others)
        proc = subprocess.Popen([sys.executable, "-m", "engine.api", "--port", str(free_port()), "--backend", "torch",
                                 "--num-kv-blocks", "64", "--data-parallel-size", "2", "--data-parallel-size-local",
                                 "1", "--data-parallel-rpc-port", str(free_port())],
                                cwd=os.path.dirname(os.path.dirname(__file__)), stderr=subprocess.PIPE, text=True)
        seen: list[str] = []
        tee = threading.Thread(target=_tee, args=(proc.stderr, seen), daemon=True)
        tee.start()
        deadline = time.monotonic() + 120
        while not any("to join at" in line for line in seen) and proc.poll() is None:
            assert time.monotonic() < deadline, "no wait for the headless engine"
            time.sleep(0.05)
        if proc.poll() is None:
            break
        tee.join(timeout=10)
        assert any(ADDRESS_IN_USE in line for line in seen), "the server exited during start-up"
    try:
        children = child_pids(proc.pid)
        assert children  # (the local engine)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert all_exit(children, 15)
        assert any("stopped before the engine was ready" in line for line in seen)
    finally:
        proc.kill()


async def test_a_front_of_several_stops_before_its_engine_is_ready_when_the_launcher_goes(monkeypatch):
    """A front of --api-server-count starts its HTTP server only once its engine is ready: a
    shutdown before then (here its launcher gone; SIGTERM sets the same event) must still end
    it, or the launcher waits on it for good."""
    import contextlib

    import trio

    import api.server as server
    from api.cli import build_parser

    @contextlib.asynccontextmanager
    async def loading_for_good(config, engine_fds=None):
        await trio.sleep_forever()
        yield

    monkeypatch.setattr(server, "open_engine", loading_for_good)
    listener = socket.create_server(("127.0.0.1", 0))
    read_end, write_end = os.pipe()
    try:
        args = build_parser().parse_args(["--listen-fd", str(listener.fileno()), "--launcher-fd", str(read_end)])
        async with trio.open_nursery() as nursery:
            returned = []

            async def run() -> None:
                returned.append(await server.run_server(args))

            nursery.start_soon(run)
            await trio.sleep(0.2)
            os.close(write_end)  # the launcher is gone
            write_end = None
            with trio.fail_after(10):
                while not returned:
                    await trio.sleep(0.05)
        assert returned == [False]
    finally:
        listener.close()
        if write_end is not None:
            os.close(write_end)


def test_a_second_sigint_exits_at_once():
    base, proc, _ = start_server("--shutdown-timeout", "60")
    try:
        body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()  # held: a dropped iterator closes the stream, and the drain ends
            next(lines)
            proc.send_signal(signal.SIGINT)
            # draining (the request has 60 s) once /health says 503: the first signal has been read,
            # so the second is not merged into it (trio keeps one pending signal of a number)
            deadline = time.monotonic() + 10
            while httpx.get(base + "/health", timeout=10).status_code != 503:
                assert time.monotonic() < deadline, "the first SIGINT was not acted on"
                time.sleep(0.05)
            assert proc.poll() is None
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=10) == 130
    finally:
        proc.kill()


# ---- bench/serve.py against the real server ----

def load_bench_serve():
    return load_script("bench/serve.py")


TABLE_LABELS = ["Successful requests:", "Failed requests:", "Maximum request concurrency:", "Benchmark duration (s):",
                "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):",
                "Output token throughput (tok/s):", "Total Token throughput (tok/s):"]


def test_bench_serve_reports_every_metric_with_the_servers_token_counts(server, tmp_path, capsys):
    bench = load_bench_serve()
    generated_before = metric(server, "vllm:generation_tokens_total")
    result_file = tmp_path / "result.json"
    bench.main(["--base-url", server[0], "--api-key", API_KEY, "--random-input-len", "24", "--random-output-len", "6",
                "--num-prompts", "6", "--max-concurrency", "3", "--ignore-eos", "--disable-tqdm",
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                "--save-result", "--result-filename", str(result_file)])
    table = capsys.readouterr().out
    for label in TABLE_LABELS:
        assert label in table, label
    for name in ("TTFT", "TPOT", "ITL", "E2EL"):
        for stat in ("Mean", "Median", "P50", "P99"):
            assert f"{stat} {name} (ms):" in table, (stat, name)
    result = json.loads(result_file.read_text())
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert result[f"{stat}_{name}_ms"] > 0 or stat == "std", (stat, name)
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["total_output_tokens"] == 36 == metric(server, "vllm:generation_tokens_total") - generated_before
    assert result["total_input_tokens"] == sum(result["input_lens"]) and all(n >= 20 for n in result["input_lens"])
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput"):
        assert result[key] > 0, key


def test_bench_serve_times_every_chunk_that_answers_a_step():
    carries = load_bench_serve().carries_tokens
    assert carries({"choices": [{"index": 0, "text": "", "finish_reason": None}]})  # a token with no text yet
    assert carries({"choices": [{"index": 0, "delta": {"content": ""}}]})
    assert carries({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    assert carries({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]})  # echo
    assert not carries({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})  # opening
    assert not carries({"choices": [], "usage": {"completion_tokens": 3}})


def test_bench_serve_counts_failed_requests_and_sweeps(server, capsys):
    bench = load_bench_serve()
    common = ["--base-url", server[0], "--api-key", API_KEY, "--random-output-len", "4", "--ignore-eos",
              "--disable-tqdm"]
    failed = bench.main([*common, "--random-input-len", "9000", "--num-prompts", "2"])  # past max_model_len
    assert (failed["completed"], failed["failed"]) == (0, 2) and "HTTP 400" in failed["errors"][0]
    sweep = bench.main([*common, "--random-input-len", "16", "--num-prompts", "4", "--sweep", "1,2",
                        "--tpot-bound-ms", "100000"])
    lines = capsys.readouterr().out.splitlines()
    assert [lv["max_concurrency"] for lv in sweep["levels"]] == [1, 2] and sweep["capacity"] == 2
    assert any(line.split()[:2] == ["1", "100.0%"] for line in lines) and "capacity: concurrency 2" in lines[-1]


def test_serving_on_cpu_caps_the_prefill_that_joins_a_decoding_step():
    from api.server import build_parser, engine_config
    from engine.config import SERVING_CPU_MIXED_PREFILL_PER_DECODE, EngineConfig
    from engine.errors import ConfigError

    def config(*argv):
        c = engine_config(build_parser().parse_args(list(argv)))
        return c.max_num_mixed_prefill_tokens, c.mixed_prefill_per_decode

    assert config("--device", "cpu") == (None, SERVING_CPU_MIXED_PREFILL_PER_DECODE)
    assert config("--device", "cpu", "--max-num-mixed-prefill-tokens", "64") == (64, None)  # a fixed cap alone
    assert config("--device", "cpu", "--mixed-prefill-per-decode", "0.5") == (None, 0.5)
    config_ = EngineConfig()  # offline and embedded engines are uncapped
    assert (config_.max_num_mixed_prefill_tokens, config_.mixed_prefill_per_decode) == (None, None)
    for bad in (0, -1.0, float("inf"), float("nan"), "1", True):
        with pytest.raises(ConfigError):
            EngineConfig(mixed_prefill_per_decode=bad)
