"""Incremental detokenization: UTF-8 split across tokens, stop strings split across tokens,
hold-back of possible stop-string prefixes; what has been shown is always a prefix of the end."""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
import pytest
import trio
import trio.testing
from hypothesis import given

from engine.frontend.detokenizer import IncrementalDetokenizer, _TextBuffer, longest_stop_prefix
from engine.frontend.output_actor import OutputActor
from engine.frontend.output_channel import RequestOutputChannel
from engine.frontend.request_state import RequestState
from engine.frontend.stats import IterationStats
from engine.messages import Decodes, EngineStats, StepOutput, StopRequest, TokenDelta
from engine.outputs import TokenLogprobs
from engine.sampling_params import RequestOutputKind, SamplingParams

STATS = EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)

TEXTS = [
    "Hello, world! Plain ASCII text.",
    "Emoji: 🎉🚀 and a family 👨‍👩‍👧 in a row.",
    "中文测试：你好，世界。日本語もです。",
    "Combining marks: e\u0301 a\u0300 n\u0303 and Zalgo h\u0336\u034fe\u0335llo.",
    "Mixed: café ☕ naïve — “quotes” …",
]


def stream(tokenizer, token_ids, params):
    detok = IncrementalDetokenizer(tokenizer, params)
    shown = []
    stop = None
    for token in token_ids:
        stop = detok.add_token(token)
        shown.append(detok.visible_text)
        if stop is not None:
            break
    if stop is None:
        detok.finish(list(token_ids))
    shown.append(detok.visible_text)
    return detok, shown, stop


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok, shown, _ = stream(tokenizer, ids, SamplingParams())
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True) == text
    for earlier, later in zip(shown, shown[1:]):
        assert later.startswith(earlier)
    # No partial character is ever shown: every prefix is valid text of the original.
    assert all(text.startswith(s) for s in shown)


@pytest.mark.parametrize("text", TEXTS)
def test_final_only_text_is_decoded_once_at_the_end(tokenizer, text):
    ids = tokenizer.encode(text)
    final_only = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)
    detok, shown, _ = stream(tokenizer, ids, final_only)
    assert shown[:-1] == [""] * len(ids)  # no per-token decoding: nobody reads it before the end
    assert detok.text == shown[-1] == text
    # Stop strings still need the text as it grows.
    stopped, _, hit = stream(tokenizer, ids, attrs.evolve(final_only, stop=[text[-3:]]))
    assert hit == text[-3:] and stopped.text == text[:text.rindex(hit)]


def test_utf8_split_across_tokens_is_held_back(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1  # byte-level BPE splits the emoji
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    assert detok.add_token(ids[0]) is None and detok.visible_text == ""
    for token in ids[1:]:
        detok.add_token(token)
    assert detok.visible_text == "🎉"


def test_unfinished_character_at_the_end_shows_as_the_full_decode_does(tokenizer):
    ids = tokenizer.encode("ok 🎉")[:-1]
    detok, shown, _ = stream(tokenizer, ids, SamplingParams())
    assert detok.visible_text == tokenizer.decode(ids)


@pytest.mark.parametrize("text, stop, expected", [
    ("The answer is forty-two, obviously.", "forty-two", "The answer is "),
    ("Emoji: 🎉🚀 and more", "🚀", "Emoji: 🎉"),
    ("a b c STOP d e", " STOP", "a b c"),
    ("中文测试：你好，世界。", "世界", "中文测试：你好，"),
])
def test_stop_string_split_across_tokens(tokenizer, text, stop, expected):
    ids = tokenizer.encode(text)
    detok, shown, hit = stream(tokenizer, ids, SamplingParams(stop=[stop]))
    assert hit == stop
    assert detok.visible_text == expected
    assert all(expected.startswith(s) for s in shown)  # the stop string was never shown
    kept, _, _ = stream(tokenizer, ids, SamplingParams(stop=[stop], include_stop_str_in_output=True))
    assert kept.visible_text == expected + stop


def test_possible_stop_prefix_is_held_back_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["<END>"]))
    ids = tokenizer.encode("value <EN")
    for token in ids:
        detok.add_token(token)
    assert detok.text == "value <EN" and detok.visible_text == "value "
    for token in tokenizer.encode("D? no"):
        detok.add_token(token)
    # "<END? no" turned out not to be "<END>": all of it is released, before the end.
    assert detok.stop_hit is None and detok.visible_text == detok.text == "value <END? no"


def test_min_tokens_holds_back_stop_strings_as_vllm_does(tokenizer):
    """No stop string ends within the first min_tokens tokens' text; one that ends after it
    stops, even if it began before (vLLM's detokenizer: searched once there are more tokens
    than min_tokens, from where the min_tokens-th token's text ended)."""
    ids = tokenizer.encode("1, 2, 3, 4, 5")
    text = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    plain, _, hit = stream(tokenizer, ids, SamplingParams(stop=[","]))
    assert hit == "," and plain.visible_text == "1"
    held = len(tokenizer.encode("1, 2,"))  # the commas after 1 and 2 fall within min_tokens
    detok, shown, hit = stream(tokenizer, ids, SamplingParams(stop=[","], min_tokens=held))
    assert hit == "," and detok.visible_text == "1, 2, 3"
    # a longer stop string than the one found: the search window is the longest's, yet a match
    # wholly within the held text does not count
    detok, _, hit = stream(tokenizer, ids, SamplingParams(stop=[",", "zzzz"], min_tokens=held))
    assert hit == "," and detok.visible_text == "1, 2, 3"
    # a stop string that began within min_tokens and ends after: found
    straddle = len(tokenizer.encode("1, 2")) - 1
    assert text[straddle] == "1, "  # (the stop string's ", " within it, its "2" after)
    detok, _, hit = stream(tokenizer, ids, SamplingParams(stop=[", 2"], min_tokens=straddle))
    assert hit == ", 2" and detok.visible_text == "1"
    # past the end of the text: no stop at all, the whole text
    detok, _, hit = stream(tokenizer, ids, SamplingParams(stop=[","], min_tokens=len(ids)))
    assert hit is None and detok.visible_text == "1, 2, 3, 4, 5"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("one two three four")
    detok, _, hit = stream(tokenizer, ids, SamplingParams(stop=["four", "two"]))
    assert hit == "two" and detok.visible_text == "one "


@given(chunks=st.lists(st.text(min_size=1, max_size=5), max_size=12), data=st.data())
def test_text_buffer_slices_like_a_string(chunks, data):
    buffer, text = _TextBuffer(), ""
    for chunk in chunks:
        buffer.append(chunk)
        text += chunk
        start = data.draw(st.integers(0, len(text)))
        end = data.draw(st.integers(start, len(text)))
        assert buffer.slice(start, end) == text[start:end] and buffer.slice(start) == text[start:]
    assert buffer.length == len(text)
    cut = data.draw(st.integers(0, len(text)))
    buffer.reset(buffer.slice(0, cut))
    assert buffer.slice(0) == text[:cut]


@given(tail=st.text(alphabet="ab c", max_size=12), stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=6),
                                                                  min_size=1, max_size=4))
def test_longest_stop_prefix_is_the_naive_answer(tail, stops):
    naive = max((k for s in stops for k in range(min(len(s) - 1, len(tail)) + 1) if tail.endswith(s[:k])), default=0)
    assert longest_stop_prefix(tail, stops) == naive


def test_a_stopped_request_keeps_its_id_until_the_core_has_finished_it(tokenizer):
    """The stream ends at the stop string, but the id stays taken until the core's own finish
    arrives: a delta the core sent before it heard of the stop must not reach a new request."""
    inbox_send, inbox_receive = trio.open_memory_channel(10)
    registry = {}
    actor = OutputActor(None, inbox_send, registry, lambda step, stats: None)
    ids = tokenizer.encode("one two three four")
    state = RequestState("x", None, [1, 2], SamplingParams(stop=["three"]), tokenizer)
    registry["x"] = channel = RequestOutputChannel(state)

    def step(*deltas: TokenDelta) -> None:
        actor.process(StepOutput(deltas, (), STATS, 0, 0, None))

    step(TokenDelta("x", 0, tuple(ids)))
    assert state.finished and channel.poll().outputs[0].text == "one two "
    assert inbox_receive.receive_nowait() == StopRequest("x", 0, "three", len(tokenizer.encode("one two three")))
    assert "x" in registry  # the core has not finished it yet
    kept = list(state.completions[0].token_ids)
    step(TokenDelta("x", 0, tuple(tokenizer.encode(" five"))))  # the core ran one more step: ignored
    assert "x" in registry and state.completions[0].token_ids == kept
    step(TokenDelta("x", 0, (), finish_reason="stop", stop_reason="three"))  # the core's own finish
    assert "x" not in registry


@pytest.fixture(scope="module")
def byte_level_pool(tokenizer) -> list[int]:
    """Token ids that exercise every path of a byte-level vocabulary: special tokens, tokens that
    are bytes of an unfinished character (alone they decode to U+FFFD), and ordinary ones."""
    backend = tokenizer.backend_tokenizer
    size = backend.get_vocab_size(with_added_tokens=True)
    alone = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    partial = [i for i, text in enumerate(alone) if text.endswith("\ufffd")]
    special = [i for i in range(size) if backend.id_to_token(i) in tokenizer.all_special_tokens]
    assert len(partial) > 100 and special
    return partial + special + tokenizer.encode("".join(TEXTS)) + list(range(200, 400))


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@given(data=st.data())
def test_byte_level_texts_stream_as_decode_stream_does(tokenizer, byte_level_pool, skip_special_tokens, data):
    """The table of tokens' own texts (byte-level vocabularies) gives, token by token, exactly
    what tokenizers' DecodeStream gives over the same tokens: also where an unfinished
    character's bytes are followed by an ordinary token, a special one, or another unfinished one."""
    from tokenizers.decoders import DecodeStream

    ids = data.draw(st.lists(st.sampled_from(byte_level_pool), max_size=40))
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(tokenizer, params)
    assert detok._byte_texts is not None  # this vocabulary is byte-level: the table is in use
    reference, expected = DecodeStream(skip_special_tokens=skip_special_tokens), ""
    for token in ids:
        expected += reference.step(tokenizer.backend_tokenizer, token) or ""
        detok.add_token(token)
        assert detok.text == expected


def test_a_plain_stream_never_shows_text_held_back_for_a_stop_string(tokenizer):
    """The common stream (one completion, deltas, no logprobs) reads its next delta up to the
    visible text: a tail that may start a stop string waits until it is known, and the text
    of the deltas joined is the text up to the stop string."""
    inbox_send, inbox_receive = trio.open_memory_channel(10)
    registry = {}
    actor = OutputActor(None, inbox_send, registry, lambda step, stats: None)
    state = RequestState("x", None, [1, 2], SamplingParams(stop=["STOP"], output_kind=RequestOutputKind.DELTA),
                         tokenizer)
    registry["x"] = channel = RequestOutputChannel(state)
    texts = []

    def step(deltas=(), decodes=Decodes()) -> None:
        actor.process(StepOutput(deltas, (), STATS, 0, 0, None, decodes))
        output = channel.poll()
        texts.append(output.outputs[0].text if output is not None else "")

    step((TokenDelta("x", 0, tuple(tokenizer.encode("hello ST"))),))  # the first tokens, then one a step
    assert texts == ["hello "] and state.completions[0].detokenizer.visible_text == "hello "
    for token in tokenizer.encode("OP and more"):
        if state.finished:
            break
        step(decodes=Decodes(("x",), (0,), (token,)))
    assert state.finished and "".join(texts) == "hello "
    assert inbox_receive.receive_nowait() == StopRequest("x", 0, "STOP", len(tokenizer.encode("hello STOP")))


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_stream_interval_holds_tokens_from_a_reader_that_comes_back_every_step(tokenizer, kind):
    """A reader slower than the engine looks after every step (an HTTP stream writing its last
    event): it gets the first token, then every fourth, then the end; never what has come since."""
    state = RequestState("x", None, [1, 2], SamplingParams(output_kind=kind), tokenizer)
    channel = RequestOutputChannel(state, stream_interval=4)
    taken = []
    for i in range(11):
        last = i == 10
        state.apply(TokenDelta("x", 0, (300 + i,), finish_reason="length" if last else None), IterationStats(1.0))
        channel.notify()
        output = channel.poll()
        if output is not None:
            taken.append((i + 1, len(output.outputs[0].token_ids)))
    sizes = [1, 4, 4, 2] if kind is RequestOutputKind.DELTA else [1, 5, 9, 11]
    assert taken == list(zip([1, 5, 9, 11], sizes)) and channel.closed


async def test_a_parked_stream_that_fails_raises_rather_than_reading_the_tokens_before(tokenizer):
    """A stream woken for new tokens and failed before it runs raises the failure: its last
    tokens are not read first."""
    state = RequestState("x", None, [1, 2], SamplingParams(output_kind=RequestOutputKind.DELTA), tokenizer)
    channel = RequestOutputChannel(state)
    read = []

    async def consume():
        with pytest.raises(RuntimeError, match="boom"):
            read.append(await channel.receive())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await trio.testing.wait_all_tasks_blocked()
        state.apply(TokenDelta("x", 0, (42,)), IterationStats(1.0))
        channel.notify()
        channel.fail(RuntimeError("boom"))
    assert read == []


def test_a_tokenizer_path_that_is_not_there_or_holds_none_is_a_config_error_naming_it(tmp_path):
    """Local files only: a name that is no path (a hub id) is not fetched, and a directory with no
    tokenizer files says so, in the one line the server exits with."""
    from engine.errors import ConfigError
    from engine.models.loader import resolve_model
    from engine.tokenizer import load_tokenizer

    source = resolve_model(None)
    for wrong, said in (("someorg/somemodel", "not found"), (str(tmp_path / "t.gguf"), "not found"),
                        (str(tmp_path), "no tokenizer read there \\(no tokenizer files there")):
        with pytest.raises(ConfigError, match=said) as error:
            load_tokenizer(source, wrong)
        assert error.value.param == "tokenizer"
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="no tokenizer read there"):
        load_tokenizer(source, str(tmp_path))
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "tokenizer.json").write_text('{"model": 1}')  # (the tokenizers library's own exception)
    with pytest.raises(ConfigError, match="no tokenizer read there"):
        load_tokenizer(source, str(tmp_path))


def test_each_token_s_bytes_are_its_own_and_join_into_the_text(tokenizer, caplog):
    """``token_bytes``: pieces of a character are the character's bytes in parts (each alone no
    UTF-8), and a tokenizer xgrammar cannot read gives none (logprobs fall back to the text's)."""
    from engine.tokenizer import token_bytes

    table = token_bytes(tokenizer)
    assert len(table) == len(tokenizer)
    text = "caf\u00e9 \U0001f63a \u65e5\u672c"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(table[i] for i in ids) == text.encode()
    assert any(not _utf8(table[i]) for i in ids)  # (some token is part of a character)
    assert table[tokenizer.convert_tokens_to_ids("<|im_end|>")] == b"<|im_end|>"
    with caplog.at_level("WARNING"):
        assert token_bytes(object()) == ()
    assert "xgrammar cannot read" in caplog.text


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def sentencepiece_tokenizer():
    """A Llama-2-style tokenizer (▁ for spaces, byte fallback, and a decoder that strips the
    space its text begins with), over a few words and the 256 byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    words = ["<unk>", "▁The", "▁capital", "▁is", "▁Paris", ".", "▁café"]
    vocab = {word: i for i, word in enumerate(words)}
    vocab.update({f"<0x{b:02X}>": len(words) + b for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok, vocab


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_a_decoder_that_strips_a_leading_space_keeps_the_completions_first_one(kind):
    """SentencePiece decoders drop the space that begins what they decode: the completion is
    read after the prompt's last tokens (as vLLM primes its stream), so " Paris" keeps its space
    and prompt + completion reads as the whole sequence does, streamed or decoded at the end."""
    tok, vocab = sentencepiece_tokenizer()
    prompt = [vocab["▁The"], vocab["▁capital"], vocab["▁is"]]
    emoji = [vocab[f"<0x{b:02X}>"] for b in "🙂".encode()]  # (a character over four byte tokens)
    completion = [vocab["▁Paris"], vocab["."], *emoji, vocab["▁café"]]
    whole = tok.decode(prompt + completion)
    assert whole == "The capital is Paris.🙂 café" and tok.decode(completion).startswith("Paris")
    detok = IncrementalDetokenizer(tok, SamplingParams(output_kind=kind), prompt)
    shown = []
    for token in completion:
        detok.add_token(token)
        shown.append(detok.visible_text)
    detok.finish(completion)
    assert tok.decode(prompt) + detok.text == whole
    if kind is RequestOutputKind.DELTA:
        assert shown[0] == " Paris" and all(detok.text.startswith(s) for s in shown)


@pytest.mark.parametrize("prompt", [
    ["▁The", "<0xE2>"],  # ends inside a character: nothing of it may come out with the completion
    ["<0x61>", "<0xC3>", "▁The"],  # ids that are no UTF-8 (tokenizers' stream raises on them)
    [],
])
def test_a_prompt_that_does_not_decode_to_whole_characters_leaves_the_completion_alone(prompt):
    tok, vocab = sentencepiece_tokenizer()
    completion = [vocab["▁Paris"], vocab["."]]
    shown = []
    detok = IncrementalDetokenizer(tok, SamplingParams(output_kind=RequestOutputKind.DELTA),
                                   [vocab[t] for t in prompt])
    for token in completion:
        detok.add_token(token)
        shown.append(detok.visible_text)
    detok.finish(completion)
    assert detok.text.lstrip() == "Paris." and shown[-1] == detok.text


def test_stop_strings_found_at_the_same_place_go_by_the_requests_order(tokenizer):
    """The earliest match wins; at the same place (one token made both), the stop string listed
    first (vLLM's order): "\n\n" before "\n", whichever sorts first."""
    for stops, hit in [(["\n\n", "\n"], "\n\n"), (["\n", "\n\n"], "\n"), (["b", "\n\n", "\n"], "\n\n")]:
        detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=stops, include_stop_str_in_output=True))
        for token in [tokenizer.encode("a")[0], 1116, tokenizer.encode("b")[0]]:  # (1116: "\n\n", one token)
            if detok.add_token(token) is not None:
                break
        assert (detok.stop_hit, detok.text) == (hit, "a" + hit), stops


def test_logprobs_give_a_character_of_several_tokens_to_the_token_that_completes_it(tokenizer):
    """A token that ends inside a character (byte-level pieces of an emoji) has "" as its text,
    and the one that completes it the whole character (vLLM's, from the tokens before it):
    the tokens' texts add up to the text; whole tokens keep their own."""
    text = "I love 😀😀 中文!"
    ids = tokenizer.encode(text)
    assert sum(tokenizer.decode([t]).endswith("\ufffd") for t in ids) >= 4
    state = RequestState("x", None, [1, 2], SamplingParams(logprobs=1, max_tokens=len(ids)), tokenizer)
    lps = tuple(TokenLogprobs(t, -0.5, 2, (ids[0], t), (-0.25, -0.5)) for t in ids)
    state.apply(TokenDelta("x", 0, tuple(ids), lps, finish_reason="length"), IterationStats(1.0))
    output = state.completion_output(0)
    texts = [position[t].decoded_token for t, position in zip(ids, output.logprobs)]
    assert output.text == text and "".join(texts) == text
    assert all(t == tokenizer.decode([i]) for t, i in zip(texts, ids) if not tokenizer.decode([i]).endswith("\ufffd"))
    assert [position[ids[0]].decoded_token for position in output.logprobs] == ["I"] * len(ids)  # (an alternative)
    # A prompt that ends inside a character: the completion's first token completes it, read after it.
    ab, piece, last = tokenizer.encode("ab 😀")
    state = RequestState("y", None, [ab, piece], SamplingParams(logprobs=0, max_tokens=1), tokenizer)
    state.apply(TokenDelta("y", 0, (last,), (TokenLogprobs(last, -0.5, 1, (), ()),), finish_reason="length"),
                IterationStats(1.0))
    assert state.completion_output(0).logprobs[0][last].decoded_token == " 😀"


def test_a_stop_string_in_the_bytes_flushed_at_the_end_is_found(tokenizer):
    """A completion cut off inside a character flushes its bytes as U+FFFD at the end; a stop
    string that this completes ends the text there and finishes the completion as 'stop'."""
    ids = tokenizer.encode("ab🙂", add_special_tokens=False)
    partial = ids[:-1]  # (the emoji's last byte missing)
    assert tokenizer.decode(partial).endswith("\ufffd")
    params = SamplingParams(stop=["b\ufffd"], max_tokens=len(partial), output_kind=RequestOutputKind.FINAL_ONLY)
    state = RequestState("r", None, [1, 2], params, tokenizer)
    state.apply(TokenDelta("r", 0, tuple(partial), finish_reason="length"), IterationStats(1.0))
    completion = state.completions[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "b\ufffd")
    assert completion.detokenizer.text == "a"
