"""The Responses API (POST /v1/responses) through the official openai client: text equal to
chat completions, every response and streamed event valid against OpenAI's schemas, a
function-call round trip with no server state, text.format, the optional store, and bad
input as OpenAI-shaped 400s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from api.app import ServerState
from api.errors import APIError
from api.protocol import ResponsesRequest
from api.responses import (
    ResponseStore,
    StoredResponse,
    check_request,
    input_item_resources,
    input_messages,
    item_page,
    responses_usage,
)
from api.serving import usage
from tests.conftest import ThreadedServer, serve_http
from tests.openapi_schemas import OpenAISchemas
from tests.test_app import error, post
from tests.test_reasoning import QWEN3, THINKING_TEMPLATE

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                          "required": ["city"], "additionalProperties": False}}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def schemas() -> OpenAISchemas:
    return OpenAISchemas()


@pytest.fixture
def live(llm):
    server = ThreadedServer(llm.engine, llm.tokenizer)
    yield server
    server.close()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)


def _events(server, body: dict) -> list[dict]:
    """A streamed response's events, each checked against its SSE event name."""
    events, name = [], None
    with httpx.stream("POST", server.base_url + "/v1/responses", json={**body, "stream": True},
                      timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] == name
                events.append(event)
    return events


def _check_stream(schemas: OpenAISchemas, events: list[dict]) -> dict:
    """Every event valid and numbered in order; the deltas add up to the final response."""
    for event in events:
        schemas.validate_response_event(event)
        schemas.validate("ResponseStreamEvent", event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all(e["delta"] for e in events if e["type"].endswith(".delta"))  # (an empty one says nothing)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    final = events[-1]["response"]
    schemas.validate("Response", final)
    texts: dict[str, str] = {}
    for event in events:
        if event["type"] in ("response.output_text.delta", "response.reasoning_text.delta",
                             "response.function_call_arguments.delta"):
            texts[event["item_id"]] = texts.get(event["item_id"], "") + event["delta"]
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert added == [item["id"] for item in done] == [item["id"] for item in final["output"]]
    assert done == final["output"]
    for item in final["output"]:
        whole = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        assert texts.get(item["id"], "") == whole
    return final


@pytest.mark.slow
def test_text_equals_chat_completions_streamed_and_not(live, schemas):
    client = _client(live)
    chat = client.chat.completions.create(model="tiny", messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}],
        temperature=0, max_tokens=24)
    body = dict(model="tiny", instructions="You are terse.", input="Name three colours.", temperature=0,
                max_output_tokens=24)
    response = client.responses.create(**body)
    schemas.validate("Response", response.model_dump(mode="json", exclude_unset=True, by_alias=True))
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"

    final = _check_stream(schemas, _events(live, body))
    assert final["output_text"] == response.output_text and final["status"] == response.status
    assert [e.type for e in client.responses.create(**body, stream=True)][-1] == f"response.{response.status}"

    # Given room, it completes.
    done = client.responses.create(**{**body, "max_output_tokens": 200})
    assert done.status == "completed" and done.incomplete_details is None


@pytest.mark.slow
def test_a_function_call_round_trip_with_the_history_sent_back_as_items(live, schemas):
    client = _client(live)
    body = dict(model="tiny", input=QUESTION, tools=[WEATHER], tool_choice="required", temperature=0,
                max_output_tokens=60)
    response = client.responses.create(**body)
    schemas.validate("Response", response.model_dump(mode="json", exclude_unset=True, by_alias=True))
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    assert not [item for item in response.output if item.type == "message"]  # required: calls only

    final = _check_stream(schemas, _events(live, body))
    assert [(i["name"], i["arguments"]) for i in final["output"]] == [(c.name, c.arguments) for c in calls]

    # The second turn: the whole conversation as input items, nothing kept on the server.
    history = [{"role": "user", "content": QUESTION},
               *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                 for c in calls],
               *[{"type": "function_call_output", "call_id": c.call_id, "output": "22 degrees and sunny"}
                 for c in calls]]
    answer = client.responses.create(model="tiny", input=history, tools=[WEATHER], temperature=0,
                                     max_output_tokens=40)
    assert answer.status in ("completed", "incomplete") and answer.output
    # The prompt it answered is the chat conversation of those items.
    chat_history = [{"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                        for c in calls]},
                    *[{"role": "tool", "tool_call_id": c.call_id, "content": "22 degrees and sunny"} for c in calls]]
    chat = client.chat.completions.create(model="tiny", messages=chat_history, temperature=0, max_tokens=40,
                                          tools=[{"type": "function", "function": {
                                              k: WEATHER[k] for k in ("name", "description", "parameters")}}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.output_text == (chat.choices[0].message.content or "")


@pytest.mark.slow
def test_text_format_json_schema_gives_valid_json(live, schemas):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 20},
                                               "count": {"type": "integer"}},
              "required": ["colour", "count"], "additionalProperties": False}
    client = _client(live)
    response = client.responses.create(model="tiny", input="Give a colour and a count as JSON.", temperature=0,
                                       max_output_tokens=60, text={"format": {
                                           "type": "json_schema", "name": "answer", "schema": schema,
                                           "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    schemas.validate("Response", response.model_dump(mode="json", exclude_unset=True, by_alias=True))
    assert response.text.format.type == "json_schema"


@pytest.mark.slow
def test_reasoning_comes_back_as_a_reasoning_item(llm, schemas):
    server = ThreadedServer(llm.engine, llm.tokenizer, chat_template=THINKING_TEMPLATE, reasoning_parser=QWEN3)
    try:
        body = dict(input="What is 2 + 3?", temperature=0, max_output_tokens=40, thinking_token_budget=6,
                    reasoning={"effort": "low"})
        response = httpx.post(server.base_url + "/v1/responses", json=body, timeout=300).json()
        schemas.validate("Response", response)
        kinds = [item["type"] for item in response["output"]]
        assert kinds[0] == "reasoning" and response["output"][0]["content"][0]["text"]
        assert 1 <= response["usage"]["output_tokens_details"]["reasoning_tokens"] <= 6
        final = _check_stream(schemas, _events(server, body))
        assert [i["type"] for i in final["output"]] == kinds
        assert final["output"][0]["content"] == response["output"][0]["content"]
        assert final["output_text"] == response["output_text"]
    finally:
        server.close()


@pytest.mark.slow
def test_the_store_continues_a_conversation_and_forgets_the_oldest(llm, schemas):
    server = ThreadedServer(llm.engine, llm.tokenizer, responses=ResponseStore(2))
    client = _client(server)
    try:
        first = client.responses.create(model="tiny", input="My name is Ada.", temperature=0, max_output_tokens=16,
                                        text={"format": None})  # (null: the default)
        assert first.store and first.text.format.type == "text"
        again = client.responses.retrieve(first.id)
        assert again.model_dump() == first.model_dump()
        items = httpx.get(f"{server.base_url}/v1/responses/{first.id}/input_items", timeout=30).json()
        schemas.validate("ResponseItemList", items)
        assert [(i["type"], i["role"], i["content"]) for i in items["data"]] == [
            ("message", "user", [{"type": "input_text", "text": "My name is Ada."}])]
        assert items["first_id"] == items["last_id"] == items["data"][0]["id"] and not items["has_more"]
        with pytest.raises(openai.BadRequestError, match="only background responses"):
            client.responses.cancel(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.cancel("resp_unknown")
        second = client.responses.create(model="tiny", input="What is my name?", previous_response_id=first.id,
                                         temperature=0, max_output_tokens=16)
        # The same conversation sent whole gives the same prompt.
        history = [{"role": "user", "content": "My name is Ada."},
                   {"role": "assistant", "content": first.output_text},
                   {"role": "user", "content": "What is my name?"}]
        whole = client.responses.create(model="tiny", input=history, temperature=0, max_output_tokens=16,
                                        store=False)
        assert not whole.store
        assert second.usage.input_tokens == whole.usage.input_tokens
        assert second.output_text == whole.output_text
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(whole.id)  # store: false
        client.responses.create(model="tiny", input="x", temperature=0, max_output_tokens=2)  # a third: first goes
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        response = httpx.delete(f"{server.base_url}/v1/responses/{second.id}", timeout=30)
        assert response.json() == {"id": second.id, "object": "response", "deleted": True}
        missing = httpx.get(f"{server.base_url}/v1/responses/{second.id}", timeout=30)
        assert missing.status_code == 404
        schemas.validate("ErrorResponse", missing.json())
        # Continuing it: OpenAI's 400 with the code clients resend the whole conversation on
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="tiny", input="x", previous_response_id=second.id)
        assert (refused.value.code, refused.value.param) == ("previous_response_not_found", "previous_response_id")
        assert refused.value.type == "invalid_request_error" and second.id in refused.value.message
    finally:
        server.close()


def test_input_items_are_listed_a_page_at_a_time_in_either_order(schemas):
    items = input_item_resources([{"role": "system", "content": "Be brief."},
                                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
                                  {"role": "assistant", "content": "b", "id": "msg_given"},
                                  {"type": "function_call_output", "call_id": "c1", "output": "x"}])
    assert items[0]["content"] == [{"type": "input_text", "text": "Be brief."}]
    assert items[2]["content"] == [{"type": "output_text", "text": "b", "annotations": [], "logprobs": []}]
    assert items[2]["id"] == "msg_given" and items[2]["status"] == "completed"
    assert items[3]["id"].startswith("fco_") and len({i["id"] for i in items}) == 4
    schemas.validate("ResponseItemList", item_page(items, 10, "asc", None))
    ids = [i["id"] for i in items]
    first = item_page(items, 3, "desc", None)
    assert [i["id"] for i in first["data"]] == ids[::-1][:3] and first["has_more"]
    rest = item_page(items, 3, "desc", first["last_id"])
    assert [i["id"] for i in rest["data"]] == ids[:1] and not rest["has_more"] and rest["first_id"] == ids[0]
    assert [i["id"] for i in item_page(items, 2, "asc", ids[1])["data"]] == ids[2:]
    assert item_page(items, 5, "asc", ids[-1]) == {"object": "list", "data": [], "first_id": None,
                                                   "last_id": None, "has_more": False}
    with pytest.raises(APIError, match="after"):
        item_page(items, 5, "asc", "msg_unknown")


def test_input_items_sent_in_any_form_are_listed_as_openai_describes_them(schemas):
    """Assistant turns sent back without a status or their parts' annotations, calls and their
    outputs without a status, an id sent as null: listed complete (OpenAI's ItemResource)."""
    items = input_item_resources([
        {"role": "user", "content": "hi", "id": None},
        {"role": "assistant", "content": "plain"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "t", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "res", "status": "incomplete"}])
    page = item_page(items, 10, "asc", None)
    schemas.validate("ResponseItemList", page)
    assert page["first_id"].startswith("msg_") and all(item["id"] for item in items)
    assert [item["status"] for item in items] == ["completed"] * 4 + ["incomplete"]  # (a status sent is kept)
    assert items[2]["content"] == [{"type": "output_text", "text": "t", "annotations": [], "logprobs": []}]
    [empty] = input_item_resources([{"role": "user", "content": None}])  # (null content: no text)
    assert empty["content"] == [{"type": "input_text", "text": ""}]
    # parts of chat's type "text", or of the other side's type, and a reasoning item sent back
    # with its content alone: listed in the types the spec gives each role, with a summary
    items = input_item_resources([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "output_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "c"}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "more"}], "summary": None}])
    schemas.validate("ResponseItemList", item_page(items, 10, "asc", None))
    assert items[0]["content"] == [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    assert items[1]["content"] == [{"type": "output_text", "text": "c", "annotations": [], "logprobs": []}]
    assert items[2]["summary"] == items[3]["summary"] == []


def test_a_store_keeps_at_most_its_capacity():
    store = ResponseStore(2)
    for i in range(3):
        store.put(StoredResponse({"id": f"r{i}"}, []))
    assert len(store) == 2
    assert store.get("r2").response == {"id": "r2"}


# ---- bad input, no model ----

class _Client:
    """Enough of an engine client for requests refused before any tokenizing."""

    errored = False


@pytest.mark.parametrize("body, param, words", [
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input", "'web_search_call' are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "'input_image'"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input", "call_id, name and arguments"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", "role must be one of"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "--enable-responses-store"),
    ({"input": "x", "store": True}, "store", "--enable-responses-store"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": "x", "truncation": "auto"}, "truncation", "truncation"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "--reasoning-parser"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text", "text.format type"),
    ({"input": "x", "text": {"format": "json"}}, "text", "got 'json' (text.format is an object with a type)"),
    ({"input": [{"role": "user", "content": "x", "id": 5}]}, "input", "input[0].id must be a string; got 5"),
    ({"input": 5}, "input", "input"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "stored prompt templates"),
    ({}, "input", "input"),
    ({"input": "x", "reasoning": {"effort": "bogus"}}, "reasoning", "reasoning.effort must be one of"),
    ({"input": "x", "include": ["bogus"]}, "include", "unknown value 'bogus'"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "string"}}}}, "text",
     "text.format of type 'json_schema' needs a name"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p"}}}, "text", "and a schema"),
    # OpenAI's bounds on metadata: 16 pairs, keys of 64 characters, values of 512
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16 pairs; got 17"),
    ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata", "keys are at most 64 characters"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata", "values are at most 512 characters"),
    ({"input": "x", "reasoning": {"summary": "bogus"}}, "reasoning", "reasoning.summary must be one of auto"),
    ({"input": "x", "text": {"verbosity": "loud"}}, "text", "text.verbosity must be one of low"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools",
     "tools[0].strict must be a boolean or null"),
    ({"input": "x", "tool_choice": {"name": "f"}}, "tool_choice", "a tool_choice object needs a type"),
])
async def test_bad_input_is_a_400_naming_the_field(body, param, words):
    status, data = await post(ServerState("m", client=_Client()), "/v1/responses", body)
    assert status == 400, data
    err = error(data)
    assert err["param"] == param and words in err["message"], err


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": "bogus"}, "tool_choice", "one of none, auto, required or a named function; got 'bogus'"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function"}},
     "tool_choice", 'a named tool_choice is {"type": "function", "name": "..."}'),
    ({"tools": [{"type": "function", "name": "no spaces"}]}, "tools", "tools[0].name must be 1 to 64"),
    ({"tools": [{"type": "function", "name": "f", "description": 5}]}, "tools", "tools[0].description must be"),
])
async def test_the_tools_errors_speak_of_responses_tools(tiny_vocab_core, tokenizer, body, param, words):
    """Checked by chat's tool code, told in the Responses shape (a flat tool, no "function")."""
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        response = await server.http.post("/v1/responses", json={"input": "x", **body})
    assert response.status_code == 400, response.text
    err = error(response.content)
    assert err["param"] == param and words in err["message"] and "function." not in err["message"], err


@pytest.mark.parametrize("tools", [None, []])
async def test_tool_choice_auto_without_tools_is_the_default_it_reads(tiny_vocab_core, tokenizer, tools):
    """``auto`` is the Responses API's default, echoed in every response: sent (back) with no
    tools it is accepted, as OpenAI takes it; ``required`` still needs tools."""
    body = {"input": "x", "max_output_tokens": 16, "tool_choice": "auto", **({} if tools is None else {"tools": tools})}
    async with serve_http(tiny_vocab_core, tokenizer) as server:
        response = await server.http.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["tool_choice"] == "auto" and response.json()["status"] in ("completed", "incomplete")
        refused = await server.http.post("/v1/responses", json={**body, "tool_choice": "required"})
    assert refused.status_code == 400 and error(refused.content)["param"] == "tool_choice"


def test_metadata_at_openais_bounds_is_accepted():
    check_request(ResponsesRequest(input="x", metadata={f"{i:064d}": "v" * 512 for i in range(16)}), None, False)


def test_a_tools_strict_of_null_is_the_default():
    """OpenAI's FunctionTool.strict is a boolean or null (SDKs send unset fields as null)."""
    from api.responses import response_head

    req = ResponsesRequest(input="x", tools=[{"type": "function", "name": "f", "strict": None}])
    check_request(req, None, False)
    assert response_head(req, "resp_x", "m", stored=False)["tools"][0]["strict"] is True


def test_input_items_become_a_chat_conversation():
    messages = input_messages([
        {"role": "developer", "content": "Be brief."},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                        {"type": "input_text", "text": "there"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
    ])
    assert messages == [
        {"role": "developer", "content": "Be brief."},
        {"role": "assistant", "content": "I cannot."},  # (OpenAI's refusal part, read as its text)
        {"role": "user", "content": "Hi\nthere"},  # (text parts one per line, as in chat messages)
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hmm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]


def test_a_reasoning_item_goes_with_the_assistant_turn_right_after_it():
    """Or, where none follows (an answer cut off while it reasoned), is an empty turn of its own,
    as previous_response_id continues such a response."""
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "h"}]}
    assert input_messages([reasoning, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]) == [
        {"role": "assistant", "content": "", "reasoning_content": "h"}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo"}]
    assert input_messages([reasoning, {"role": "assistant", "content": "Yo"}]) == [
        {"role": "assistant", "content": "Yo", "reasoning_content": "h"}]


# ---- building the output (no model) ----

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _built(pieces: list[str], reasoning: bool = False) -> tuple[dict, list[dict]]:
    from api.responses import ResponseBuilder
    from api.serving import OutputSplitter, ReasoningPlan
    from engine.reasoning import Opening
    from tests.test_reasoning import QWEN3 as parser

    plan = ReasoningPlan(parser, Opening.REASONING, lambda ids: "") if reasoning else None
    splitter = OutputSplitter(plan, tools=True)
    builder = ResponseBuilder(_head())
    events = builder.start()
    for i, piece in enumerate(pieces):
        events += builder.feed(splitter.feed(piece, final=i == len(pieces) - 1))
    response, last = builder.finish(responses_usage(usage(3, len(pieces), 0)), cut_off=False)
    return response, events + last


@pytest.mark.parametrize("text, kinds", [
    ("Sure." + CALL + "\nBye", ["message", "function_call", "message"]),
    (CALL + "\n" + CALL, ["function_call", "function_call"]),
    ("thinking</think>" + CALL + "after", ["reasoning", "function_call", "message"]),
    ("", ["message"]),
])
def test_items_come_in_the_order_written_streamed_or_not(schemas, text, kinds):
    reasoning = "</think>" in text
    whole, _ = _built([text], reasoning)
    assert [item["type"] for item in whole["output"]] == kinds
    texts = [item["content"][0]["text"] for item in whole["output"] if item["type"] == "message"]
    assert texts == [t for t in ("Sure.", "Bye", "after") if t in text] or texts == [""]
    for cut in range(len(text) + 1):
        response, events = _built([text[:cut], text[cut:]], reasoning)
        if cut % 8 == 0:  # (validating every event is the slow part)
            _check_stream(schemas, events)
        assert _without_ids(response) == _without_ids(whole)
    response, events = _built(list(text) + [""], reasoning)  # a character at a time
    assert _without_ids(response) == _without_ids(whole)


def test_an_output_cut_off_while_reasoning_continues_alike_by_id_or_sent_back():
    from api.responses import output_messages

    response, _ = _built(["still thinking"], reasoning=True)
    assert [item["type"] for item in response["output"]] == ["reasoning"]
    question = {"role": "user", "content": "And?"}
    assert output_messages(response["output"]) + [question] == input_messages(response["output"] + [question])


@pytest.mark.parametrize("text", ["Sure.\n" + CALL + "\nAnd also:\n" + CALL, CALL + "\nDone.", "Plain."])
def test_an_output_continues_as_chat_says_it_by_id_or_sent_back(text):
    """The assistant turn a later response continues (previous_response_id: output_messages) is
    the one the same output items sent back as input make, and its content chat's: text after
    a call joined by the newline its message item starts without."""
    from api.responses import output_messages
    from api.serving import OutputSplitter

    response, _ = _built([text])
    by_id = output_messages(response["output"])
    sent_back = input_messages([{k: v for k, v in item.items() if k != "status"} for item in response["output"]])
    assert by_id == sent_back and len(by_id) == 1
    chat = OutputSplitter(None, tools=True).feed(text, final=True)
    assert by_id[0]["content"] == "".join(piece for piece in chat.pieces if isinstance(piece, str))
    assert len(by_id[0].get("tool_calls", ())) == text.count(CALL)


def _head() -> dict:
    from api.protocol import ResponsesRequest
    from api.responses import response_head

    return response_head(ResponsesRequest(input="x"), "resp_x", "m", stored=False)


def _without_ids(response: dict) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]


def test_a_stream_that_fails_ends_with_error_then_response_failed(schemas):
    from api.errors import APIError
    from api.responses import ResponseBuilder

    from api.serving import SplitDelta

    builder = ResponseBuilder(_head())
    events = builder.start() + builder.feed(SplitDelta(content="Hel", pieces=("Hel",)))
    events += builder.fail(APIError(500, "the engine failed while serving this request", type="server_error",
                                    code="engine_dead"))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["output"][0]["status"] == "incomplete" and failed["output"][0]["content"][0]["text"] == "Hel"
    for event in events:
        schemas.validate_response_event(event)
