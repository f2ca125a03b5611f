"""Compiled functions placed on virtual slices: `pw.pmap` and `pw.jit`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ..compile import ExportedFunction, export_jit, export_pmap, signature_key
from ..errors import InvalidArgument
from .devices import VirtualDevice, VirtualMesh, VirtualSlice
from .futures import Future
from .programs import Registered, Trace, current_trace, execute, register_trace
from .runtime import Runtime

_WIDE = frozenset(np.dtype(t) for t in (np.float64, np.int64, np.uint64, np.complex128))


def _has_64_bit(args: tuple[Any, ...]) -> bool:
    """Whether a leaf is 64-bit the NumPy way (a Python int or float is)."""
    for leaf in jax.tree.leaves(args):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            dtype = np.asarray(leaf).dtype
        if np.dtype(dtype) in _WIDE:
            return True
    return False


class CompiledFunction:
    """A jitted function on a slice. Outside a program a call runs it as a one-node
    program and returns futures at once; inside `@pw.program` it becomes a node."""

    def __init__(
        self, fn: Callable[..., Any], slice_: VirtualSlice, exporter: Callable[[tuple[Any, ...]], ExportedFunction]
    ) -> None:
        self.fn = fn
        self.slice = slice_
        self.name = getattr(fn, "__name__", "fn")
        self._exporter = exporter
        self._exports: dict[Any, ExportedFunction] = {}
        self._standalone: dict[str, Registered] = {}
        self._by_fast_key: dict[tuple[Any, ...], Registered] = {}
        self._lock = threading.Lock()

    def export(self, args: tuple[Any, ...]) -> ExportedFunction:
        """Exported for these arguments' signature, once. 64-bit types are on while it traces
        only when an argument has one (a float64 input computes in float64, as NumPy would);
        otherwise the function traces as in plain JAX, whose constants default to 32 bits."""
        with jax.enable_x64(True):
            key = signature_key(args)
        exp = self._exports.get(key)
        if exp is None:
            with jax.enable_x64(_has_64_bit(args)):
                exp = self._exports[key] = self._exporter(args)
        return exp

    def __call__(self, *args: Any) -> Any:
        trace = current_trace()
        if trace is not None:
            return trace.call(self, args)
        rt = Runtime.get()
        key, flat = fast_key(args)
        reg = self._by_fast_key.get(key) if key is not None else None
        if reg is None:
            exp = self.export(args)
            with self._lock:
                reg = self._standalone.get(exp.function_id)
                if reg is None:
                    reg = self._standalone[exp.function_id] = self._register_single(rt, exp, args)
                if key is not None:
                    self._by_fast_key[key] = reg
        return execute(rt, reg, flat)

    def _register_single(self, rt: Runtime, exp: ExportedFunction, args: tuple[Any, ...]) -> Registered:
        trace = Trace(self.name)
        leaves, treedef = jax.tree_util.tree_flatten(args)
        traced = [trace.new_input(tuple(np.shape(x)), _dtype(x)) for x in leaves]
        result = trace.call(self, jax.tree_util.tree_unflatten(treedef, traced))
        return register_trace(rt, trace, result)

    def __repr__(self) -> str:
        return f"<compiled {self.name} on slice {self.slice.name!r}>"


def fast_key(args: tuple[Any, ...]) -> tuple[tuple[Any, ...] | None, list[Any]]:
    """(a cheap signature, the flat arguments) when every leaf is a future or a NumPy array: the
    tree structure plus each leaf's shape and dtype, without the canonicalized avals of
    `signature_key`. None for other leaves (scalars, JAX arrays), which take the full path. Flat
    arguments skip even the flattening (the op-by-op hot path)."""
    flat = _leaf_keys(args)
    if flat is not None:
        return tuple(flat), list(args)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    keys = _leaf_keys(leaves)
    return (None if keys is None else (treedef, *keys)), leaves


def _leaf_keys(xs: Sequence[Any]) -> list[tuple[Any, Any]] | None:
    """(shape, dtype) of each item when all are futures or NumPy arrays, else None."""
    out = []
    for a in xs:
        if type(a) is not Future and type(a) is not np.ndarray:
            return None
        out.append((a.shape, a.dtype))
    return out


def _dtype(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def _slice_of(devices: Sequence[VirtualDevice]) -> VirtualSlice:
    devices = list(devices)
    if not devices:
        raise InvalidArgument("pmap needs at least one virtual device (slice.devices)")
    s = devices[0].slice
    if any(d.slice is not s for d in devices) or [d.index for d in devices] != list(range(len(s.devices))):
        raise InvalidArgument("pmap's devices must be all the devices of one slice, in order (slice.devices)")
    return s


def pmap(fn: Callable[..., Any], devices: Sequence[VirtualDevice], axis_name: str | None = None,
         donate_argnums: int | Sequence[int] = ()) -> CompiledFunction:
    """pmap semantics over a slice's virtual devices: the leading axis maps one element per device."""
    s = _slice_of(devices)
    n = len(s.devices)
    name = getattr(fn, "__name__", "fn")
    return CompiledFunction(
        fn, s,
        lambda args: export_pmap(fn, num_devices=n, axis_name=axis_name, args=args, platform=s.kind, name=name,
                                 donate_argnums=donate_argnums),
    )


def jit(fn: Callable[..., Any], mesh: VirtualMesh, in_shardings: Any = None, out_shardings: Any = None,
        donate_argnums: int | Sequence[int] = ()) -> CompiledFunction:
    """jax.jit over a slice's virtual mesh, with PartitionSpecs as in/out shardings."""
    if not isinstance(mesh, VirtualMesh):
        raise InvalidArgument("pw.jit needs mesh=slice.mesh(axis_names)")
    s = mesh.slice
    name = getattr(fn, "__name__", "fn")
    return CompiledFunction(
        fn, s,
        lambda args: export_jit(fn, mesh_shape=mesh.shape, axis_names=mesh.axis_names, args=args,
                                in_shardings=in_shardings, out_shardings=out_shardings,
                                donate_argnums=donate_argnums, platform=s.kind, name=name),
    )
