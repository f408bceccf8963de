"""Structured outputs: JSON schema, regex, choice, grammar and json_object constraints, offline
and over HTTP; bad constraints are 400s; constrained and unconstrained requests share batches
without changing each other's tokens; preemption does not feed a grammar twice."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import attrs
import jsonschema
import pytest
import trio
import trio.testing

from engine import structured_outputs
from engine.errors import InvalidParameterError
from engine.frontend.async_engine import Engine
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from engine.structured_outputs import StructuredOutputManager, unsupported_schema_keywords
from tests.conftest import gated_manager, serve_http, tiny_engine_core, until
from tests.openapi_schemas import OpenAISchemas

SCHEMAS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())["schemas"]
PROMPT = [{"role": "user", "content": "Reply with a JSON value that fits the schema."}]


def json_params(schema, **kw) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **kw)


def assert_valid(text: str, schema: dict, label: str) -> None:
    try:
        value = json.loads(text)
    except ValueError:
        pytest.fail(f"{label}: not JSON: {text!r}")
    jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


# ---- parameters and compiling (no model) ----

def test_exactly_one_constraint():
    with pytest.raises(InvalidParameterError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidParameterError, match="exactly one.*json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(InvalidParameterError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(InvalidParameterError, match="whitespace_pattern"):
        StructuredOutputsParams(json={"type": "object"}, whitespace_pattern=r"[ ]?")
    key = StructuredOutputsParams(json={"b": 1, "a": 2}).key()
    assert key == StructuredOutputsParams(json='{"a": 2, "b": 1}').key()  # canonical: the cache's key


def test_schema_keywords_the_backend_would_ignore_are_found_wherever_they_are():
    schema = {"type": "object", "$defs": {"x": {"type": "array", "uniqueItems": True}},
              "properties": {"a": {"type": "array", "items": {"type": "number", "multipleOf": 0.5}},
                             "b": {"anyOf": [{"not": {"type": "null"}}]}, "c": {"type": "string", "format": "idn-email"},
                             "d": {"type": "string", "pattern": "^a+$", "maxLength": 3}},
              "if": {"required": ["a"]}}
    found = unsupported_schema_keywords(schema)
    assert set(found) == {"/$defs/x: uniqueItems", "/properties/a/items: multipleOf (enforced for integers only)",
                          "/properties/b/anyOf/0: not", "/properties/c: format 'idn-email'", "/: if",
                          "/properties/d: maxLength together with pattern or format"}
    assert all(unsupported_schema_keywords(s) == [] for s in SCHEMAS)



@pytest.mark.parametrize("schema, found", [
    ({"type": "string", "pattern": "^(?!abc)[a-z]{3}$"}, "/: pattern with a lookahead or lookbehind"),
    ({"type": "object", "patternProperties": {"^(?=x)": {}}}, "/patternProperties: a pattern with a lookahead"),
    ({"$ref": "https://example.com/s.json"}, "/: $ref to another document ('https://example.com/s.json')"),
    ({"type": "object", "required": ["a"]}, "/: required 'a', which no property describes"),
    ({"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["a", "b"]},
     "/: required 'a', which no property describes"),
    ({"type": "object", "propertyNames": {"pattern": "^[a-c]$"}, "properties": {"a": {"type": "integer"}}},
     "/: propertyNames together with properties"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "/: required 'a'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^a": {"type": "string"}}},
     "/: patternProperties together with properties"),
])
def test_what_xgrammar_would_ignore_or_get_wrong_is_found(schema, found):
    """Each came out of a request as JSON that failed its schema (xgrammar warned and went on,
    or wrote a key twice, or could never write a required key)."""
    assert any(f.startswith(found) for f in unsupported_schema_keywords(schema)), unsupported_schema_keywords(schema)


@pytest.mark.parametrize("schema", [
    # Zod 4's z.record(z.string(), z.string()) and z.record(z.enum(["a", "b"]), z.number()), as the
    # Vercel AI SDK and MCP's TypeScript SDK send tools; Pydantic's dict[Literal["a", "b"], float]
    {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {"type": "string"}},
    {"type": "object", "propertyNames": {"enum": ["a", "b"]}, "additionalProperties": {"type": "number"},
     "required": ["a", "b"]},
    {"additionalProperties": {"type": "number"}, "propertyNames": {"enum": ["a", "b"]}, "type": "object"},
    {"type": "object", "patternProperties": {"^a": {}}, "required": ["ab"]},
    {"type": "string", "pattern": r"^\(?!\)$"},  # (escaped: a parenthesis, no lookahead)
])
def test_records_and_other_shapes_xgrammar_enforces_are_not_refused(schema):
    assert unsupported_schema_keywords(schema) == []


@pytest.mark.parametrize("param", ["response_format", "structured_outputs"])
def test_a_constraint_beside_tool_calls_or_reasoning_is_checked_as_alone(param):
    """Beside calls or after reasoning a schema becomes part of a structural tag: the same
    keywords are refused there as alone."""
    from engine.tools import as_structural_format

    with pytest.raises(InvalidParameterError, match="cannot enforce: /properties/a: not") as refused:
        as_structural_format(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"not": {}}}}), param)
    assert refused.value.param == param

@pytest.fixture(scope="module")
def manager(tokenizer):
    return StructuredOutputManager(tokenizer, 49152)


@pytest.mark.parametrize("params, message", [
    (StructuredOutputsParams(json={"type": "object", "properties": 5}), "invalid json: properties must be an object"),
    (StructuredOutputsParams(json="{not json"), "not valid JSON"),
    (StructuredOutputsParams(json={"type": "array", "contains": {"const": 1}}), "cannot enforce: /: contains"),
    (StructuredOutputsParams(regex="a(b"), "invalid regex: .*parenthesis"),
    (StructuredOutputsParams(grammar='root ::= "a" |'), "invalid grammar"),
    (StructuredOutputsParams(grammar='?start: "yes" | "no"\n'), "invalid grammar: .*looks like Lark.*root ::="),
])
def test_a_constraint_that_does_not_compile_is_an_invalid_parameter(manager, params, message):
    with pytest.raises(InvalidParameterError, match=message) as info:
        manager.compile(params)
    assert info.value.param == "structured_outputs"


def test_the_cache_holds_no_more_memory_than_its_limit(tokenizer):
    """Compiled grammars hold their token masks (~2.5 MB each for a small schema over this
    vocabulary): the cache is bounded by bytes as well as by count, dropping the least recent."""
    from engine.structured_outputs import StructuredOutputsConfig

    limited = StructuredOutputManager(tokenizer, 49152, StructuredOutputsConfig(cache_size_mb=6))
    schemas = [StructuredOutputsParams(json={"type": "object", "properties": {f"f{i}": {"type": "integer"}},
                                             "required": [f"f{i}"]}) for i in range(4)]
    sizes = [limited.compile(params).nbytes for params in schemas]
    assert min(sizes) > 2**20 and limited.num_compiles == 4
    assert 0 < limited.cache_bytes <= 6 * 2**20 < sum(sizes)
    assert limited.cache_bytes == sum(grammar.nbytes for grammar in limited._cache.values())
    assert limited.cached(schemas[-1]) is not None  # the newest stays
    assert limited.cached(schemas[0]) is None  # the oldest went
    limited.compile(schemas[0])
    assert limited.num_compiles == 5
    tiny = StructuredOutputManager(tokenizer, 49152, StructuredOutputsConfig(cache_size_mb=1))
    tiny.compile(schemas[0])  # (larger than the limit on its own: the newest stays)
    assert tiny.cached(schemas[0]) is not None and tiny.cache_bytes == sizes[0]


def test_a_front_of_engine_processes_remembers_only_verdicts(tokenizer):
    """A front compiles to refuse a bad constraint before queueing it; the engine process
    compiles its own, so the front's cache keeps no grammar (no memory), only that it compiles."""
    checks = StructuredOutputManager(tokenizer, 49152, validate_only=True)
    params = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert checks.compile(params).nbytes > 2**20  # (this request's own grammar)
    assert checks.cache_bytes == 0 and checks.cached(params) is structured_outputs.COMPILES
    checks.compile(params)
    assert checks.num_compiles == 1
    with pytest.raises(InvalidParameterError):
        checks.compile(StructuredOutputsParams(regex="((("))
    with pytest.raises(InvalidParameterError):  # (remembered)
        checks.compile(StructuredOutputsParams(regex="((("))
    assert checks.num_compiles == 2


def test_compiles_are_cached_and_so_are_failures(manager):
    params = StructuredOutputsParams(regex=r"[0-9]{4}")
    before = manager.num_compiles
    first = manager.compile(params)
    assert manager.compile(StructuredOutputsParams(regex=r"[0-9]{4}")) is first
    bad = StructuredOutputsParams(regex="(((")
    for _ in range(3):
        with pytest.raises(InvalidParameterError):
            manager.compile(bad)
    assert manager.num_compiles == before + 2  # one real compile each


def regex(text: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=text)


async def test_a_compile_runs_off_the_event_loop(tokenizer):
    manager, backend = gated_manager(tokenizer)
    results = []

    async def ask():
        results.append(await manager.compile_async(regex("slow")))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        await until(lambda: backend.started == ["slow"])
        assert results == []  # compiling, and the loop runs meanwhile
        backend.gate("slow").set()
    assert results == [("compiled", "slow")]


async def test_a_compile_past_its_budget_is_refused_but_not_remembered(tokenizer):
    manager, backend = gated_manager(tokenizer, compile_timeout_s=0.2)
    with pytest.raises(InvalidParameterError, match="longer than 0.2 s"):
        await manager.compile_async(regex("slow"))
    backend.gate("slow").set()  # the compile goes on without the request that gave up on it
    await until(lambda: manager.num_compiles == 1)
    assert await manager.compile_async(regex("slow")) == ("compiled", "slow")  # its result, cached
    assert backend.started == ["slow"] and manager.num_compiles == 1


async def test_a_request_that_joins_a_compile_past_the_first_ones_budget_gets_its_own(tokenizer):
    # (a budget the joining request's compile, released at once, meets on a loaded machine too)
    manager, backend = gated_manager(tokenizer, compile_timeout_s=1.0)
    with pytest.raises(InvalidParameterError, match="longer than"):
        await manager.compile_async(regex("slow"))
    results = []

    async def ask():
        results.append(await manager.compile_async(regex("slow")))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)  # joins the compile still running (its first budget has passed)
        await trio.testing.wait_all_tasks_blocked()
        backend.gate("slow").set()
    assert results == [("compiled", "slow")] and backend.started == ["slow"]


async def test_requests_for_a_constraint_being_compiled_share_that_compile(tokenizer):
    manager, backend = gated_manager(tokenizer)
    results = []

    async def ask():
        results.append(await manager.compile_async(regex("slow")))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(ask)
        await until(lambda: backend.started == ["slow"])
        await trio.testing.wait_all_tasks_blocked()
        backend.gate("slow").set()
    assert results == [("compiled", "slow")] * 3 and backend.started == ["slow"]


async def test_the_compilers_refusal_is_remembered(tokenizer):
    manager, backend = gated_manager(tokenizer)
    for _ in range(3):
        with pytest.raises(InvalidParameterError, match="invalid regex: bad"):
            await manager.compile_async(regex("bad"))
    assert backend.started == ["bad"]


async def test_waiting_for_a_compile_slot_is_not_compile_time(tokenizer, monkeypatch):
    # One slot, held by a slow compile for longer than the budget: the fast constraint queued
    # behind it still gets its whole budget once it has the slot.
    monkeypatch.setattr(structured_outputs, "SLOT_LEASE", 1000.0)  # (the slot is not given back meanwhile)
    manager, backend = gated_manager(tokenizer, compile_timeout_s=1.0, max_concurrent_compiles=1)
    outcomes = {}

    async def ask(text):
        try:
            outcomes[text] = await manager.compile_async(regex(text))
        except InvalidParameterError as exc:
            outcomes[text] = str(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "slow")
        await until(lambda: backend.started == ["slow"])
        nursery.start_soon(ask, "fast")
        await until(lambda: "slow" in outcomes)  # its request gives up at 1 s; the compile goes on
        await trio.sleep(0.2)  # past the fast one's budget, had its wait been counted
        assert "fast" not in outcomes and backend.started == ["slow"]  # no slot yet
        backend.gate("slow").set()
    assert "longer than" in outcomes["slow"] and outcomes["fast"] == ("compiled", "fast")


async def test_a_compile_that_never_ends_gives_its_slot_back_and_lost_ones_are_bounded(tokenizer):
    manager, backend = gated_manager(tokenizer, compile_timeout_s=0.2, max_concurrent_compiles=1)
    try:
        with pytest.raises(InvalidParameterError, match="longer than"):
            await manager.compile_async(regex("slow-forever"))
        with trio.fail_after(10):  # the lease (SLOT_LEASE x the budget) runs out; the slot is free
            assert await manager.compile_async(regex("fast")) == ("compiled", "fast")
        assert backend.started == ["slow-forever", "fast"] and manager.num_lost_compiles == 1
        # A request that joins the compile still running gets a budget of its own, and a refusal.
        with pytest.raises(InvalidParameterError, match="longer than"):
            await manager.compile_async(regex("slow-forever"))
        # A second compile that never ends is lost too; then no third starts until one ends.
        with pytest.raises(InvalidParameterError, match="longer than"):
            await manager.compile_async(regex("slow-2"))
        await until(lambda: manager.num_lost_compiles == 2 or manager._free_slot_at(
            trio.lowlevel.current_trio_token()) == math.inf)
        waiting = []

        async def third():
            waiting.append(await manager.compile_async(regex("fast-2")))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(third)
            await trio.sleep(1.0)  # past two leases: still no slot, with two lost threads running
            assert backend.started == ["slow-forever", "fast", "slow-2"] and waiting == []
            backend.gate("slow-2").set()  # one ends: the third starts
        assert waiting == [("compiled", "fast-2")]
    finally:
        backend.gate("slow-forever").set()  # (let the worker threads end)
        backend.gate("slow-2").set()


# ---- the real model, offline ----

@pytest.mark.slow
def test_every_schema_of_the_corpus_is_honoured_at_temperature_1(llm):
    params = [json_params(s, temperature=1.0, n=4, seed=i, max_tokens=256) for i, s in enumerate(SCHEMAS)]
    outputs = llm.chat([PROMPT] * len(SCHEMAS), params)
    for i, (schema, output) in enumerate(zip(SCHEMAS, outputs)):
        for c in output.outputs:
            assert c.finish_reason == "stop", f"schema {i}: {c.finish_reason}: {c.text!r}"
            assert_valid(c.text, schema, f"schema {i}")


def test_regex_choice_grammar_and_json_object(llm):
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<city>", "end": "</city>", "content": {
        "type": "json_schema", "json_schema": {"type": "object", "required": ["name"],
                                               "properties": {"name": {"type": "string", "maxLength": 12}}}}}}
    constraints = {
        "structural_tag": StructuredOutputsParams(structural_tag=json.dumps(tag)),
        "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8} [0-9]{1,3}"),
        "choice": StructuredOutputsParams(choice=["Paris", "London", "Rome"]),
        "grammar": StructuredOutputsParams(grammar='root ::= ("yes" | "no") ", because " [a-z ]{1,20} "."'),
        "json_object": StructuredOutputsParams(json_object=True),
    }
    params = [SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=64, structured_outputs=c)
              for c in constraints.values()]
    outputs = llm.generate(["The capital of France is"] * len(params), params)
    texts = {kind: [c.text for c in o.outputs] for kind, o in zip(constraints, outputs)}
    assert all(re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", t) for t in texts["regex"]), texts["regex"]
    assert set(texts["choice"]) <= {"Paris", "London", "Rome"}
    assert all(re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", t) for t in texts["grammar"]), texts["grammar"]
    # Any JSON object is allowed, so a sample may still be inside a string at max_tokens (as
    # on some CPUs with this seed): then what it wrote must be a prefix the grammar allows.
    json_object = StructuredOutputManager(llm.tokenizer, 49152).compile(constraints["json_object"])
    for c in outputs[list(constraints).index("json_object")].outputs:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict), c.text
        else:
            assert c.finish_reason == "length" and json_object.matcher([])._matcher.accept_string(c.text), c.text
    for text in texts["structural_tag"]:
        assert text.startswith("<city>") and text.endswith("</city>"), text
        assert len(json.loads(text[6:-7])["name"]) <= 12
    assert all(c.finish_reason == "stop" for kind, o in zip(constraints, outputs) if kind != "json_object"
               for c in o.outputs)


def test_a_cut_off_json_value_reports_length(llm):
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 200}}, "required": ["story"]}
    output = llm.generate("Tell me a story.", json_params(schema, temperature=0, max_tokens=8))[0].outputs[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 8
    assert output.text.startswith('{')



def test_a_stop_token_the_grammar_needs_ends_the_output_where_it_comes(llm):
    """As vLLM: stop_token_ids are the scheduler's, not the grammar's (given to it as ends, a
    token the JSON needs was no longer allowed as itself: the request failed, or was bent)."""
    quote = llm.get_tokenizer().encode('"', add_special_tokens=False)
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"]}
    plain = llm.generate("Give me a color as JSON:", json_params(schema, temperature=0, max_tokens=30))[0].outputs[0]
    params = json_params(schema, temperature=0, max_tokens=30, stop_token_ids=quote)
    output = llm.generate("Give me a color as JSON:", params)[0].outputs[0]
    assert (output.finish_reason, output.stop_reason) == ("stop", quote[0])
    first_quote = plain.token_ids.index(quote[0])
    assert output.token_ids == plain.token_ids[:first_quote + 1] and output.text == plain.text[:len(output.text)]

def test_min_tokens_and_ignore_eos_do_not_outlive_a_complete_grammar(llm):
    params = SamplingParams(temperature=0, max_tokens=30, min_tokens=20, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    output = llm.generate("Is water wet? Answer:", params)[0].outputs[0]
    assert output.text in ("yes", "no") and output.finish_reason == "stop"
    assert len(output.token_ids) <= 3  # the answer, then EOS: the grammar allows nothing else


def test_unconstrained_requests_keep_their_tokens_in_a_mixed_batch(llm):
    prompts = [f"Write a sentence about {topic}:" for topic in ("cats", "rain", "bread", "ships")]
    greedy = SamplingParams(temperature=0, max_tokens=16)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    llm.reset_prefix_cache()
    mixed_params = [greedy, json_params(SCHEMAS[0], temperature=0, max_tokens=40)] * 4
    mixed = llm.generate([p for p in prompts for _ in range(2)], mixed_params)
    assert [mixed[2 * i].outputs[0].token_ids for i in range(4)] == alone
    assert all(json.loads(mixed[2 * i + 1].outputs[0].text) for i in range(4))


def test_a_bad_constraint_fails_before_anything_runs(llm):
    with pytest.raises(InvalidParameterError, match="regex"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=4),
                                  SamplingParams(structured_outputs=StructuredOutputsParams(regex="(("))])
    assert llm.engine.stats().kv_blocks_used == 0 and not llm.engine.has_unfinished_requests


# ---- preemption and failures, on the tiny random model (any output is what its grammar allows) ----

async def test_preemption_does_not_feed_a_grammar_twice(tiny_vocab_model, tokenizer):
    core = tiny_engine_core(tiny_vocab_model, num_kv_blocks=12, max_model_len=96, max_num_seqs=8)
    pattern = r"[a-z]{3}( [a-z]{3}){3,6}"  # at most 27 characters: it ends well before max_tokens
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=40, output_kind=RequestOutputKind.FINAL_ONLY,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    async with Engine(core, tokenizer).serve() as client:
        results = []

        async def one(i):
            async for output in client.generate([100 + i] * 44, attrs.evolve(params, seed=i)):
                results.append(output.outputs[0])

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
        assert client.stats().num_preemptions > 0
        assert client.stats().kv_blocks_used == 0
    assert len(results) == 8
    for c in results:
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), (c.finish_reason, c.text)


async def test_a_token_the_grammar_refuses_fails_that_request_only(tiny_vocab_core, tokenizer, monkeypatch):
    from engine import structured_outputs

    real_accept = structured_outputs._XGrammarMatcher.accept
    monkeypatch.setattr(structured_outputs._XGrammarMatcher, "accept",
                        lambda self, token: False if getattr(self.backend, "poisoned", False) else real_accept(self, token))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    async with Engine(tiny_vocab_core, tokenizer).serve() as client:
        alone = [o async for o in client.generate([5, 6, 7], params)][-1].outputs[0].token_ids
        client._engine.structured_outputs.backend.poisoned = True
        outcomes = {}

        async def run(name, p):
            try:
                outcomes[name] = [o async for o in client.generate([5, 6, 7], p)][-1].outputs[0].token_ids
            except Exception as exc:  # noqa: BLE001 - the outcome under test
                outcomes[name] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "plain", params)
            nursery.start_soon(run, "constrained", attrs.evolve(
                params, structured_outputs=StructuredOutputsParams(regex="[a-z]+")))
        assert client.stats().kv_blocks_used == 0 and not client.errored
    assert outcomes["plain"] == alone
    assert "not allowed by the request's grammar" in str(outcomes["constrained"])


# ---- HTTP ----

@pytest.fixture
async def server(llm):
    async with serve_http(llm.engine, llm.tokenizer) as live:
        yield live


async def chat(server, body: dict):
    return await server.http.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 200, **body},
                                  timeout=300)


async def stream_text(server, body: dict) -> tuple[str, str]:
    text, finish = "", None
    async with server.http.stream("POST", "/v1/chat/completions",
                                  json={"messages": PROMPT, "max_tokens": 200, "stream": True, **body}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    return text, finish


@pytest.mark.slow
async def test_every_schema_of_the_corpus_is_honoured_over_http(server):
    results = [None] * len(SCHEMAS)

    async def one(i, schema):
        response = await chat(server, {"n": 4, "temperature": 1.0, "seed": 100 + i, "max_tokens": 256,
                                        "response_format": {"type": "json_schema",
                                                            "json_schema": {"name": f"s{i}", "schema": schema}}})
        results[i] = response

    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            for i, schema in enumerate(SCHEMAS):
                nursery.start_soon(one, i, schema)
    for i, (schema, response) in enumerate(zip(SCHEMAS, results)):
        assert response.status_code == 200, response.text
        for choice in response.json()["choices"]:
            assert choice["finish_reason"] == "stop", choice
            assert_valid(choice["message"]["content"], schema, f"schema {i}")


@pytest.mark.parametrize("field", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0], "strict": True}}},
    {"structured_outputs": {"json": SCHEMAS[0]}},
    {"guided_json": SCHEMAS[0]},
])
async def test_every_way_of_asking_for_json_is_honoured_and_streams_byte_equal(server, field):
    body = {"temperature": 1.0, "seed": 11, **field}
    response = await chat(server, body)
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["message"]["content"]
    assert_valid(text, SCHEMAS[0], str(field))
    assert await stream_text(server, body) == (text, "stop")


async def test_completions_take_the_constraints_too(server):
    response = await server.http.post("/v1/completions", json={
        "prompt": "Pick a colour:", "max_tokens": 10, "guided_choice": ["red", "green"], "n": 2, "seed": 3})
    assert response.status_code == 200, response.text
    assert {c["text"] for c in response.json()["choices"]} <= {"red", "green"}
    response = await server.http.post("/v1/completions", json={
        "prompt": "Year:", "max_tokens": 10, "structured_outputs": {"regex": "(19|20)[0-9]{2}"}})
    assert re.fullmatch(r"(19|20)[0-9]{2}", response.json()["choices"][0]["text"])


async def test_logprobs_of_masked_tokens_are_numbers_in_both_endpoints(server):
    # Tokens the constraint forbids have logprob -inf; JSON has no such number (orjson writes
    # null, which OpenAI's schema refuses). Both endpoints write -9999.0, as vLLM does.
    schemas = OpenAISchemas()
    body = {"prompt": "Pick a colour:", "max_tokens": 4, "guided_choice": ["red", "green"], "logprobs": 5}
    for stream in (False, True):
        response = await server.http.post("/v1/completions", json={**body, "stream": stream})
        assert response.status_code == 200, response.text
        if stream:
            chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
            for chunk in chunks:
                schemas.validate_completion_chunk(chunk)
            tops = [t for c in chunks for choice in c["choices"] if choice["logprobs"]
                    for t in choice["logprobs"]["top_logprobs"]]
        else:
            schemas.validate("CreateCompletionResponse", response.json())
            tops = response.json()["choices"][0]["logprobs"]["top_logprobs"]
        values = [v for top in tops for v in top.values()]
        assert len(values) > len(tops) and all(isinstance(v, float) for v in values), tops
        assert -9999.0 in values  # the masked alternatives
    reply = await chat(server, {"max_tokens": 4, "guided_choice": ["red", "green"], "logprobs": True,
                                "top_logprobs": 20})
    schemas.validate("CreateChatCompletionResponse", reply.json())
    tops = reply.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert [t["logprob"] for t in tops].count(-9999.0) >= 1


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                         "properties": 3}}}},
     "response_format", "properties must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array",
                                                                                         "uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array",
                                                                                         "uniqueItems": True}}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "response_format", "uniqueItems"),  # (beside calls)
    ({"guided_regex": "a(b"}, "guided_regex", "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "invalid grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs", "unknown fields: jsonn"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "one output constraint"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "one output constraint"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "xgrammar"),
])
async def test_bad_constraints_are_400s_naming_their_field(server, body, param, message):
    plain = {"temperature": 0, "max_tokens": 12, "messages": [{"role": "user", "content": "Say hi."}]}
    async with trio.open_nursery() as nursery:  # a concurrent plain request is not disturbed
        results = {}

        async def plain_request():
            results["plain"] = await server.http.post("/v1/chat/completions", json=plain)

        nursery.start_soon(plain_request)
        response = await chat(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and re.search(message, error["message"]), error
    assert results["plain"].status_code == 200
    assert server.client.stats().kv_blocks_used == 0 or server.client.num_unfinished == 0
