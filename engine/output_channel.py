"""One request's output channel: a latest-state mailbox between the detokenizer and a consumer.

The detokenizer updates the request's ``RequestState`` and calls ``notify()``; it never
waits. The consumer's ``receive()`` builds its next ``RequestOutput`` from whatever
state it finds, so a slow consumer sees deltas coalesced (text concatenated, token ids
appended, the latest finish state) rather than stalling anyone.
"""

from __future__ import annotations

import trio

from engine.output_processor import RequestState
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind


class RequestOutputChannel:
    """Resource handling: owns nothing but its state; ``fail`` or the final output ends it."""

    def __init__(self, state: RequestState) -> None:
        self.state = state
        self.kind = state.params.output_kind
        self._event = trio.Event()
        self._error: BaseException | None = None
        self._closed = False
        n = state.params.n
        self._sent_chars = [0] * n
        self._sent_tokens = [0] * n
        self._sent_finished = [False] * n
        self._sent_prompt_logprobs = False

    # ---- producer side (never blocks) ----

    def notify(self) -> None:
        self._event.set()

    def fail(self, error: BaseException) -> None:
        """End the stream: the consumer's next ``receive`` raises ``error``."""
        if self._error is None:
            self._error = error
        self._event.set()

    # ---- consumer side ----

    async def receive(self) -> RequestOutput:
        """The next output.

        Raises:
            trio.EndOfChannel: the final output has been received.
            Exception: whatever ``fail`` was given (e.g. EngineDeadError, InvalidParameterError).

        Like trio's own channels, it is a checkpoint even when an output is ready.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        output = self._next()
        if output is not None:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return output
        while output is None:  # each wait is itself a checkpoint
            self._event = trio.Event()
            await self._event.wait()
            output = self._next()
        return output

    def _next(self) -> RequestOutput | None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise trio.EndOfChannel
        return self._take()

    def __aiter__(self) -> RequestOutputChannel:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def _take(self) -> RequestOutput | None:
        state = self.state
        if self.kind is RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        changed = [i for i in range(len(state.completions)) if self._changed(i)]
        if not changed:
            return None
        if self.kind is RequestOutputKind.DELTA:
            outputs = [state.completion_output(i, self._sent_chars[i], self._sent_tokens[i]) for i in changed]
            prompt_logprobs = None if self._sent_prompt_logprobs else state.prompt_logprobs_output()
        else:
            outputs = [state.completion_output(i) for i in range(len(state.completions))]
            prompt_logprobs = state.prompt_logprobs_output()
        self._mark_sent(changed)
        self._closed = state.finished
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, prompt_logprobs, outputs,
                             state.finished, state.num_cached_tokens, state.first_scheduled_at)

    def _changed(self, index: int) -> bool:
        c = self.state.completions[index]
        return (c.detokenizer.num_visible > self._sent_chars[index] or len(c.token_ids) > self._sent_tokens[index]
                or (c.finish_reason is not None and not self._sent_finished[index]))

    def _mark_sent(self, indices: list[int]) -> None:
        for i in indices:
            c = self.state.completions[i]
            self._sent_chars[i] = c.detokenizer.num_visible
            self._sent_tokens[i] = len(c.token_ids)
            self._sent_finished[i] = c.finish_reason is not None
        self._sent_prompt_logprobs = True
