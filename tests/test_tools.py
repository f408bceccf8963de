"""Tool calling: tools in the prompt, the call grammar, calls read back (streamed and not), the
finish reasons, bad tool fields as 400s, and the whole tool_choice x parallel_tool_calls x
stream matrix through the official openai client."""

from __future__ import annotations

import json
import math
import random
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from engine.errors import InvalidParameterError
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.structured_outputs import StructuredOutputManager
from engine.tools import (ARGUMENTS_BEGIN, CALL_BEGIN, ToolCallParser, parse_tool_calls, plan_tools, prepare_messages,
                          template_renders_tools)
from tests.conftest import NEAR_TIE, ThreadedServer


def function(name: str, parameters: dict, description: str = "") -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TOOLS = [
    function("get_weather", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]},
        "The current weather in a city"),
    function("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                     "required": ["a", "b"], "additionalProperties": False}, "The sum of two integers"),
    function("search", {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 60},
        "max_results": {"type": "integer", "minimum": 1, "maximum": 10}}, "required": ["query"]},
        "Search the web"),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def assert_well_formed(calls: list[dict], label: str) -> None:
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_"), label
        name = call["function"]["name"]
        assert name in SCHEMAS, f"{label}: {name}"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


# ---- reading calls back (no model) ----

TEXTS = ["Hello there\n", "Sure.\n" + CALL + "\n" + CALL + "\n", "A" + CALL + "\n<tool b", "A" + CALL + "\n\nThen.  \n",
         CALL + " x", "  lead" + CALL, '<tool_call>\n{"name": "add", "arguments": {"a": "x}\\n</tool"', "a <tool b",
         '<tool_call>\n{"name": "ad', "<tool_call>\n", CALL[:-3]]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_add_up_to_the_whole_text_read_at_once(text):
    whole_content, whole_calls = parse_tool_calls(text)
    rng = random.Random(text)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        parser, content, calls = ToolCallParser(), "", []
        for k, piece in enumerate(pieces):
            delta = parser.feed(piece, final=k == len(pieces) - 1)
            content += delta.content
            for call in delta.calls:
                if call.name is not None:  # the header comes once, first
                    assert call.index == len(calls) and call.id
                    calls.append([call.name, ""])
                calls[call.index][1] += call.arguments
        assert (content or None) == whole_content, pieces
        assert calls == [[c["function"]["name"], c["function"]["arguments"]] for c in whole_calls], pieces


def test_a_call_cut_off_in_its_framing_is_no_content():
    for calls_only in (False, True):  # a whole <tool_call> tag at the end is a call's framing
        parser = ToolCallParser(calls_only)
        delta = parser.feed(CALL + "\n<tool_call>", final=True)
        assert delta.content == "" and len(parser.calls) == 1
        parser = ToolCallParser(calls_only)
        assert parser.feed("Hi <tool_call>\n{\"na", final=True).content == "Hi" and not parser.calls
    # Shorter pieces of framing: calls only, they are framing; else they may be text.
    assert ToolCallParser(calls_only=True).feed(CALL + "\n<tool", final=True).content == ""
    assert ToolCallParser().feed("a <tool", final=True).content == "a <tool"


def test_content_is_the_text_around_calls_without_separating_whitespace():
    assert parse_tool_calls("Hello there\n") == ("Hello there\n", [])  # no call: the text as it is
    content, calls = parse_tool_calls("Sure.\n" + CALL + "\n" + CALL + "\n")
    assert content == "Sure." and [c["function"]["arguments"] for c in calls] == ['{"a": 1, "b": 2}'] * 2
    assert parse_tool_calls("A" + CALL + "\n\nThen.  \n")[0] == "A\nThen."
    assert parse_tool_calls(CALL)[0] is None
    # Cut off inside the arguments: the call keeps what it has; before its name is whole: no call.
    assert parse_tool_calls(CALL[:-3])[1][0]["function"]["arguments"] == '{"a": 1, "b": 2}'
    assert parse_tool_calls(CALL[:-25])[1][0]["function"]["arguments"] == '{"a":'
    assert parse_tool_calls('<tool_call>\n{"name": "ad') == (None, [])


def test_finish_reasons():
    auto, required = plan_tools(TOOLS, "auto"), plan_tools(TOOLS, "required")
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert auto.finish_reason("stop", 1) == required.finish_reason("stop", 2) == "tool_calls"
    assert auto.finish_reason("stop", 0) == "stop" and named.finish_reason("stop", 1) == "stop"
    assert required.finish_reason("length", 1) == "length"


# ---- the request's tool fields (no model) ----

@pytest.mark.parametrize("tools, choice, param, message", [
    (None, "auto", "tool_choice", "only allowed when tools"),
    ([], "required", "tool_choice", "only allowed when tools"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "not in tools"),
    (TOOLS, {"type": "function"}, "tool_choice", "named tool_choice"),
    (TOOLS, "sometimes", "tool_choice", "must be one of"),
    ([{"type": "function", "function": {"parameters": {}}}], None, "tools", "name must be"),
    ([function("has space", {})], None, "tools", "name must be"),
    ([{"type": "code_interpreter"}], None, "tools", "function tools only"),
    ([function("f", {"type": "object", "not": {}})], None, "tools", "cannot enforce: /: not"),
    ([function("f", {}), function("f", {})], None, "tools", "same name"),
    ([function("f", [])], None, "tools", "JSON schema object"),
    ([function("f", {"type": "string"})], None, "tools", "must describe an object .* got type 'string'"),
])
def test_bad_tool_fields_name_the_field(tools, choice, param, message):
    with pytest.raises(InvalidParameterError, match=message) as info:
        plan_tools(tools, choice)
    assert info.value.param == param


def test_no_tools_or_tool_choice_none_is_no_plan_or_no_grammar():
    assert plan_tools(None) is None and plan_tools([], "none") is None
    none = plan_tools(TOOLS, "none")
    assert none.structural_tag() is None and none.described == () and not none.may_call
    assert [t.name for t in none.in_prompt] == ["get_weather", "add", "search"]  # (a template that renders them)
    assert plan_tools(TOOLS).choice == "auto"  # OpenAI's default when tools are given


@pytest.fixture(scope="module")
def manager(tokenizer):
    return StructuredOutputManager(tokenizer, 49152)


@pytest.mark.parametrize("choice, parallel, accepted, refused", [
    ("auto", True, ["Hello", CALL, "Hi " + CALL, CALL + "\n" + CALL + " bye"], ['<tool_call>\n{"name": "nope"']),
    ("auto", False, ["Hello", "Hi " + CALL], [CALL + "\n" + CALL, CALL + " bye"]),
    ("required", True, [CALL, CALL + "\n" + CALL, CALL + "\n"], ["Hello", "Hi " + CALL, CALL + " bye", CALL + "\n" + CALL + " bye",
                                                   " " + CALL]),
    ("required", False, [CALL, CALL + "\n"], ["Hello", CALL + "\n" + CALL, CALL + " bye"]),
    ("add", True, [CALL], ["Hello", CALL.replace("add", "search"), CALL + "\n" + CALL]),
])
def test_the_call_grammar_follows_tool_choice_and_parallel_tool_calls(manager, choice, parallel, accepted, refused):
    tool_choice = choice if choice in ("auto", "required") else {"type": "function", "function": {"name": choice}}
    plan = plan_tools(TOOLS, tool_choice, parallel)
    compiled = manager.compile(plan.constrain(SamplingParams()).structured_outputs)

    def complete(text: str) -> bool:
        matcher = compiled.matcher([])._matcher
        return matcher.accept_string(text) and matcher.is_completed()

    for text in accepted:
        assert complete(text), text
    for text in refused:
        assert not complete(text), text
    bad_arguments = CALL.replace('"b": 2', '"b": "two"')
    assert not complete(bad_arguments)


@pytest.mark.parametrize("parameters", [{}, None, {"properties": {"a": {"type": "integer"}}}])
def test_a_tool_of_undescribed_parameters_takes_an_object_of_arguments(manager, parameters):
    """Parameters {} (or none, or properties without a type) still make the arguments an object
    (clients json.loads them into a dict): a list, a string or a number is refused."""
    tool = {"type": "function", "function": {"name": "ping", **({} if parameters is None else {"parameters": parameters})}}
    plan = plan_tools([tool], "required")
    compiled = manager.compile(plan.constrain(SamplingParams()).structured_outputs)
    for arguments, ok in [("{}", True), ('{"a": 1}', True), ("[1]", False), ('"x"', False), ("3", False)]:
        matcher = compiled.matcher([])._matcher
        text = f'<tool_call>\n{{"name": "ping", "arguments": {arguments}}}\n</tool_call>'
        assert (matcher.accept_string(text) and matcher.is_completed()) == ok, arguments


def test_auto_with_response_format_is_either_that_json_or_calls(manager):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    compiled = manager.compile(plan_tools(TOOLS, "auto").constrain(params).structured_outputs)
    for text, ok in [('{"answer": 5}', True), (CALL, True), ("Hello", False), ('{"answer": "five"}', False)]:
        matcher = compiled.matcher([])._matcher
        assert (matcher.accept_string(text) and matcher.is_completed()) == ok, text
    required = plan_tools(TOOLS, "required").constrain(params).structured_outputs  # overrides the format
    assert required.kind == "structural_tag" and '"answer"' not in required.key()


# ---- the prompt ----

HISTORY = [
    {"role": "user", "content": "Add 1 and 2, and 3 and 4."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    {"role": "tool", "tool_call_id": "call_2", "content": "7"},
]


def test_a_template_without_tools_gets_them_in_the_system_message_and_history_as_text(tokenizer):
    assert not template_renders_tools(tokenizer)  # the default model's ChatML
    messages, kwargs = prepare_messages(HISTORY, plan_tools(TOOLS), renders_tools=False)
    assert kwargs == {}
    assert messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert "<tool_call>" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": CALL + "\n" + CALL.replace("1", "3").replace("2", "4")}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>\n"
                                                      "<tool_response>\n7\n</tool_response>"}
    system = [{"role": "system", "content": "Be brief."}, *HISTORY]
    merged, _ = prepare_messages(system, plan_tools(TOOLS), renders_tools=False)
    assert merged[0]["content"].startswith("Be brief.\n\n# Tools")
    assert [m["role"] for m in merged] == ["system", "user", "assistant", "user"]
    none, _ = prepare_messages(HISTORY, plan_tools(TOOLS, "none"), renders_tools=False)
    assert none[0]["role"] == "user"  # tool_choice none: no tools in the prompt


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments.a }}]{% endfor %}\n"
    "{% endfor %}")


def test_a_template_that_renders_tools_gets_them_and_call_arguments_as_objects(tokenizer):
    assert template_renders_tools(tokenizer, TOOL_TEMPLATE)
    messages, kwargs = prepare_messages(HISTORY, plan_tools(TOOLS), renders_tools=True)
    assert [t["function"]["name"] for t in kwargs["tools"]] == ["get_weather", "add", "search"]
    text = tokenizer.apply_chat_template(messages, chat_template=TOOL_TEMPLATE, tokenize=False, **kwargs)
    assert text.startswith("TOOLS:get_weather;add;search;") and "[add 1][add 3]" in text
    assert "tool: 7" in text



# Written for this test in the manner of Hermes 2 Pro's tool template: each tool's description and
# each parameter's, joined with `+` (which fails on a missing one rather than printing nothing).
DESCRIBING_TEMPLATE = (
    "{% for t in tools or [] %}{{ '- ' + t.function.name + ': ' + t.function.description }}"
    "{% for name, p in t.function.parameters.properties.items() %}{{ ' (' + name + ': ' + p.description + ')' }}"
    "{% endfor %}\n{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}\n{% endfor %}")


def test_a_template_that_describes_each_tool_and_parameter_is_given_the_tools(tokenizer):
    """A template that fails on a tool without a description still renders tools: the engine
    probes it with a described one, and passes the request's tools as requests give them (name,
    description, parameters, in that order: json-printing templates print that order)."""
    assert template_renders_tools(tokenizer, DESCRIBING_TEMPLATE)
    tool = {"type": "function", "function": {"name": "lookup", "description": "Looks a city up.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": "The city."}}}}}
    _, kwargs = prepare_messages(HISTORY, plan_tools([tool]), renders_tools=True)
    assert kwargs["tools"] == [tool] and list(kwargs["tools"][0]["function"]) == ["name", "description", "parameters"]
    text = tokenizer.apply_chat_template(HISTORY[:1], chat_template=DESCRIBING_TEMPLATE, tokenize=False, **kwargs)
    assert text.startswith("- lookup: Looks a city up. (city: The city.)")

# ---- the real model ----

@pytest.fixture
def live(llm):
    server = ThreadedServer(llm.engine, llm.tokenizer)
    yield server
    server.close()


def ask(client, stream: bool, tokens: list | None = None, **body):
    """One chat completion; a stream is put back together the way OpenAI's SDK users do,
    checking that each call's id, type and name come once, in its first delta. With ``tokens``
    (and ``logprobs`` asked for), each token's (bytes, logprob, {bytes: logprob} of the top ones)
    is added to it."""
    def keep(logprobs) -> None:
        if tokens is not None:
            tokens.extend((bytes(entry.bytes), entry.logprob,
                           {bytes(top.bytes): top.logprob for top in entry.top_logprobs}) for entry in logprobs.content)

    if not stream:
        choice = client.chat.completions.create(model="tiny", **body).choices[0]
        keep(choice.logprobs)
        calls = [c.model_dump() for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(model="tiny", stream=True, **body):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                keep(choice.logprobs)
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index == len(calls) and call.type == "function" and call.function.name
                    calls.append({"id": call.id, "type": "function",
                                  "function": {"name": call.function.name, "arguments": ""}})
                else:
                    assert call.function.name is None and call.index == len(calls) - 1
                calls[call.index]["function"]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, calls, finish


MATRIX = [(choice, parallel, stream) for choice in ("none", "auto", "required", "add")
          for parallel in (True, False) for stream in (False, True)]


@pytest.mark.slow
def test_the_tool_matrix_through_the_openai_client(live):
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
    tokens = [[] for _ in MATRIX]

    def one(i):
        choice, parallel, stream = MATRIX[i]
        tool_choice = choice if choice != "add" else {"type": "function", "function": {"name": "add"}}
        return ask(client, stream, tokens[i], messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                   parallel_tool_calls=parallel, temperature=0, max_tokens=200, logprobs=True, top_logprobs=2)

    with ThreadPoolExecutor(len(MATRIX)) as pool:
        results = list(pool.map(one, range(len(MATRIX))))
    for (choice, parallel, stream), (content, calls, finish) in zip(MATRIX, results):
        label = f"{choice} parallel={parallel} stream={stream}: {content!r} {calls}"
        assert_well_formed(calls, label)
        if not parallel:
            assert len(calls) <= 1, label
        if choice == "none":
            assert not calls and content and finish == "stop", label
        elif choice == "auto":
            assert finish == ("tool_calls" if calls else "stop"), label
        elif choice == "required":
            assert calls and content is None and finish == "tool_calls", label
        else:
            assert [c["function"]["name"] for c in calls] == ["add"] and content is None and finish == "stop", label
    # A stream says what the same request says at once (greedy), up to a near-tie: the 16 requests
    # share steps as they arrive, and fp32 products differ in the last bits across batch shapes.
    for i in range(0, len(MATRIX), 2):
        (content, calls, finish), (s_content, s_calls, s_finish) = results[i], results[i + 1]
        assert tokens[i] and tokens[i + 1], MATRIX[i]  # (each token's logprobs came)
        parted = next((p for p, (a, b) in enumerate(zip(tokens[i], tokens[i + 1])) if a[0] != b[0]), None)
        if parted is not None:  # a near-tie: in each run, the other's token next to its own (after any mask)
            for (mine, logprob, top), (theirs, _, _) in (
                    (tokens[i][parted], tokens[i + 1][parted]), (tokens[i + 1][parted], tokens[i][parted])):
                assert logprob - top.get(theirs, -math.inf) < NEAR_TIE, (MATRIX[i], parted, mine, theirs, top)
            continue
        assert [t for t, _, _ in tokens[i + 1]] == [t for t, _, _ in tokens[i]], MATRIX[i]
        assert (s_content, s_finish) == (content, finish), MATRIX[i]
        assert [c["function"] for c in s_calls] == [c["function"] for c in calls], MATRIX[i]


@pytest.mark.slow
def test_sampled_calls_stream_byte_equal_and_a_second_turn_answers(live):
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
    body = dict(messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=1.0, seed=7, max_tokens=200)
    content, calls, finish = ask(client, False, **body)
    assert calls and content is None and finish == "tool_calls"  # required: calls and nothing else
    assert_well_formed(calls, "sampled")
    s_content, s_calls, s_finish = ask(client, True, **body)
    assert (s_content, s_finish) == (content, finish)
    assert [c["function"] for c in s_calls] == [c["function"] for c in calls]

    # The results go back; the model answers in text (the template renders both turns).
    turn = [*QUESTION, {"role": "assistant", "content": content, "tool_calls": calls},
            *[{"role": "tool", "tool_call_id": c["id"], "content": "22 degrees and sunny" if c["function"]["name"]
               == "get_weather" else "5"} for c in calls]]
    answer, more_calls, finish = ask(client, False, messages=turn, tools=TOOLS, temperature=0, max_tokens=60)
    assert finish in ("stop", "tool_calls", "length") and (answer or more_calls)
    assert_well_formed(more_calls, "second turn")
    import httpx

    rendered = httpx.post(live.base_url + "/tokenize", json={"messages": turn, "tools": TOOLS}).json()["tokens"]
    text = live.client.tokenizer.decode(rendered)
    for call in calls:
        assert f'{{"name": "{call["function"]["name"]}", "arguments": {call["function"]["arguments"]}}}' in text
    assert text.count("<tool_response>\n") == len(calls)


@pytest.mark.slow
def test_required_calls_from_the_first_token_even_with_barely_enough_tokens(live):
    """tool_choice required: whatever is sampled, the output is a call from its first token,
    so a max_tokens just large enough to name the function always returns a call. The bound is
    the header's length in characters: however the sampler spells it in tokens (18 canonically;
    up to 23 were seen at temperature 1), each token writes at least one of its characters."""
    header = f'{CALL_BEGIN}get_weather{ARGUMENTS_BEGIN}'
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0, timeout=300)

    def one(seed: int):
        return ask(client, False, messages=QUESTION, tools=TOOLS[:1], tool_choice="required", temperature=1.0,
                   seed=seed, max_tokens=len(header))

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(50)))
    for seed, (content, calls, finish) in enumerate(results):
        assert calls and calls[0]["function"]["name"] == "get_weather" and content is None, (seed, calls)
        assert finish in ("tool_calls", "length"), seed


@pytest.mark.slow
def test_responses_with_calls_match_openais_schemas(live):
    import httpx

    from tests.openapi_schemas import OpenAISchemas

    schemas = OpenAISchemas()
    body = {"messages": QUESTION, "tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 100}
    response = httpx.post(live.base_url + "/v1/chat/completions", json=body, timeout=120).json()
    schemas.validate("CreateChatCompletionResponse", response)
    assert response["choices"][0]["message"]["tool_calls"]
    with httpx.stream("POST", live.base_url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    for event in events:
        schemas.validate("CreateChatCompletionStreamResponse", event)
    assert any(c["delta"].get("tool_calls") for e in events for c in e["choices"])
    # no empty deltas while the call is held back (each event says something, or ends the choice)
    deltas = [(c["delta"], c["finish_reason"]) for e in events for c in e["choices"]][1:]
    assert all(delta.get("content") != "" and (delta or finish) for delta, finish in deltas), deltas


@pytest.mark.slow
def test_a_call_cut_off_by_max_tokens_reports_length(live):
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
    body = dict(messages=QUESTION, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}},
                temperature=0, max_tokens=20)
    for stream in (False, True):
        content, calls, finish = ask(client, stream, **body)
        assert finish == "length" and content is None, (content, calls)
        assert [c["function"]["name"] for c in calls] == ["search"]
        with pytest.raises(ValueError):
            json.loads(calls[0]["function"]["arguments"])  # cut off


@pytest.mark.parametrize("body, param, message", [
    ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name must be"),
    ({"tools": [function("f", {"type": "object", "properties": {"x": {"type": "string", "pattern": "("}}})]},
     "tools", "invalid structural tag"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "expected bool"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}]}, "messages", "tool_calls"),
])
def test_bad_tool_fields_are_400s_and_the_server_keeps_serving(live, body, param, message):
    import httpx

    response = httpx.post(live.base_url + "/v1/chat/completions", timeout=60,
                          json={"messages": QUESTION, "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert httpx.post(live.base_url + "/v1/chat/completions", timeout=60,
                      json={"messages": QUESTION, "max_tokens": 3}).status_code == 200
    assert live.stats().num_running == 0


@pytest.mark.slow
def test_llm_chat_takes_tools(llm):
    named = {"type": "function", "function": {"name": "get_weather"}}
    output = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=60), tools=TOOLS, tool_choice=named)
    content, calls = parse_tool_calls(output[0].outputs[0].text)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert_well_formed(calls, "LLM.chat")
