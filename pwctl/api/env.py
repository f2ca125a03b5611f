"""What a client process takes from its environment: amounts from environment variables, and
JAX kept on the CPU in the client (the workers own the accelerators)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ..errors import InvalidArgument

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
