"""The HTTP app in-process (no model): 503 while loading or after an engine failure, and a
500 that carries no traceback."""

from __future__ import annotations

import orjson

from api.app import ServerState, create_app

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
