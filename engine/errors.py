"""Typed errors of the engine's public surface.

Every error caused by what a caller passed in is a ``ValueError`` subclass that names the
offending parameter, so that the HTTP layer can map it to a 400 with ``param`` filled in.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from backends.errors import BackendUnavailableError

__all__ = ["BackendUnavailableError", "ConfigError", "EngineDeadError", "EngineOverloadedError", "EngineShutdownError",
           "InvalidParameterError", "ListenError", "RequestFailedError", "StepTimeoutError", "first_leaf",
           "listening_at", "ungrouped"]


class InvalidParameterError(ValueError):
    """A caller-supplied value is out of range or of the wrong kind.

    Attributes:
        param: the name of the parameter (as the caller spelled it) that is wrong.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ConfigError(InvalidParameterError):
    """An engine configuration field (or combination of fields) is invalid."""


class ListenError(RuntimeError):
    """A server socket could not be bound; the message names the flags of its address."""


@contextmanager
def listening_at(where: str) -> Iterator[None]:
    """Around binding a server socket at ``where`` (its flags, e.g. "--host H --port P"): an
    error of the address (no such host, a port in use or not to be had) comes out as a
    ``ListenError`` naming them."""
    try:
        yield
    except (OSError, BaseExceptionGroup) as exc:  # (a server that binds in a nursery's task: grouped)
        leaf = first_leaf(exc)
        if isinstance(leaf, socket.gaierror):
            raise ListenError(f"cannot listen on {where}: {leaf.strerror}") from None
        if isinstance(leaf, OSError) and leaf.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise ListenError(f"cannot listen on {where}: {os.strerror(leaf.errno)}") from None
        raise


class EngineDeadError(RuntimeError):
    """The engine stopped (a fault in a step, or shutdown); in-flight and later requests fail with this.

    The original exception, if any, is ``__cause__``.
    """


class EngineShutdownError(EngineDeadError):
    """The engine was stopped on purpose (shutdown) while requests were still open."""


class StepTimeoutError(RuntimeError):
    """An engine step ran longer than ``step_timeout`` (a hung kernel): the watchdog declares
    the engine dead rather than let every request wait forever."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (``max_waiting_requests``): the request is refused at once.

    Attributes:
        retry_after: seconds after which trying again is reasonable.
    """

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (its sampling set-up, its logits processing, its
    detokenization) while the engine itself is fine: only that request ends with this error.
    """


def first_leaf(error: BaseException) -> BaseException:
    """The first non-group exception inside (nested) exception groups, or ``error`` itself.

    Nurseries wrap a child task's exception in an ExceptionGroup; APIs that fan out to
    tasks internally use this to raise the error their caller expects.
    """
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


@contextmanager
def ungrouped() -> Iterator[None]:
    """Around a nursery whose caller expects one error: an exception group leaving the block is
    raised as its first leaf (an ``Exception``, or a ``KeyboardInterrupt`` / ``SystemExit``, which
    a script catches as such; a group of cancellations or the like stays a group)."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaf = first_leaf(group)
        if isinstance(leaf, (Exception, KeyboardInterrupt, SystemExit)):
            raise leaf from None
        raise
