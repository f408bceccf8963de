"""One request's output channel: a latest-state mailbox between the detokenizer and a consumer.

The detokenizer updates the request's ``RequestState`` and calls ``notify()``; it never
waits. The consumer's ``receive()`` builds its next ``RequestOutput`` from whatever
state it finds, so a slow consumer sees deltas coalesced (text concatenated, token ids
appended, the latest finish state) rather than stalling anyone.
"""

from __future__ import annotations

import types
from collections.abc import Awaitable

import outcome
import trio
from trio.lowlevel import current_task, reschedule, wait_task_rescheduled

from engine.frontend.request_state import RequestState
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind


class _Resumed(outcome.Value):
    """What a woken waiter's ``wait_task_rescheduled`` returns: None, every time.

    trio resumes a task with an ``Outcome`` and only unwraps it; an ``outcome.Value`` refuses a
    second unwrap, so ``reschedule`` builds one per wake-up, and at hundreds of streams that
    (1 us each here) is a sixth of the wake-ups' cost. This one is shared: unwrapping it twice
    is harmless since it holds nothing.
    """

    __slots__ = ()

    def unwrap(self) -> None:
        return None

    def send(self, gen):
        return gen.send(None)


_RESUMED = _Resumed(None)


def _trio_wait_trap() -> type | None:
    """trio's message for "park this task", if its public ``wait_task_rescheduled`` is still
    just a yield of one (then yielding a kept instance is exactly what that function does).

    The message is private to trio, but building one is most of the cost of a wait: an attrs
    frozen instance per call, and a coroutine around it (9% of the engine's instructions at
    256 streams). A trio whose wait works otherwise gets the public function.
    """
    try:
        from trio._core._traps import WaitTaskRescheduled
    except ImportError:
        return None
    names = wait_task_rescheduled.__code__.co_names
    return WaitTaskRescheduled if "WaitTaskRescheduled" in names and "_async_yield" in names else None


_WAIT_TRAP = _trio_wait_trap()


@types.coroutine
def _yield_to_trio(trap):
    """``wait_task_rescheduled`` with a message built beforehand."""
    return (yield trap).unwrap()


class Wakeup:
    """A re-arming event: producers ``set`` it without blocking; one consumer ``wait``s for the
    next ``set`` since its previous wait returned (a set in between is not lost).

    Built on trio's task parking rather than a new ``trio.Event`` per wait: every stream
    waits once per engine step, and this halves the cost of a wake-up (one reschedule, no
    parking lot, no allocation). A streaming channel's ``notify`` does what ``set`` does itself
    (every stream, every step), so a subclass's ``set`` is not called there.
    """

    def __init__(self) -> None:
        self._pending = False
        self._waiter: trio.lowlevel.Task | None = None
        self._trap = _WAIT_TRAP(self._abort) if _WAIT_TRAP is not None else None

    def set(self) -> None:
        waiter = self._waiter
        if waiter is None:
            self._pending = True
        else:
            self._waiter = None
            reschedule(waiter, _RESUMED)

    async def wait(self) -> None:
        """Return at the next ``set`` (at once if one came since the last wait). A checkpoint."""
        await self.park()

    def park(self) -> Awaitable[None]:
        """``wait`` for the streams' read loops, which the calling task must await at once.

        Not a coroutine function: it parks the calling task when called and hands back
        trio's wait, so a wake-up resumes one coroutine fewer (a stream waits once per step;
        4% of the engine's instructions at 256 streams). Hence "at once": a task spawned with
        ``park`` would park its parent.
        """
        if self._pending:
            self._pending = False
            return trio.lowlevel.checkpoint()
        if self._waiter is not None:
            raise RuntimeError("a Wakeup has one consumer; another task is waiting on it")
        self._waiter = current_task()
        if self._trap is None:
            return wait_task_rescheduled(self._abort)
        return _yield_to_trio(self._trap)

    def _abort(self, _raise_cancel) -> trio.lowlevel.Abort:
        self._waiter = None
        return trio.lowlevel.Abort.SUCCEEDED


class RequestOutputChannel:
    """Resource handling: owns nothing but its state; ``fail`` or the final output ends it.

    Args:
        state: the request's state, updated by the detokenizer.
        wakeup: what ``notify`` sets; several channels share one when a single consumer
            reads them all (``MergedOutputs``).
        stream_interval: a streaming consumer is woken for a completion's first token, then
            once this many more have come, and at the end (``EngineConfig.stream_interval``).
    """

    def __init__(self, state: RequestState, wakeup: Wakeup | None = None, stream_interval: int = 1) -> None:
        self.state = state
        self.kind = state.params.output_kind
        self._wakeup = wakeup or Wakeup()
        self._stream_interval = stream_interval
        self._error: BaseException | None = None
        self._closed = False
        self._dirty = False  # the state changed since the consumer last looked
        n = state.params.n
        self._sent_chars = [0] * n
        self._sent_tokens = [0] * n
        self._sent_finished = [False] * n
        self._sent_prompt_logprobs = False
        # The common stream (one completion, deltas, no logprobs) takes a shorter path to the same outputs.
        self._wake_on_change = self.kind is not RequestOutputKind.FINAL_ONLY and stream_interval == 1
        # A stream with an interval holds its tokens until one is due, also from a reader that comes
        # back late (it finds the state changed, but a partial output is not its to take).
        self._holds_back = self.kind is not RequestOutputKind.FINAL_ONLY and stream_interval > 1
        self._plain_delta = (self.kind is RequestOutputKind.DELTA and n == 1 and state.params.logprobs is None
                             and state.params.prompt_logprobs is None)
        self._fast_delta = self._plain_delta and not self._holds_back  # (``receive``'s written-out ``poll``)

    # ---- producer side (never blocks) ----

    def notify(self) -> None:
        """The state changed (every change is followed by a notify). A final-only consumer is
        woken only by the end: there is nothing for it to read before; a streaming one with a
        stream interval when one is due (``_due``)."""
        self._dirty = True
        if self._wake_on_change:  # ``self._wakeup.set()``, written out: every stream, every step
            wakeup = self._wakeup
            waiter = wakeup._waiter
            if waiter is None:
                wakeup._pending = True
            else:
                wakeup._waiter = None
                reschedule(waiter, _RESUMED)
        elif self.kind is RequestOutputKind.FINAL_ONLY:
            if self.state.finished:
                self._wakeup.set()
        elif self._due():
            self._wakeup.set()

    def _due(self) -> bool:
        """A completion's first token, ``stream_interval`` tokens since the last output, or the end."""
        if self.state.finished:
            return True
        for i, c in enumerate(self.state.completions):
            sent = self._sent_tokens[i]
            if ((sent == 0 and c.token_ids) or len(c.token_ids) - sent >= self._stream_interval
                    or (c.finish_reason is not None and not self._sent_finished[i])):
                return True
        return False

    def fail(self, error: BaseException) -> None:
        """End the stream: the consumer's next ``receive`` raises ``error``."""
        if self._error is None:
            self._error = error
        self._wakeup.set()

    # ---- consumer side ----

    async def receive(self) -> RequestOutput:
        """The next output.

        Raises:
            trio.EndOfChannel: the final output has been received.
            Exception: whatever ``fail`` was given (e.g. EngineDeadError, InvalidParameterError).

        Like trio's own channels, it is a checkpoint even when an output is ready.
        """
        output = None
        if self._dirty or self._error is not None or self._closed:  # else nothing to read: straight to the wait
            await trio.lowlevel.checkpoint_if_cancelled()
            output = self.poll()
            if output is not None:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return output
        while output is None:  # each wait is itself a checkpoint
            await self._wakeup.park()
            if self._dirty and self._fast_delta and self._error is None:  # (closed: it returned)
                self._dirty = False  # (``poll``, written out for every stream's every step)
                output = self._take_plain_delta()
            else:
                output = self.poll()
        return output

    def poll(self) -> RequestOutput | None:
        """The next output if one is ready, else None (the non-blocking ``receive``)."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise trio.EndOfChannel
        if not self._dirty:  # the common case of the check before each wait
            return None
        if self._holds_back and not self._due():  # (stays dirty: ``notify`` wakes the reader when due)
            return None
        self._dirty = False
        return self._take_plain_delta() if self._plain_delta else self._take()

    @property
    def closed(self) -> bool:
        """The final output has been taken (a failed channel is not closed: it raises)."""
        return self._closed

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

    def _take_plain_delta(self) -> RequestOutput | None:
        """``_take`` for one completion in deltas without logprobs: every stream's every step."""
        state = self.state
        c = state.completions[0]
        detokenizer, token_ids, finish_reason = c.detokenizer, c.token_ids, c.finish_reason
        visible, num_tokens = detokenizer.num_visible, len(token_ids)
        sent_chars, sent_tokens = self._sent_chars[0], self._sent_tokens[0]
        if (visible <= sent_chars and num_tokens <= sent_tokens
                and (finish_reason is None or self._sent_finished[0])):
            return None
        self._sent_chars[0], self._sent_tokens[0] = visible, num_tokens
        self._sent_finished[0] = self._closed = finished = finish_reason is not None  # (state.finished)
        output = CompletionOutput(0, detokenizer.text_between(sent_chars, visible), token_ids[sent_tokens:], None, None,
                                  finish_reason, c.stop_reason)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, None, [output], finished,
                             state.num_cached_tokens, state.times.first_scheduled)

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


class MergedOutputs:
    """The outputs of several requests, read by one consumer as they come: ``(index, output)``
    where ``index`` is the channel's position. No task per request: the channels share one
    ``Wakeup``, and each ``receive`` polls them in turn from where the last one stopped.

    Raises (from ``receive``): whatever a channel raises (the first failing request ends
    the merge); ``trio.EndOfChannel`` once every channel has given its final output.
    """

    def __init__(self, channels: list[RequestOutputChannel], wakeup: Wakeup) -> None:
        self.channels = channels
        self._wakeup = wakeup
        self._next = 0

    async def receive(self) -> tuple[int, RequestOutput]:
        await trio.lowlevel.checkpoint_if_cancelled()
        item = self._poll()
        if item is not None:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return item
        while item is None:
            await self._wakeup.park()
            item = self._poll()
        return item

    def _poll(self) -> tuple[int, RequestOutput] | None:
        count = len(self.channels)
        for offset in range(count):
            index = (self._next + offset) % count
            channel = self.channels[index]
            if channel.closed:
                continue
            output = channel.poll()
            if output is not None:
                self._next = index + 1
                return index, output
        if all(c.closed for c in self.channels):
            raise trio.EndOfChannel
        return None

    def __aiter__(self) -> MergedOutputs:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
