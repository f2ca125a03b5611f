"""Errors the controller's components raise; the servicer maps them to gRPC status codes."""

from __future__ import annotations

import logging

import grpc

from ..invariants import InvariantError
from ..rpcguard import Mapped

log = logging.getLogger(__name__)


class ControllerError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION


class InvalidArgument(ControllerError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ControllerError):
    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(ControllerError):
    """The caller may not do this (not its session's or job's to do)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class AlreadyExists(ControllerError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Rejected(ControllerError):
    """Cannot be done now: capacity, in use, a precondition."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class GroupForming(Rejected):
    """Slice `slice` spans hosts whose island group is not usable with them yet (forming at
    start, after a host joined or was lost, after a remap): callers that can wait do
    (`SliceService.settled`, bounded by the controller's --group-wait) and ask again."""

    def __init__(self, message: str, slice: str) -> None:
        super().__init__(message)
        self.slice = slice


class InUse(ControllerError):
    code = grpc.StatusCode.FAILED_PRECONDITION


def classify(e: BaseException) -> Mapped | None:
    """How the controller's server answers an exception a handler raised (server/rpcguard.py):
    a ControllerError with its code and message; a broken invariant of a state machine (a bug),
    logged with the stimuli that led to it, as INTERNAL; anything else is not recognised."""
    if isinstance(e, ControllerError):
        return Mapped(e.code, str(e))
    if isinstance(e, InvariantError):
        log.error("InvariantError: %s", e)
        return Mapped(grpc.StatusCode.INTERNAL, f"internal error (a bug): {e.problem}", logging.DEBUG)
    return None
