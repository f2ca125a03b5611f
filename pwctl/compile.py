"""Client side of shipping compiled functions: export jitted JAX functions for a virtual slice.

The client usually owns a single CPU device, so functions are lowered for an *abstract* mesh of the
slice's size with ``jax.export`` and shipped as serialized StableHLO bytes named by their sha256.
Workers turn the bytes back into executables (``server.worker.executable``).

Device order: virtual device ``i`` of a slice is position ``i`` of the abstract mesh in row-major
order (``AbstractMesh((2, 2), ("x", "y"))``: device 1 is ``x=0, y=1``). Workers build their concrete
mesh the same way from the slice's device list.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec, Sharding

__all__ = [
    "CompileError",
    "ExportedFunction",
    "avals_of",
    "export_jit",
    "export_platform",
    "export_pmap",
    "signature_key",
]

_DEFAULT_PMAP_AXIS = "_pw_pmap"

class CompileError(Exception):
    """A function could not be exported for a slice (bad arguments or a failure while tracing)."""


@dataclass(frozen=True)
class ExportedFunction:
    """A function exported for a slice: serialized ``jax.export`` bytes plus what the client needs.

    ``in_tree`` is the treedef of the positional-argument tuple (flatten the call's ``args`` tuple
    with it); ``out_tree`` that of the result. Both are client-side only. Whether the computation
    communicates across devices is not the client's to say: before SPMD partitioning it cannot
    know, and the worker reads it off its compiled executable (server/worker/segments.py).
    """

    function_id: str
    name: str
    exported: bytes
    in_avals: tuple[jax.ShapeDtypeStruct, ...]
    out_avals: tuple[jax.ShapeDtypeStruct, ...]
    in_tree: Any
    out_tree: Any
    num_devices: int
    donate: tuple[int, ...] = ()


def export_platform(platform: str) -> str:
    """Map a worker's platform name ("cpu", "gpu") to the name ``jax.export`` wants ("cpu", "cuda")."""
    p = platform.lower()
    return {"gpu": "cuda"}.get(p, p)


def _leaf_aval(x: Any, where: str) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(tuple(x.shape), jax.dtypes.canonicalize_dtype(x.dtype))
    if isinstance(x, bool | int | float | complex | np.generic):
        return jax.ShapeDtypeStruct((), jax.dtypes.canonicalize_dtype(np.asarray(x).dtype))
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise CompileError(f"{where} is a {type(x).__name__}, not an array (needs .shape and .dtype)")
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), jax.dtypes.canonicalize_dtype(dtype))


def _where(path: Any) -> str:
    """'argument 0' or "argument 0['w']" for a key path into the positional-argument tuple."""
    if not path:
        return "arguments"
    head, rest = path[0], path[1:]
    idx = getattr(head, "idx", head)
    return f"argument {idx}{jax.tree_util.keystr(tuple(rest))}"


def _flat_avals(args: tuple[Any, ...]) -> tuple[tuple[jax.ShapeDtypeStruct, ...], Any, list[str]]:
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tuple(args))
    wheres = [_where(p) for p, _ in leaves_with_path]
    avals = tuple(_leaf_aval(x, w) for (_, x), w in zip(leaves_with_path, wheres, strict=True))
    return avals, treedef, wheres


def avals_of(args: tuple[Any, ...]) -> tuple[tuple[jax.ShapeDtypeStruct, ...], Any]:
    """Flat ``ShapeDtypeStruct``s (canonical dtypes) of a positional-argument tuple, and its treedef."""
    avals, treedef, _ = _flat_avals(args)
    return avals, treedef


def signature_key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A hashable key (treedef, shapes, dtypes) for per-signature caches."""
    avals, treedef = avals_of(args)
    return (treedef, tuple((a.shape, a.dtype.name) for a in avals))


def _abstract_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> AbstractMesh:
    """The slice's mesh with every axis ``Auto``: shardings are hints XLA propagates, as ``jax.jit``
    has always done (newer JAX defaults to ``Explicit`` axes, which type every array by its sharding)."""
    return AbstractMesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def _fn_name(fn: Callable[..., Any], name: str | None) -> str:
    if name:
        return name
    return str(getattr(fn, "__name__", None) or type(fn).__name__)


def _fmt_avals(avals: Sequence[jax.ShapeDtypeStruct]) -> str:
    return "(" + ", ".join(f"{a.dtype.name}{list(a.shape)}" for a in avals) + ")"


def _flat_donate(donate_argnums: int | Sequence[int], args: tuple[Any, ...], name: str) -> tuple[int, ...]:
    nums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    starts, n = [], 0
    for a in args:
        starts.append(n)
        n += len(jax.tree.leaves(a))
    out: list[int] = []
    for i in nums:
        if not -len(args) <= i < len(args):
            raise CompileError(f"function {name!r}: donate_argnums {i} is out of range for {len(args)} args")
        i %= len(args)
        out.extend(range(starts[i], starts[i] + len(jax.tree.leaves(args[i]))))
    return tuple(sorted(set(out)))


def _export(
    jitted: Any,
    *,
    name: str,
    avals: tuple[jax.ShapeDtypeStruct, ...],
    treedef: Any,
    amesh: AbstractMesh,
    platform: str,
    donate: tuple[int, ...],
) -> ExportedFunction:
    arg_avals = jax.tree.unflatten(treedef, avals)
    try:
        with jax.sharding.use_abstract_mesh(amesh):
            exp = jax.export.export(jitted, platforms=[export_platform(platform)])(*arg_avals)
    except CompileError:
        raise
    except Exception as e:
        raise CompileError(
            f"function {name!r} failed to trace for arguments {_fmt_avals(avals)}: {type(e).__name__}: {e}"
        ) from e
    data = bytes(exp.serialize())
    return ExportedFunction(
        function_id=hashlib.sha256(data).hexdigest(),
        name=name,
        exported=data,
        in_avals=avals,
        out_avals=tuple(jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in exp.out_avals),
        in_tree=treedef,
        out_tree=exp.out_tree,
        num_devices=int(amesh.size),
        donate=donate,
    )


def export_pmap(
    fn: Callable[..., Any],
    *,
    num_devices: int,
    axis_name: str | None,
    args: tuple[Any, ...],
    platform: str = "cpu",
    name: str | None = None,
    donate_argnums: int | Sequence[int] = (),
) -> ExportedFunction:
    """Export ``fn`` with ``jax.pmap`` semantics over a slice of ``num_devices`` devices.

    Every input leaf has leading axis ``num_devices``; device ``i`` sees element ``i`` (leading axis
    removed) and the outputs get the leading axis back. Collectives over ``axis_name`` work.
    Implemented as a ``shard_map`` over ``AbstractMesh((num_devices,), (axis_name,))`` inside ``jit``.
    """
    fname = _fn_name(fn, name)
    if num_devices < 1:
        raise CompileError(f"pmap function {fname!r}: num_devices must be >= 1, got {num_devices}")
    avals, treedef, wheres = _flat_avals(tuple(args))
    for a, w in zip(avals, wheres, strict=True):
        if not a.shape:
            raise CompileError(
                f"pmap function {fname!r}: {w} is a scalar (no leading axis), "
                f"the slice has {num_devices} devices"
            )
        if a.shape[0] != num_devices:
            raise CompileError(
                f"pmap function {fname!r}: {w} has leading axis {a.shape[0]}, "
                f"the slice has {num_devices} devices"
            )
    axis = axis_name or _DEFAULT_PMAP_AXIS
    amesh = _abstract_mesh((num_devices,), (axis,))
    spec = PartitionSpec(axis)

    def per_device(*blocks: Any) -> Any:
        out = fn(*jax.tree.map(lambda b: b[0], blocks))
        return jax.tree.map(lambda y: jnp.asarray(y)[None], out)

    body = jax.shard_map(per_device, mesh=amesh, in_specs=spec, out_specs=spec)
    sharding = NamedSharding(amesh, spec)
    jitted = jax.jit(body, in_shardings=sharding, out_shardings=sharding)
    return _export(
        jitted,
        name=fname,
        avals=avals,
        treedef=treedef,
        amesh=amesh,
        platform=platform,
        donate=_flat_donate(donate_argnums, tuple(args), fname),
    )


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec | Sharding)


def _to_shardings(specs: Any, amesh: AbstractMesh) -> Any:
    """PartitionSpec pytree -> NamedSharding pytree on ``amesh`` (None stays None: unspecified)."""
    if specs is None:
        return None

    def conv(s: Any) -> Any:
        if s is None or isinstance(s, Sharding):
            return s
        return NamedSharding(amesh, s)

    return jax.tree.map(conv, specs, is_leaf=_is_spec_leaf)


class _Box:
    __slots__ = ("items",)

    def __init__(self, items: list[Any]) -> None:
        self.items = items


def _check_divisible(
    name: str,
    in_shardings: Any,
    args: tuple[Any, ...],
    avals: tuple[jax.ShapeDtypeStruct, ...],
    wheres: list[str],
    sizes: dict[str, int],
) -> None:
    """Name the argument whose shape does not fit its PartitionSpec (jit's own error does not)."""
    if in_shardings is None:
        return
    specs = (in_shardings,) * len(args) if _is_spec_leaf(in_shardings) else in_shardings
    try:
        boxed = jax.tree.map(
            lambda s, sub: _Box([s] * len(jax.tree.leaves(sub))), specs, args, is_leaf=_is_spec_leaf
        )
    except (ValueError, TypeError):
        return  # structure mismatch: jax.jit reports it while tracing
    flat = [s for b in jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, _Box)) for s in b.items]
    if len(flat) != len(avals):
        return
    for spec, aval, where in zip(flat, avals, wheres, strict=True):
        if not isinstance(spec, PartitionSpec):
            continue
        if len(spec) > len(aval.shape):
            raise CompileError(f"function {name!r}: {where} has rank {len(aval.shape)}, its spec is {spec}")
        for dim, axes in enumerate(spec):
            names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            if any(a not in sizes for a in names):
                raise CompileError(f"function {name!r}: {where}: spec {spec} names an axis not in {sizes}")
            n = math.prod(sizes[a] for a in names)
            if aval.shape[dim] % n:
                raise CompileError(
                    f"function {name!r}: {where} has shape {aval.shape}; spec {spec} splits "
                    f"dimension {dim} over {n} devices"
                )


def export_jit(
    fn: Callable[..., Any],
    *,
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...],
    args: tuple[Any, ...],
    in_shardings: Any = None,
    out_shardings: Any = None,
    donate_argnums: int | Sequence[int] = (),
    platform: str = "cpu",
    name: str | None = None,
) -> ExportedFunction:
    """Export ``jax.jit(fn)`` for a slice laid out as ``AbstractMesh(mesh_shape, axis_names)``.

    ``in_shardings``/``out_shardings`` are PartitionSpecs (or pytrees of them, prefixes as in
    ``jax.jit``) over that mesh; None leaves XLA to choose. XLA inserts the collectives. Donated
    inputs are recorded as flat indices in ``donate`` (the worker jits with ``donate_argnums``).
    """
    fname = _fn_name(fn, name)
    mesh_shape, axis_names = tuple(int(d) for d in mesh_shape), tuple(axis_names)
    if len(mesh_shape) != len(axis_names) or any(d < 1 for d in mesh_shape):
        raise CompileError(f"function {fname!r}: bad mesh shape {mesh_shape} for axis names {axis_names}")
    avals, treedef, wheres = _flat_avals(tuple(args))
    amesh = _abstract_mesh(mesh_shape, axis_names)
    sizes = dict(zip(axis_names, mesh_shape, strict=True))
    _check_divisible(fname, in_shardings, tuple(args), avals, wheres, sizes)
    jit_kwargs: dict[str, Any] = {}
    if in_shardings is not None:
        jit_kwargs["in_shardings"] = _to_shardings(in_shardings, amesh)
    if out_shardings is not None:
        jit_kwargs["out_shardings"] = _to_shardings(out_shardings, amesh)
    try:
        jitted = jax.jit(fn, **jit_kwargs)
    except Exception as e:
        raise CompileError(f"function {fname!r}: bad jit options: {type(e).__name__}: {e}") from e
    return _export(
        jitted,
        name=fname,
        avals=avals,
        treedef=treedef,
        amesh=amesh,
        platform=platform,
        donate=_flat_donate(donate_argnums, tuple(args), fname),
    )
