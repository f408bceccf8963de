"""Reasoning output (``--reasoning-parser``): the text a thinking model writes between
``<think>`` and ``</think>``, split from its answer as it streams.

Parsers, named as in vLLM:

- ``deepseek_r1``: DeepSeek-R1 and its distillations. The output is reasoning until
  ``</think>``, whether or not it (or the prompt) opened the block: R1's template writes
  ``<think>`` into the prompt, and some distillations leave it out (an opening tag the output
  writes itself is dropped).
- ``qwen3``: Qwen3 and QwQ. The output is reasoning only inside a block: one the prompt left
  open (Qwen3-Thinking's template), or one the output opens with ``<think>``.

Where the output begins is read from the end of the rendered prompt (``ReasoningParser.opening``):
a template that opened a block there begins the output in reasoning; one that closed an empty
block there (Qwen3's ``enable_thinking: false``) begins it in the answer, so the answer is never
taken for reasoning when thinking is off. Tags earlier in the conversation (a user quoting one,
an earlier turn) do not count; an assistant message being continued says where it left off.

A request's output constraint (``response_format``, tools) applies to the answer only: the
reasoning block comes first in its grammar (``ReasoningParser.constrain``), free text that a
``thinking_token_budget`` bounds in tokens, and the closing tag is then forced.
"""

from __future__ import annotations

import enum
import re
from typing import Any

import attrs

from engine.errors import InvalidParameterError
from engine.sampling_params import SamplingParams, StructuredOutputsParams

# What may come between the closing tag and the answer (Qwen3 writes "</think>\n\n").
_GAP = r"[ \n]{0,4}"


class Opening(enum.Enum):
    """Where a request's output begins."""

    REASONING = "reasoning"  # inside a reasoning block the prompt opened
    UNOPENED = "unopened"  # reasoning until the closing tag; the output may write the opening tag first
    MAYBE = "maybe"  # in the answer, unless the output opens a block first
    CONTENT = "content"  # in the answer (thinking is off)


@attrs.frozen
class ReasoningParser:
    """A model family's reasoning markup.

    Attributes:
        name: the ``--reasoning-parser`` name.
        implicit_start: output that has not opened a block is reasoning until the closing tag.
        start: the opening tag.
        end: the closing tag.
    """

    name: str
    implicit_start: bool
    start: str = "<think>"
    end: str = "</think>"

    def opening(self, prompt_text: str, continued: str | None = None) -> Opening:
        """Where the output of a prompt (its rendered text) begins; ``continued``: the content of
        the assistant message the output continues (``continue_final_message``)."""
        if continued is not None:
            last_start, last_end = continued.rfind(self.start), continued.rfind(self.end)
            if last_start > last_end:
                return Opening.REASONING  # it stopped inside its reasoning
            if last_end >= 0:
                return Opening.CONTENT  # it stopped in its answer
        last_start, last_end = prompt_text.rfind(self.start), prompt_text.rfind(self.end)
        if last_start > last_end and not prompt_text[last_start + len(self.start):].strip():
            return Opening.REASONING  # the template opened a block
        if last_end > last_start and not prompt_text[last_end + len(self.end):].strip():
            return Opening.CONTENT  # the template closed the block itself: thinking is off
        return Opening.UNOPENED if self.implicit_start else Opening.MAYBE

    def splitter(self, opening: Opening) -> ReasoningSplitter:
        return ReasoningSplitter(self, opening)

    def constrain(self, params: SamplingParams, opening: Opening, budget: int | None) -> SamplingParams:
        """``params`` with the reasoning block ahead of its constraint in the grammar (and the
        budget in it); unchanged when the output begins in the answer, or when nothing
        constrains the output and there is no budget. Where the output may open a block
        (``MAYBE``), a budget makes the block required: a request with a budget is one that
        thinks, and an answer that may open a block of its own would escape the budget."""
        constraint = params.structured_outputs
        if opening is Opening.CONTENT or (constraint is None and budget is None):
            return params
        from engine.tools import as_structural_format

        answer = {"type": "any_text"} if constraint is None else as_structural_format(constraint, "structured_outputs")
        thinking = {"type": "tag", "begin": self.start if opening is Opening.MAYBE else "",
                    "content": {"type": "any_text", "excludes": [self.start, self.end], "max_tokens": budget},
                    "end": self.end}
        elements = [thinking, {"type": "regex", "pattern": _GAP}, answer]
        if opening is Opening.UNOPENED:
            elements.insert(0, {"type": "regex", "pattern": f"({re.escape(self.start)})?"})
        output = {"type": "sequence", "elements": elements}
        if opening is Opening.MAYBE and budget is None:
            output = {"type": "or", "elements": [output, answer]}
        tag = {"type": "structural_tag", "format": output}
        return attrs.evolve(params, structured_outputs=StructuredOutputsParams(structural_tag=tag))


REASONING_PARSERS = {p.name: p for p in (ReasoningParser("deepseek_r1", implicit_start=True),
                                         ReasoningParser("qwen3", implicit_start=False))}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser of that name (None for None).

    Raises:
        InvalidParameterError: an unknown name (naming the ones there are).
    """
    if name is None:
        return None
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise InvalidParameterError("reasoning_parser", f"unknown reasoning parser {name!r}; choose from "
                                                        f"{', '.join(REASONING_PARSERS)}")
    return parser


def check_budget(budget: Any) -> int | None:
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise InvalidParameterError("thinking_token_budget", "thinking_token_budget must be a positive integer")
    return budget


@attrs.frozen
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


_IN_REASONING, _UNOPENED, _MAY_OPEN, _AFTER_REASONING, _IN_CONTENT = range(5)


class ReasoningSplitter:
    """Splits one sequence's output into reasoning and answer as it streams.

    Feeding the whole text at once gives what the deltas add up to, however the text was cut
    (a tag split across tokens or chunks is held back until it is known). The reasoning is
    kept as written between the tags; whitespace between the closing tag and the answer is
    not part of either, nor is the start of a closing tag an output was cut off in.
    ``reasoning_start`` is the offset in the output text where the reasoning began (past an
    opening tag the output wrote itself), ``reasoning_end`` where it stopped (None while it
    goes on), ``closed`` whether it was closed.
    """

    def __init__(self, parser: ReasoningParser, opening: Opening) -> None:
        self.parser = parser
        self._state = {Opening.REASONING: _IN_REASONING, Opening.UNOPENED: _UNOPENED, Opening.MAYBE: _MAY_OPEN,
                       Opening.CONTENT: _IN_CONTENT}[opening]
        self._buffer = ""
        self._consumed = 0  # characters of output before the buffer
        self.has_reasoning = self._state in (_IN_REASONING, _UNOPENED)
        self.reasoning_end: int | None = None if self.has_reasoning else 0
        self.reasoning_start = 0  # offset where the reasoning begins: after an opening tag the output wrote
        self.closed = False

    @property
    def in_reasoning(self) -> bool:
        return self._state == _IN_REASONING

    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        self._buffer += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state in (_MAY_OPEN, _UNOPENED):
                start = self.parser.start
                stripped = self._buffer.lstrip()
                if stripped.startswith(start):
                    self._take(len(self._buffer) - len(stripped) + len(start))
                    self._state, self.has_reasoning, self.reasoning_end = _IN_REASONING, True, None
                    self.reasoning_start = self._consumed
                    continue
                if start.startswith(stripped) and not final:
                    break  # (still) maybe the opening tag
                self._state = _IN_REASONING if self._state == _UNOPENED else _IN_CONTENT
            elif self._state == _IN_REASONING:
                end = self.parser.end
                at = self._buffer.find(end)
                if at < 0:
                    keep = _held_back(self._buffer, end)
                    if final and keep < 2:  # ("<" alone is text; "</" on is a cut-off closing tag)
                        keep = 0
                    reasoning.append(self._take(len(self._buffer) - keep))
                    if final:
                        self.reasoning_end = self._consumed
                        self._take(keep)
                    break
                reasoning.append(self._take(at))
                self.reasoning_end = self._consumed
                self.closed = True
                self._take(len(end))
                self._state = _AFTER_REASONING
            elif self._state == _AFTER_REASONING:
                stripped = self._buffer.lstrip()
                self._take(len(self._buffer) - len(stripped))
                if not stripped:
                    break
                self._state = _IN_CONTENT
            else:
                content.append(self._take(len(self._buffer)))
                break
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _take(self, size: int) -> str:
        taken, self._buffer = self._buffer[:size], self._buffer[size:]
        self._consumed += size
        return taken


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may begin ``marker`` (and so must wait)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def split_reasoning(parser: ReasoningParser, opening: Opening, text: str) -> tuple[str | None, str, int]:
    """A whole output's reasoning (None when it has none), its answer, and the offset where its
    reasoning ended."""
    splitter = parser.splitter(opening)
    delta = splitter.feed(text, final=True)
    return (delta.reasoning if splitter.has_reasoning else None), delta.content, splitter.reasoning_end or 0


def count_reasoning_tokens(decode, token_ids: list[int], reasoning_end: int) -> int:
    """How many of an output's tokens lie within its reasoning (the first ``reasoning_end``
    characters of its text): the longest prefix whose text is no longer. ``decode`` turns
    token ids into text as the output's text was made."""
    if reasoning_end <= 0:
        return 0
    low, high = 0, len(token_ids)  # invariant: the text of token_ids[:low] is within the reasoning
    while low < high:
        mid = (low + high + 1) // 2
        if len(decode(token_ids[:mid])) <= reasoning_end:
            low = mid
        else:
            high = mid - 1
    return low
