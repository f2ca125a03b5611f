"""Arrays made of pieces of other arrays, built on the workers by small programs the server makes.

The client moves shards around (AssembleArrayFromSingleDeviceArrays, DisassembleIntoSingleDevice-
Arrays, RemapArrays). The server holds every
array as one worker buffer with its global value, so such an array is computed from pieces of
others: `piece_function` writes a jitted JAX function that slices each piece out of its source
and places it into the result, exported (`jax.export`) for the slice's platform, and the workers
run it like any other function (cached by content, so each distinct layout compiles once).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .shardings import Index


@dataclass(frozen=True)
class Piece:
    source: int  # index of the input the piece comes from
    src: Index  # where it is in that input
    dst: Index  # where it goes in the result


def _key(idx: Index) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in idx)


def _export(f: Any, inputs: Sequence[tuple[str, tuple[int, ...]]], platform: str) -> tuple[str, bytes]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16 if d == "bfloat16" else np.dtype(d)) for d, s in inputs]
    with jax.enable_x64(True):
        exp = jax.export.export(jax.jit(f), platforms=(platform,))(*args)
    data = bytes(exp.serialize())
    return hashlib.sha256(data).hexdigest(), data


def piece_function(inputs: Sequence[tuple[str, tuple[int, ...]]], out: tuple[str, tuple[int, ...]],
                   pieces: Sequence[Piece], platform: str) -> tuple[str, bytes]:
    """(function id, serialized Exported) of `f(*inputs) -> out` built from `pieces`, which must
    cover the result."""
    import jax.numpy as jnp

    shape = out[1]
    whole = tuple((0, d) for d in shape)

    def f(*xs: Any) -> Any:
        covering = [p for p in pieces if _key(p.dst) == whole]
        if covering:
            p = covering[0]
            return xs[p.source][p.src]
        result = jnp.zeros(shape, xs[0].dtype)
        for p in pieces:
            result = result.at[p.dst].set(xs[p.source][p.src])
        return result

    return _export(f, inputs, platform)


def gather_function(dtype: str, shape: tuple[int, ...], devices: int, platform: str) -> tuple[str, bytes]:
    """(function id, serialized Exported) of the identity over all `devices` whose result is
    replicated: a sharded array spanning workers, made readable by one of them."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

    mesh = AbstractMesh((devices,), ("_pw",))
    rep = NamedSharding(mesh, PartitionSpec())
    arg = jax.ShapeDtypeStruct(shape, jnp.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))
    with jax.enable_x64(True), jax.sharding.use_abstract_mesh(mesh):
        exp = jax.export.export(jax.jit(lambda x: x, in_shardings=rep, out_shardings=rep),
                                platforms=(platform,))(arg)
    data = bytes(exp.serialize())
    return hashlib.sha256(data).hexdigest(), data
