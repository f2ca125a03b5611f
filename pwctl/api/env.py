"""What a client process takes from its environment: amounts from environment variables, and
JAX kept on the CPU in the client (the workers own the accelerators)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

from ..errors import InvalidArgument
from ..limits import DISPATCH_MODES, MAX_PRIORITY, MAX_WEIGHT, number_in

N = TypeVar("N", int, float)


def env_amount(name: str, value: str, default: N, parse: Callable[[str], N], expected: str,
               low: float = 0, high: float = math.inf) -> N:
    """The value of environment variable `name` (`value`) as a number in low..high (`parse`: int
    or float; NaN is in no range); `default` when it is blank; InvalidArgument saying what was
    `expected` otherwise."""
    if not value.strip():
        return default
    n = number_in(value, parse, low, high)
    if n is None:
        raise InvalidArgument(f"{name}={value!r}: expected {expected}")
    return n


def env_priority(value: str) -> int:
    """PWCTL_PRIORITY (`value`; a job's driver gets its job's): the session's priority, an integer
    in -MAX_PRIORITY..MAX_PRIORITY (the controller's range, pwctl/limits.py); 0 when blank."""
    return env_amount("PWCTL_PRIORITY", value, 0, int, f"an integer in -{MAX_PRIORITY}..{MAX_PRIORITY}",
                      low=-MAX_PRIORITY, high=MAX_PRIORITY)


def env_weight(value: str) -> float:
    """PWCTL_WEIGHT (`value`; a job's driver gets its job's): the session's proportional-share
    weight, a number in (0, MAX_WEIGHT] (the controller's range, pwctl/limits.py); 1 when blank.
    0 is refused as the message says: it is no weight (a blank variable is the way to not set one)."""
    # the least positive float: a float is >= it exactly when it is > 0
    return env_amount("PWCTL_WEIGHT", value, 1.0, float, f"a number in (0, {MAX_WEIGHT:g}]", low=math.ulp(0.0),
                      high=MAX_WEIGHT)


def env_dispatch(value: str) -> str:
    """PWCTL_DISPATCH (`value`): the session's dispatch mode, one of DISPATCH_MODES; "" when blank
    (the controller's default, `pwctl server start --dispatch`)."""
    mode = value.strip()
    if mode and mode not in DISPATCH_MODES:
        raise InvalidArgument(f"PWCTL_DISPATCH={value!r}: expected {' or '.join(DISPATCH_MODES)}")
    return mode


def keep_local_jax_on_cpu() -> None:
    """A client lowers functions for the workers and runs nothing on accelerators itself, so unless
    JAX_PLATFORMS (or `jax_platforms`) says otherwise its JAX starts only the CPU backend. On a GPU
    host it would otherwise open a CUDA context (~0.5 GiB of the GPU) beside the worker that owns
    the GPU, and at its first array preallocate 75% of the GPU's memory. Backends already started
    by the program (it ran JAX before opening the runtime) are left as they are."""
    import jax
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)  # private: absent, the update is harmless
    if getattr(jax.config, "jax_platforms", None) or (started is not None and started()):
        return
    jax.config.update("jax_platforms", "cpu")
