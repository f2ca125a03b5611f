"""Tuning settings a server process reads from its environment (PATHWAYS_*) when a module loads.

A malformed one raises `SettingError`, which the process's entry point (`python -m server.worker`)
says in one line, exit status 2, instead of a traceback from an import."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from pwctl.limits import number_in

N = TypeVar("N", int, float)


class SettingError(ValueError):
    """A PATHWAYS_* setting that is not what it must be; its message names it and what is wanted."""


def env_number(name: str, default: str, parse: Callable[[str], N], low: float, high: float, want: str) -> N:
    """Environment variable `name` (`default` when unset) as a number in low..high (NaN is in no
    range); SettingError "NAME='VALUE': want WANT" otherwise."""
    raw = os.environ.get(name, default)
    value = number_in(raw, parse, low, high)
    if value is None:
        raise SettingError(f"{name}={raw!r}: want {want}")
    return value
