"""What a client process takes from its environment: amounts from environment variables, and
JAX kept on the CPU in the client (the workers own the accelerators)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ..errors import InvalidArgument
from ..limits import MAX_PRIORITY, MAX_WEIGHT

N = TypeVar("N", int, float)


def env_amount(name: str, value: str, default: N, parse: Callable[[str], N], expected: str) -> N:
    """The value of environment variable `name` (`value`) as an amount >= 0 (`parse`: int or
    float); `default` when it is blank; InvalidArgument saying what was `expected` otherwise."""
    if not value.strip():
        return default
    try:
        n = parse(value)
    except ValueError:
        n = parse("-1")
    if n < 0:
        raise InvalidArgument(f"{name}={value!r}: expected {expected}")
    return n


def env_priority(value: str) -> int:
    """PWCTL_PRIORITY (`value`; a job's driver gets its job's): the session's priority, an integer
    in -MAX_PRIORITY..MAX_PRIORITY (the controller's range, pwctl/limits.py); 0 when blank."""
    try:
        priority = int(value) if value.strip() else 0
    except ValueError:
        priority = MAX_PRIORITY + 1
    if abs(priority) > MAX_PRIORITY:
        raise InvalidArgument(f"PWCTL_PRIORITY={value!r}: expected an integer in -{MAX_PRIORITY}..{MAX_PRIORITY}")
    return priority


def env_weight(value: str) -> float:
    """PWCTL_WEIGHT (`value`; a job's driver gets its job's): the session's proportional-share
    weight, a number in 0..MAX_WEIGHT (the controller's range, pwctl/limits.py; 1 when blank; 0: not
    set, the controller counts it as 1)."""
    try:
        weight = float(value) if value.strip() else 1.0
    except ValueError:
        weight = -1.0
    if not 0 <= weight <= MAX_WEIGHT:  # (NaN: neither)
        raise InvalidArgument(f"PWCTL_WEIGHT={value!r}: expected a number in (0, {MAX_WEIGHT:g}]")
    return weight


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
