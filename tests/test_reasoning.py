"""Reasoning output (--reasoning-parser): where an output begins, the split of reasoning from
the answer at every possible cut (tool calls right after the closing tag included), the
grammar that puts the reasoning before a constraint and bounds it by a budget, and the real
model through the HTTP API with a template that opens a reasoning block."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from api.serving import OutputSplitter, ReasoningPlan
from engine.errors import InvalidParameterError
from engine.reasoning import (
    REASONING_PARSERS,
    Opening,
    count_reasoning_tokens,
    reasoning_parser,
    split_reasoning,
)
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.structured_outputs import StructuredOutputManager
from tests.conftest import ThreadedServer

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'

# A ChatML template that opens a reasoning block after the generation prompt, and closes an
# empty one when enable_thinking is false (as Qwen3's templates do).
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n"
    "{% endif %}{% endif %}")


# ---- where an output begins ----

@pytest.mark.parametrize("parser, prompt, opening", [
    (QWEN3, "<|im_start|>assistant\n<think>\n", Opening.REASONING),
    (QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n", Opening.CONTENT),
    (QWEN3, "<|im_start|>assistant\n", Opening.MAYBE),
    (QWEN3, "<think>old</think>answer<|im_end|>\n<|im_start|>assistant\n", Opening.MAYBE),
    # A tag the user quotes is not the template's.
    (QWEN3, "<|im_start|>user\nWhat does <think> do?<|im_end|>\n<|im_start|>assistant\n", Opening.MAYBE),
    (QWEN3, "<|im_start|>user\nend with </think><|im_end|>\n<|im_start|>assistant\n<think>\n", Opening.REASONING),
    (R1, "<｜Assistant｜>", Opening.UNOPENED),
    (R1, "<｜Assistant｜><think>\n", Opening.REASONING),
    (R1, "<｜Assistant｜><think>\n\n</think>\n\n", Opening.CONTENT),
    (R1, "<｜User｜>say <think><｜Assistant｜>", Opening.UNOPENED),
])
def test_the_prompt_says_where_the_output_begins(parser, prompt, opening):
    assert parser.opening(prompt) is opening


@pytest.mark.parametrize("parser, continued, opening", [
    (R1, "<think>\nI know this.\n</think>\n\nHello, my answer is", Opening.CONTENT),
    (QWEN3, "<think>\nFirst, I", Opening.REASONING),
    (QWEN3, "Sure,", Opening.MAYBE),
    (R1, "Sure,", Opening.UNOPENED),
])
def test_a_continued_message_says_where_it_left_off(parser, continued, opening):
    assert parser.opening(f"<|im_start|>assistant\n{continued}", continued) is opening


def test_an_unknown_parser_name_is_refused_naming_the_known_ones():
    with pytest.raises(InvalidParameterError, match="deepseek_r1, qwen3"):
        reasoning_parser("r2d2")
    assert reasoning_parser(None) is None


# ---- the split, at every cut ----

TEXTS = [
    "\nLet me think: 2 < 3 and </thi is not a tag.\n</think>\n\nThe answer is 5.",
    "short</think>" + CALL,  # a call right after the closing tag
    "a</think>\n\n" + CALL + "\n" + CALL,
    "still thinking, cut off by max_tokens <",
    "</think>",
    "",
    "<think>\nhmm\n</think>\n\nanswer",
    "  <think>x</think>y",
    "<thin",
    "plain answer, no thinking at all",
]


def _fed(parser, opening, pieces, tools: bool):
    splitter = OutputSplitter(ReasoningPlan(parser, opening, lambda ids: ""), tools)
    reasoning, content, calls = "", "", []
    for i, piece in enumerate(pieces):
        split = splitter.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + split.reasoning, content + split.content
        for call in split.calls:
            if call.name is not None:
                calls.append([call.name, ""])
            calls[-1][1] += call.arguments
    return (reasoning if splitter.has_reasoning else None), content, calls


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("opening", list(Opening))
@pytest.mark.parametrize("parser", [QWEN3, R1], ids=["qwen3", "deepseek_r1"])
def test_streamed_pieces_add_up_to_the_whole_output_at_every_cut(parser, opening, text):
    whole = _fed(parser, opening, [text], tools=True)
    for cut in range(len(text) + 1):
        assert _fed(parser, opening, [text[:cut], text[cut:]], tools=True) == whole, cut
    for first in range(0, len(text) + 1, 3):  # two cuts
        for second in range(first, len(text) + 1, 2):
            assert _fed(parser, opening, [text[:first], text[first:second], text[second:]], True) == whole
    assert _fed(parser, opening, list(text) + [""], tools=True) == whole  # a character at a time


def test_what_the_split_gives():
    assert split_reasoning(QWEN3, Opening.REASONING, TEXTS[0])[:2] == (
        "\nLet me think: 2 < 3 and </thi is not a tag.\n", "The answer is 5.")
    # The closing tag, then at once a call: the call is read from the answer, nothing leaks.
    assert _fed(QWEN3, Opening.REASONING, ["short</think>" + CALL], tools=True) == (
        "short", "", [["add", '{"a": 1, "b": 2}']])
    # qwen3: an output that does not open a block is all answer; deepseek_r1 assumes one.
    assert split_reasoning(QWEN3, Opening.MAYBE, "plain answer")[:2] == (None, "plain answer")
    assert split_reasoning(R1, Opening.REASONING, "plain answer")[:2] == ("plain answer", "")
    assert split_reasoning(QWEN3, Opening.MAYBE, "  <think>x</think>y")[:2] == ("x", "y")
    # Thinking off: whatever the output holds is the answer.
    assert split_reasoning(QWEN3, Opening.CONTENT, "<think>x</think>y")[:2] == (None, "<think>x</think>y")
    # deepseek_r1 with an unopened block: an opening tag the model writes itself is markup.
    assert split_reasoning(R1, Opening.UNOPENED, "<think>\nLet me see.\n</think>ok")[:2] == ("\nLet me see.\n", "ok")
    assert split_reasoning(R1, Opening.UNOPENED, "Let me see.</think>ok")[:2] == ("Let me see.", "ok")
    # Cut off inside the closing tag: the piece of tag is no reasoning ("<" alone is text).
    assert split_reasoning(QWEN3, Opening.REASONING, "so 2 < 3\n</thin")[:2] == ("so 2 < 3\n", "")
    assert split_reasoning(QWEN3, Opening.REASONING, "so 2 <")[:2] == ("so 2 <", "")


def test_the_real_tokenizer_token_by_token(tokenizer):
    text = "I should add them.\n</think>\n\n" + CALL
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode(ids[:i + 1])[len(tokenizer.decode(ids[:i])):] for i in range(len(ids))]
    assert "".join(pieces) == text
    assert _fed(QWEN3, Opening.REASONING, pieces, tools=True) == (
        "I should add them.\n", "", [["add", '{"a": 1, "b": 2}']])
    # The reasoning's tokens: those whose text lies within it.
    reasoning_end = text.index("</think>")
    count = count_reasoning_tokens(tokenizer.decode, ids, reasoning_end)
    assert len(tokenizer.decode(ids[:count])) <= reasoning_end < len(tokenizer.decode(ids[:count + 1]))
    assert count_reasoning_tokens(tokenizer.decode, ids, 0) == 0
    # Streamed a token at a time, or at once, the count is the same.
    plan = ReasoningPlan(QWEN3, Opening.REASONING, tokenizer.decode)
    whole, streamed = OutputSplitter(plan, tools=True), OutputSplitter(plan, tools=True)
    whole.feed(text, ids, final=True)
    for i, (piece, token) in enumerate(zip(pieces, ids)):
        streamed.feed(piece, [token], final=i == len(ids) - 1)
    assert whole.reasoning_tokens() == streamed.reasoning_tokens() == count
    unclosed = OutputSplitter(plan, tools=False)
    unclosed.feed("still thinking", [1, 2, 3], final=True)
    assert unclosed.reasoning_tokens() == 3


@pytest.mark.parametrize("parser, opening", [(QWEN3, Opening.MAYBE), (R1, Opening.UNOPENED)])
def test_an_opening_tag_the_model_writes_is_no_reasoning_token(tokenizer, parser, opening):
    """Qwen3 without a template-opened block, or R1 writing its own tag: the count starts after
    the tag, so a budget of N reports at most N (the grammar bounds the text inside the tag)."""
    reasoning = " one two three four"
    inside = tokenizer.encode(reasoning, add_special_tokens=False)
    assert len(inside) == 4
    plan = ReasoningPlan(parser, opening, tokenizer.decode)
    for tail in ("</think>\n\nanswer", ""):  # closed, and cut off before the closing tag
        text = "<think>" + reasoning + tail
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = [tokenizer.decode(ids[:i + 1])[len(tokenizer.decode(ids[:i])):] for i in range(len(ids))]
        whole, streamed = OutputSplitter(plan, tools=False), OutputSplitter(plan, tools=False)
        whole.feed(text, ids, final=True)
        for i, (piece, token) in enumerate(zip(pieces, ids)):
            streamed.feed(piece, [token], final=i == len(ids) - 1)
        assert whole.reasoning_tokens() == streamed.reasoning_tokens() == 4


# ---- the grammar: reasoning first, then the constraint ----

def _accepts(manager, params: SamplingParams, text: str, tokenizer) -> bool:
    """Whether the grammar lets the model write ``text``, each token allowed by the mask filled
    before it (as the engine samples: the mask is where a budget is enforced)."""
    matcher = manager.compile(params.structured_outputs).matcher([tokenizer.eos_token_id])
    bitmask = manager.backend.allocate_bitmask(1)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if matcher.fill_bitmask(bitmask, 0) and not (bitmask[0, token // 32] >> (token % 32)) & 1:
            return False
        if not matcher.accept(token):
            return False
    return True


def test_the_constraint_applies_after_the_reasoning(tokenizer):
    manager = StructuredOutputManager(tokenizer, len(tokenizer))
    json_mode = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    after = QWEN3.constrain(json_mode, Opening.REASONING, None)
    assert _accepts(manager, after, 'Let me think about {braces}.\n</think>\n\n{"a": 1}', tokenizer)
    assert not _accepts(manager, after, 'thinking</think>\n\nnot json', tokenizer)
    maybe = QWEN3.constrain(json_mode, Opening.MAYBE, None)
    assert _accepts(manager, maybe, '<think>hmm</think>{"a": 1}', tokenizer)
    assert _accepts(manager, maybe, '{"a": 1}', tokenizer)  # no block: the constraint from the start
    assert not _accepts(manager, maybe, 'hmm', tokenizer)
    # Thinking off, or nothing to constrain: the parameters are left as they are.
    assert QWEN3.constrain(json_mode, Opening.CONTENT, 5) is json_mode
    plain = SamplingParams()
    assert QWEN3.constrain(plain, Opening.REASONING, None) is plain


def test_a_budget_closes_the_reasoning(tokenizer):
    manager = StructuredOutputManager(tokenizer, len(tokenizer))
    words = " one two three four five six"
    ids = tokenizer.encode(words, add_special_tokens=False)
    assert len(ids) == 6
    four = tokenizer.decode(ids[:4])
    budget = QWEN3.constrain(SamplingParams(), Opening.REASONING, 4)
    assert _accepts(manager, budget, four + "</think>\n\nfree text", tokenizer)
    assert not _accepts(manager, budget, words, tokenizer)  # a fifth token of reasoning is refused
    # Where the output may open a block, a budget makes it open one: no way around the budget.
    maybe = QWEN3.constrain(SamplingParams(), Opening.MAYBE, 4)
    assert _accepts(manager, maybe, f"<think>{four}</think>\n\nfree text", tokenizer)
    assert not _accepts(manager, maybe, f"<think>{words}</think>", tokenizer)
    assert not _accepts(manager, maybe, "an answer with no block", tokenizer)
    # deepseek_r1, block unopened: the opening tag may come first, or not.
    unopened = R1.constrain(SamplingParams(), Opening.UNOPENED, 4)
    assert _accepts(manager, unopened, f"<think>{four}</think>ok", tokenizer)
    assert _accepts(manager, unopened, f"{four}</think>ok", tokenizer)
    assert not _accepts(manager, unopened, words, tokenizer)


# ---- the real model, through the API ----

@pytest.fixture
def thinking(llm):
    server = ThreadedServer(llm.engine, llm.tokenizer, chat_template=THINKING_TEMPLATE, reasoning_parser=QWEN3)
    yield server
    server.close()


QUESTION = [{"role": "user", "content": "What is 2 + 3? Answer in one sentence."}]


def _chat(server, **body) -> dict:
    response = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": QUESTION, **body},
                          timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def _streamed(server, **body) -> tuple[str, str, dict]:
    reasoning = content = ""
    usage = None
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", timeout=300, json={
            "messages": QUESTION, "stream": True, "stream_options": {"include_usage": True}, **body}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk["usage"] or usage
            for choice in chunk["choices"]:
                assert choice["delta"].get("reasoning") == choice["delta"].get("reasoning_content")
                reasoning += choice["delta"].get("reasoning_content") or ""
                content += choice["delta"].get("content") or ""
    return reasoning, content, usage


@pytest.mark.slow
def test_a_budget_bounds_the_reasoning_and_the_stream_says_what_the_response_says(thinking):
    for budget in (1, 5, 12):
        body = dict(temperature=0, max_tokens=48, thinking_token_budget=budget)
        message = _chat(thinking, **body)
        choice, usage = message["choices"][0], message["usage"]
        reasoning_tokens = usage["completion_tokens_details"]["reasoning_tokens"]
        assert 1 <= reasoning_tokens <= budget, (budget, usage)
        assert choice["message"]["reasoning_content"] == choice["message"]["reasoning"]
        assert choice["message"]["reasoning_content"] and "</think>" not in choice["message"]["content"]
        assert "<think>" not in choice["message"]["reasoning_content"]
        streamed_reasoning, streamed_content, streamed_usage = _streamed(thinking, **body)
        assert (streamed_reasoning, streamed_content) == (choice["message"]["reasoning_content"],
                                                          choice["message"]["content"])
        assert streamed_usage["completion_tokens_details"] == usage["completion_tokens_details"]
        print(budget, repr(streamed_reasoning), repr(streamed_content), usage)


@pytest.mark.slow
def test_json_mode_constrains_the_answer_after_the_reasoning(thinking):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    for body in ({"response_format": {"type": "json_object"}},
                 {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}):
        message = _chat(thinking, temperature=0, max_tokens=60, thinking_token_budget=10, **body)["choices"][0]
        assert message["message"]["reasoning_content"]
        value = json.loads(message["message"]["content"])
        assert isinstance(value, dict)
        if "json_schema" in body["response_format"]:
            jsonschema.validate(value, schema)


@pytest.mark.slow
def test_thinking_off_gives_content_never_null(thinking):
    client = openai.OpenAI(base_url=thinking.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_tokens=24,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    assert isinstance(message.content, str) and message.content
    assert message.model_extra["reasoning_content"] is None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    # Cut off while still reasoning: the answer is empty, not null.
    cut = _chat(thinking, temperature=0, max_tokens=4)["choices"][0]
    assert cut["message"]["content"] == "" and cut["finish_reason"] == "length" and cut["message"]["reasoning"]


@pytest.mark.slow
def test_default_template_arguments_apply_and_a_request_overrides_them(llm):
    server = ThreadedServer(llm.engine, llm.tokenizer, chat_template=THINKING_TEMPLATE, reasoning_parser=QWEN3,
                            default_chat_template_kwargs={"enable_thinking": False})
    try:
        off = _chat(server, temperature=0, max_tokens=8)["choices"][0]["message"]
        on = _chat(server, temperature=0, max_tokens=8, chat_template_kwargs={"enable_thinking": True})
        assert off["reasoning_content"] is None and off["content"]
        assert on["choices"][0]["message"]["reasoning_content"]
    finally:
        server.close()


@pytest.mark.slow
def test_a_budget_without_a_reasoning_parser_is_a_400(llm):
    server = ThreadedServer(llm.engine, llm.tokenizer)
    try:
        response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
            "messages": QUESTION, "thinking_token_budget": 5})
        assert response.status_code == 400 and response.json()["error"]["param"] == "thinking_token_budget"
        response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
            "messages": QUESTION, "thinking_token_budget": 0})
        assert response.status_code == 400
    finally:
        server.close()


def test_an_unknown_reasoning_parser_stops_the_server_at_start(capsys):
    from api.server import main

    with pytest.raises(SystemExit) as stopped:
        main(["--reasoning-parser", "r2d2"])
    assert stopped.value.code == 2
    assert "--reasoning-parser: invalid choice: 'r2d2'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--default-chat-template-kwargs", "[1]"], "must be a JSON object"),
    (["--default-chat-template-kwargs", "{nope"], "not valid JSON"),
    (["--enable-responses-store", "--api-server-count", "2"], "needs --api-server-count 1"),
    (["--max-stored-responses", "0"], "at least 1"),
])
def test_bad_reasoning_and_responses_flags_stop_the_server_at_start(capsys, argv, words):
    from api.server import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2 and words in capsys.readouterr().err
