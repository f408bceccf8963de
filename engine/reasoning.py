"""Reasoning output (``--reasoning-parser``): the text a thinking model writes between
``<think>`` and ``</think>``, split from its answer as it streams.

Parsers, named as in vLLM:

- ``deepseek_r1``: DeepSeek-R1 and its distillations. The output is reasoning until
  ``</think>``, whether or not it (or the prompt) opened the block: R1's template writes
  ``<think>`` into the prompt, and some distillations leave it out.
- ``qwen3``: Qwen3 and QwQ. The output is reasoning only inside a block: one the prompt left
  open (Qwen3-Thinking's template), or one the output opens with ``<think>``.

Where the output begins is read from the rendered prompt (``ReasoningParser.opening``): a
prompt that ends inside a block begins in reasoning; one whose template closed an empty block
at its very end (Qwen3's ``enable_thinking: false``) begins in the answer, so the answer is
never taken for reasoning when thinking is off.

A request's output constraint (``response_format``, tools) applies to the answer only: the
reasoning block comes first in its grammar (``ReasoningParser.constrain``), free text that a
``thinking_token_budget`` bounds in tokens, and the closing tag is then forced.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from engine.errors import InvalidParameterError
from engine.sampling_params import SamplingParams, StructuredOutputsParams

# What may come between the closing tag and the answer (Qwen3 writes "</think>\n\n").
_GAP = r"[ \n]{0,4}"


class Opening(enum.Enum):
    """Where a request's output begins."""

    REASONING = "reasoning"  # inside a reasoning block (the prompt opened it, or the parser assumes it)
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

    def opening(self, prompt_text: str) -> Opening:
        """Where the output of a prompt (its rendered text) begins."""
        last_start, last_end = prompt_text.rfind(self.start), prompt_text.rfind(self.end)
        if last_start > last_end:
            return Opening.REASONING
        if last_end >= 0 and not prompt_text[last_end + len(self.end):].strip():
            return Opening.CONTENT  # the template closed the block itself: thinking is off
        return Opening.REASONING if self.implicit_start else Opening.MAYBE

    def splitter(self, opening: Opening) -> ReasoningSplitter:
        return ReasoningSplitter(self, opening)

    def constrain(self, params: SamplingParams, opening: Opening, budget: int | None) -> SamplingParams:
        """``params`` with the reasoning block ahead of its constraint in the grammar (and the
        budget in it); unchanged when the output begins in the answer, or when nothing
        constrains the output and there is no budget."""
        constraint = params.structured_outputs
        if opening is Opening.CONTENT or (constraint is None and budget is None):
            return params
        from engine.tools import as_structural_format

        answer = {"type": "any_text"} if constraint is None else as_structural_format(constraint, "structured_outputs")
        thinking = {"type": "tag", "begin": "" if opening is Opening.REASONING else self.start,
                    "content": {"type": "any_text", "excludes": [self.start, self.end], "max_tokens": budget},
                    "end": self.end}
        after_thinking = {"type": "sequence", "elements": [thinking, {"type": "regex", "pattern": _GAP}, answer]}
        output = after_thinking if opening is Opening.REASONING else {"type": "or", "elements": [after_thinking,
                                                                                                   answer]}
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


_IN_REASONING, _MAY_OPEN, _AFTER_REASONING, _IN_CONTENT = range(4)


class ReasoningSplitter:
    """Splits one sequence's output into reasoning and answer as it streams.

    Feeding the whole text at once gives what the deltas add up to, however the text was cut
    (a tag split across tokens or chunks is held back until it is known). The reasoning is
    kept as written between the tags; whitespace between the closing tag and the answer is
    not part of either. ``reasoning_end`` is the offset in the output text where the
    reasoning stopped (for counting its tokens).
    """

    def __init__(self, parser: ReasoningParser, opening: Opening) -> None:
        self.parser = parser
        self._state = {Opening.REASONING: _IN_REASONING, Opening.MAYBE: _MAY_OPEN,
                       Opening.CONTENT: _IN_CONTENT}[opening]
        self._buffer = ""
        self._consumed = 0  # characters of output before the buffer
        self.reasoning_end: int | None = None if self._state == _IN_REASONING else 0
        self.has_reasoning = self._state == _IN_REASONING

    @property
    def in_reasoning(self) -> bool:
        return self._state == _IN_REASONING

    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        self._buffer += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state == _MAY_OPEN:
                start = self.parser.start
                stripped = self._buffer.lstrip()
                if stripped.startswith(start):
                    self._take(len(self._buffer) - len(stripped) + len(start))
                    self._state, self.has_reasoning, self.reasoning_end = _IN_REASONING, True, None
                    continue
                if start.startswith(stripped) and not final:
                    break  # (still) maybe the opening tag
                self._state = _IN_CONTENT
            elif self._state == _IN_REASONING:
                end = self.parser.end
                at = self._buffer.find(end)
                if at < 0:
                    keep = 0 if final else _held_back(self._buffer, end)
                    reasoning.append(self._take(len(self._buffer) - keep))
                    if final:
                        self.reasoning_end = self._consumed
                    break
                reasoning.append(self._take(at))
                self.reasoning_end = self._consumed
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
