"""Incremental detokenization with stop strings (text only: no request state, no channels).

Text is produced token by token with tokenizers' ``DecodeStream`` (it holds back bytes of
an incomplete UTF-8 character), or, for byte-level vocabularies, from each token's own text
where that is the same thing (``_ByteLevelTexts``). On top of that, text that could be the
start of a stop string is held back until it is known not to be one, so that what a stream has
shown is always a prefix of the final text.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Sequence

from tokenizers.decoders import ByteLevel, DecodeStream

from engine.sampling_params import RequestOutputKind, SamplingParams


class _TextBuffer:
    """Text grown by appends and read by slices, without joining all of it each time, so the
    per-token work of a long completion stays proportional to the new text."""

    def __init__(self) -> None:
        self._chunks: list[str] = []
        self._starts: list[int] = []  # offset of each chunk
        self.length = 0

    def append(self, chunk: str) -> None:
        self._starts.append(self.length)
        self._chunks.append(chunk)
        self.length += len(chunk)

    def slice(self, start: int, end: int | None = None) -> str:
        end = self.length if end is None else end
        if start >= end:
            return ""
        if self._starts and start >= self._starts[-1]:  # a stream's next delta: within the last chunk
            last = self._starts[-1]
            return self._chunks[-1][start - last:end - last]
        first = bisect.bisect_right(self._starts, start) - 1
        last = bisect.bisect_left(self._starts, end)
        joined = "".join(self._chunks[first:last])
        offset = start - self._starts[first]
        return joined[offset:offset + end - start]

    def reset(self, text: str) -> None:
        self._chunks, self._starts, self.length = [], [], 0
        if text:
            self.append(text)


class _ByteLevelTexts:
    """Each token's text on its own, for a byte-level decoder (GPT-2's, Llama 3's, Qwen's,
    SmolLM's): there the text of a sequence is its tokens' bytes joined and read as UTF-8, so
    after a token that ended on a whole character, the next token's text is the text it has
    alone, whenever that does not end in an unfinished character (U+FFFD, where DecodeStream
    waits). DecodeStream decodes its window again at every token (1.5 us); this is a dict
    lookup. Filled as tokens are first seen, per tokenizer and ``skip_special_tokens``.
    """

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, tokenizer, skip_special_tokens: bool) -> dict[int, str | None] | None:
        """token id -> its text, or None where the stream must decide; None for other decoders."""
        if not isinstance(getattr(tokenizer, "decoder", None), ByteLevel):
            return None
        tables = cls._cache.get(tokenizer)
        if tables is None:
            tables = cls._cache[tokenizer] = {}
        return tables.setdefault(skip_special_tokens, {})


class IncrementalDetokenizer:
    """The text of one completion, grown one token at a time.

    ``text`` is everything decoded so far (minus anything after a stop string);
    ``visible_text`` is the part safe to show: it excludes a tail that may still turn out
    to be the start of a stop string. Streams read ``visible_since(offset)``. A final-only
    request without stop strings is decoded only at ``finish`` (its text is empty until then).
    """

    def __init__(self, tokenizer, params: SamplingParams, prompt_token_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer.backend_tokenizer if hasattr(tokenizer, "backend_tokenizer") else tokenizer
        self._skip_special = params.skip_special_tokens
        # Nobody reads the text of a final-only request before it ends, and with no stop
        # strings nothing needs it either: it is decoded once, at the end.
        self._lazy = params.output_kind is RequestOutputKind.FINAL_ONLY and not params.stop
        # Byte-level tokens' own texts; ``_texts`` is that table while no bytes of an unfinished
        # character are held, else None (and ``_stream`` decides).
        self._byte_texts = _ByteLevelTexts.of(self._tokenizer, params.skip_special_tokens)
        self._texts = self._byte_texts
        # Other decoders (SentencePiece's, Metaspace) drop the space that begins the text they
        # decode: the stream starts after the prompt's last tokens (``_prefix``), as vLLM's does,
        # so that the completion's first word keeps its space.
        self._prefix = _prompt_tail(self._tokenizer, prompt_token_ids, self._skip_special) if self._texts is None else []
        self._stream = None
        if self._texts is None and not self._lazy:
            self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
            try:
                for token_id in self._prefix:
                    self._stream.step(self._tokenizer, token_id)
            except Exception:  # (tokenizers' own, for ids that are no UTF-8: the completion alone, then)
                self._prefix = []
                self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        # min_tokens holds back stop strings as it holds back stop tokens (as vLLM): until the
        # completion has more tokens than that, none is looked for, and then only one that ends
        # past the text of the first min_tokens tokens (``_stop_floor``, in characters).
        self._tokens_before_stops = params.min_tokens
        self._stop_floor = 0
        self._text = _TextBuffer()
        # The text between two offsets: the buffer's own method, so that a stream's read of
        # its next delta is one call.
        self.text_between = self._text.slice
        self.num_visible = 0
        self.stop_hit: str | None = None

    @property
    def text(self) -> str:
        return self._text.slice(0)

    @property
    def visible_text(self) -> str:
        return self._text.slice(0, self.num_visible)

    def visible_since(self, start: int) -> str:
        return self._text.slice(start, self.num_visible)

    def add_token(self, token_id: int) -> str | None:
        """Decode one more token; return the stop string if this token completed one."""
        if self._lazy or self.stop_hit is not None:
            return None
        search = True
        if self._tokens_before_stops:  # (within min_tokens: no stop string ends in this text)
            self._tokens_before_stops -= 1
            search = False
        texts = self._texts
        chunk = texts.get(token_id) if texts is not None else None
        if chunk is None:
            chunk = self._decode(token_id)
        if chunk:
            text = self._text  # (its ``append``, written out: every stream, every step)
            previous = text.length
            text._starts.append(previous)
            text._chunks.append(chunk)
            text.length = length = previous + len(chunk)
            if self._stops:
                if search and self._find_stop(previous):
                    return self.stop_hit
                self.num_visible = length - self._held_back()
            else:
                self.num_visible = length
        if not search:
            self._stop_floor = self._text.length
        return None

    def _decode(self, token_id: int) -> str | None:
        """``add_token``'s text where the table has none: a token not seen yet, or the stream's."""
        texts = self._texts
        if texts is not None:
            if token_id not in texts:
                text = self._tokenizer.decode([token_id], skip_special_tokens=self._skip_special)
                texts[token_id] = None if text.endswith("\ufffd") else text
            if texts[token_id] is not None:
                return texts[token_id]
            # Bytes of an unfinished character: a stream from here on holds them back. Here
            # everything before decoded to whole characters, so a fresh one reads what follows
            # as the stream of the whole text would.
            self._texts = None
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
        try:
            chunk = self._stream.step(self._tokenizer, token_id)
        except Exception as exc:
            if "Invalid prefix" not in str(exc):
                raise
            # tokenizers' stream fails where bytes that are no UTF-8 make the decode of its window
            # change what it read before (as vLLM, which meets the same): a fresh stream goes on.
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
            chunk = self._stream.step(self._tokenizer, token_id)
        if chunk is not None and self._byte_texts is not None:
            self._texts = self._byte_texts  # it ended on a whole character
        return chunk

    def finish(self, token_ids: list[int]) -> None:
        """The completion ended: nothing is held back any more. Bytes of an unfinished UTF-8
        character are flushed as the tokenizer's full decode would show them (a stop string
        they complete is found, and ``stop_hit`` says so)."""
        if self.stop_hit is None:
            full = self._decode_all(token_ids)
            previous = self._text.length
            if full.startswith(self.text):
                self._text.reset(full)
                if self._stops and not self._tokens_before_stops and self._text.length > previous:
                    self._find_stop(previous)
        self.num_visible = self._text.length

    def _decode_all(self, token_ids: list[int]) -> str:
        """The completion's text at once, as the stream reads it (after the prompt's ``_prefix``)."""
        decode = self._tokenizer.decode
        if self._prefix:
            before = decode(self._prefix, skip_special_tokens=self._skip_special)
            full = decode(self._prefix + list(token_ids), skip_special_tokens=self._skip_special)
            if full.startswith(before):
                return full[len(before):]
        return decode(token_ids, skip_special_tokens=self._skip_special)

    def _find_stop(self, previous: int) -> bool:
        window_start = max(0, previous - self._longest_stop + 1)
        window = self._text.slice(window_start)
        floor = self._stop_floor - window_start  # (a match ends past it: 0 or less but after min_tokens)
        found = [(pos, i, s) for i, s in enumerate(self._stops)
                 if (pos := window.find(s, max(0, floor - len(s) + 1))) >= 0]
        if not found:
            return False
        pos, _, stop = min(found)  # the earliest; at one place, the first listed (vLLM's order)
        cut = window_start + pos + (len(stop) if self._include_stop else 0)
        self._text.reset(self._text.slice(0, cut))
        self.num_visible = self._text.length
        self.stop_hit = stop
        return True

    def _held_back(self) -> int:
        if not self._stops:
            return 0
        return longest_stop_prefix(self._text.slice(max(0, self._text.length - self._longest_stop + 1)), self._stops)


def _prompt_tail(tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> list[int]:
    """The prompt's last 4 to 24 tokens (fewer in a shorter prompt) that decode to whole
    characters, as vLLM chooses them; none where every such tail has U+FFFD (a prompt ending
    inside a character: the stream would hold its bytes and show them with the completion)."""
    ids = list(prompt_token_ids[-24:])
    for n in range(min(4, len(ids)), len(ids) + 1):
        if "\ufffd" not in tokenizer.decode(ids[len(ids) - n:], skip_special_tokens=skip_special_tokens):
            return ids[len(ids) - n:]
    return []


def longest_stop_prefix(tail: str, stops: list[str]) -> int:
    """Length of the longest end of ``tail`` that is a proper prefix of one of ``stops``.

    Such an end starts where ``tail`` has the stop string's first character, so only those
    places are tried, longest first: a few per stop string for real text.
    """
    longest = 0
    for stop in stops:
        start = max(0, len(tail) - len(stop) + 1)  # a proper prefix is shorter than the stop string
        while (start := tail.find(stop[0], start, len(tail) - longest)) >= 0:
            if stop.startswith(tail[start:]):
                longest = len(tail) - start
                break
            start += 1
    return longest
