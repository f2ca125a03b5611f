"""Worker side of shipped functions: ``jax.export`` bytes -> a compiled executable on given devices.

Device order: virtual device ``i`` of the slice is ``devices[i]``. The concrete mesh has the shape
and axis names of the abstract mesh the function was exported for (read from its named
shardings), filled row-major from ``devices``; a function without named shardings gets a 1-D
mesh. ``Exported.nr_devices`` reads 1 for ``shard_map`` exports, so it is only checked to be 1 or
``len(devices)``.
"""

from __future__ import annotations

import math
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

__all__ = ["Executable", "ExecutableCache", "Runnable", "call_exported", "unload_unused"]

_DEFAULT_AXIS = "_pw_devices"
# Collectives in compiled (post-partitioning) HLO text.
_HLO_COLLECTIVE_RE = re.compile(
    r"\b(?:all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|collective-broadcast"
    r"|ragged-all-to-all)(?:-start)?\("
)


def _export_mesh(exp: jax.export.Exported) -> Any:
    """The abstract mesh the function was exported for, or None (no named shardings recorded)."""
    named = (*getattr(exp, "_in_named_shardings", ()), *getattr(exp, "_out_named_shardings", ()))
    for s in named:
        if s is not None:
            return s.mesh
    return None


def call_exported(exp: jax.export.Exported, leaves: Sequence[Any]) -> tuple[Any, ...]:
    """Calls an exported function (while tracing) on its flat inputs; returns its flat outputs."""
    args, kwargs = jax.tree.unflatten(exp.in_tree, leaves)
    return tuple(jax.tree.leaves(exp.call(*args, **kwargs)))


class Runnable:
    """The call path shared by single and fused executables: flat inputs are checked and
    placed onto the input shardings (skipped when an input's sharding object was accepted
    before), then the jitted function runs through jit's C++ fast path."""

    in_avals: tuple[jax.ShapeDtypeStruct, ...]
    in_shardings: tuple[Sharding, ...]
    out_shardings: tuple[Sharding, ...]
    has_collectives: bool
    _jitted: Any
    _first: Any = None  # the program compiled at construction, for the first call (Executable)

    def _init_call_path(self) -> None:
        self._shapes = [a.shape for a in self.in_avals]
        self._dtypes = [a.dtype for a in self.in_avals]
        self._ok_shardings: list[Any] = [None] * len(self.in_avals)
        # per input, the aval object of an array accepted before (shape and dtype checked): arrays
        # of one executable's output share theirs, so a training step's state fed back is checked
        # by identity alone (shape and dtype are Python properties: ~0.4 µs an input)
        self._ok_avals: list[Any] = [None] * len(self.in_avals)
        # an input sharding on one device, as that device: an array from another device moves with
        # device_put(x, device), which costs (with the call that reads it) about two thirds of
        # device_put onto the sharding (a pipeline stage's input from the stage before it)
        self._one_device: list[jax.Device | None] = [_only_device(s) for s in self.in_shardings]
        # jit takes a host array for such an input itself, but not in a group of processes (an
        # island spanning hosts), whatever the devices: there it is placed first (`_place`)
        single = jax.process_count() == 1
        self._addressable = [s.is_fully_addressable and single for s in self.in_shardings]
        self.last_used = time.monotonic()
        self.loaded = True  # its compiled program is held (by jit's cache); see unload()
        with _LIVE_LOCK:
            _LIVE.add(self)

    def unload(self) -> None:
        """Drops the compiled program (often MiBs, tens of MiBs for a long fused segment); the
        next call compiles it again, so this only trades memory for a later compilation."""
        self.loaded = False
        self._first = None
        self._jitted.clear_cache()

    @property
    def name(self) -> str:
        raise NotImplementedError

    def _place(self, i: int, x: Any) -> jax.Array:
        aval, sharding = self.in_avals[i], self.in_shardings[i]
        if tuple(x.shape) != aval.shape:
            raise ValueError(f"{self.name}: input {i} has shape {tuple(x.shape)}, expected {aval.shape}")
        if isinstance(x, jax.Array) and not x.is_fully_addressable:  # a multi-host slice's array
            if x.dtype != aval.dtype:
                raise ValueError(f"{self.name}: input {i} has dtype {x.dtype}, expected {aval.dtype}")
            if x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim):
                return x
            if x.sharding.device_set == sharding.device_set:
                return jax.device_put(x, sharding)  # every member runs this task: a collective reshard
            # made on other devices (a program over part of a slice spanning hosts): read only
            # where this worker holds it whole (a copy replicated over them, cluster_backend.py)
            x = _held_whole(x)
            if x is None:
                raise ValueError(f"{self.name}: input {i} is an array spread over other devices, of which this "
                                 "worker holds only part")
        if not sharding.is_fully_addressable:
            # a multi-host slice (server/worker/group.py): this worker holds the whole value and
            # builds only its own devices' shards; device_put would need the peers' devices
            if x.dtype != aval.dtype and jax.dtypes.canonicalize_dtype(x.dtype) != aval.dtype:
                raise ValueError(f"{self.name}: input {i} has dtype {x.dtype}, expected {aval.dtype}")
            whole = np.asarray(x).astype(aval.dtype, copy=False)
            return jax.make_array_from_callback(aval.shape, sharding, lambda index: whole[index])
        if isinstance(x, jax.Array):
            if x.dtype != aval.dtype:
                raise ValueError(f"{self.name}: input {i} has dtype {x.dtype}, expected {aval.dtype}")
            xs = x.sharding
            if xs is sharding or xs == sharding or xs.is_equivalent_to(sharding, x.ndim):
                return x
            device = self._one_device[i]
            return jax.device_put(x, device if device is not None else sharding)
        a = np.asarray(x)
        if a.dtype != aval.dtype:
            if jax.dtypes.canonicalize_dtype(a.dtype) != aval.dtype:
                raise ValueError(f"{self.name}: input {i} has dtype {a.dtype}, expected {aval.dtype}")
            a = a.astype(aval.dtype)
        return jax.device_put(a, sharding)

    def __call__(self, inputs: Sequence[jax.Array | np.ndarray]) -> list[jax.Array]:
        """Run on flat inputs (placed onto their shardings as needed); returns flat outputs."""
        if len(inputs) != len(self.in_avals):
            raise ValueError(f"{self.name}: expected {len(self.in_avals)} inputs, got {len(inputs)}")
        self.last_used = time.monotonic()
        self.loaded = True
        placed = list(inputs)
        ok = self._ok_shardings
        ok_avals = self._ok_avals
        for i, x in enumerate(placed):
            s = getattr(x, "sharding", None)
            a = getattr(x, "aval", None)
            if s is not None and s is ok[i] and a is not None and a is ok_avals[i]:
                continue  # fastest path: its sharding and aval objects were both accepted before
            # fast path: an array whose sharding object was accepted before, with the right aval
            if s is None or s is not ok[i] or x.shape != self._shapes[i] or x.dtype != self._dtypes[i]:
                if (type(x) is np.ndarray and x.shape == self._shapes[i] and x.dtype == self._dtypes[i]
                        and self._addressable[i]):
                    continue  # jit places a host array onto its input sharding in C++ (a third of device_put's cost)
                placed[i] = self._place(i, x)
                ok[i] = getattr(placed[i], "sharding", None)
                ok_avals[i] = getattr(placed[i], "aval", None)
            else:
                ok_avals[i] = a
        first = self._first
        if first is not None:
            self._first = None
            try:
                return list(first(*placed))
            except ValueError:  # an input `Compiled` refuses (its checks are stricter than jit's)
                pass
        return list(self._jitted(*placed))


def _held_whole(x: jax.Array) -> np.ndarray | None:
    """The value of an array spread over several workers' devices where one of this worker's
    shards is all of it (a replicated copy), else None."""
    for shard in x.addressable_shards:
        if all(s.start in (None, 0) and s.stop in (None, n) for s, n in zip(shard.index, x.shape, strict=True)):
            return np.asarray(shard.data)
    return None


def _only_device(sharding: Sharding) -> jax.Device | None:
    """The device of a sharding that places the whole array on one device (unpinned memory),
    else None."""
    devices = sharding.device_set
    if len(devices) != 1 or getattr(sharding, "memory_kind", None) not in (None, "device"):
        return None
    return next(iter(devices))


# Every single and fused executable alive in this process, for unload_unused().
_LIVE: weakref.WeakSet[Runnable] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def unload_unused(idle_s: float, now: float | None = None) -> int:
    """Unloads the compiled program of every executable (single or fused, cached anywhere) not
    called for `idle_s` seconds; returns how many it unloaded.

    Caches keep executables by key for as long as they might be called again, but a compiled
    program nobody ran for minutes only holds memory; it compiles again if it is called.
    """
    now = time.monotonic() if now is None else now
    with _LIVE_LOCK:
        stale = [r for r in _LIVE if r.loaded and now - r.last_used >= idle_s]
    for r in stale:
        r.unload()
    return len(stale)


class Executable(Runnable):
    """A deserialized exported function compiled for ``devices`` (virtual device i -> devices[i])."""

    def __init__(
        self, exported: bytes, devices: Sequence[jax.Device], donate: tuple[int, ...] = ()
    ) -> None:
        devs = list(devices)
        if not devs:
            raise ValueError("an executable needs at least one device")
        if len({d.id for d in devs}) != len(devs):
            raise ValueError(f"duplicate devices in {[d.id for d in devs]}")
        exp = jax.export.deserialize(bytearray(exported))
        self.exported = exp
        self.devices: tuple[jax.Device, ...] = tuple(devs)
        self.donate = tuple(sorted(set(donate)))
        if exp.nr_devices not in (1, len(devs)):
            raise ValueError(
                f"function {exp.fun_name!r} was exported for {exp.nr_devices} devices, got {len(devs)}"
            )
        amesh = _export_mesh(exp)
        if amesh is not None:
            if math.prod(amesh.axis_sizes) != len(devs):
                raise ValueError(
                    f"function {exp.fun_name!r} was exported for mesh {dict(amesh.shape)}"
                    f" ({math.prod(amesh.axis_sizes)} devices), got {len(devs)} devices"
                )
            grid = np.array(devs, dtype=object).reshape(amesh.axis_sizes)
            self.mesh = Mesh(grid, amesh.axis_names, axis_types=amesh.axis_types)
        else:
            self.mesh = Mesh(np.array(devs, dtype=object), (_DEFAULT_AXIS,))
        replicated = NamedSharding(self.mesh, PartitionSpec())
        # Unspecified input shardings (None) become replicated so inputs land on this slice.
        self.in_shardings: tuple[Sharding, ...] = tuple(
            replicated if s is None else s for s in exp.in_shardings_jax(self.mesh)
        )
        outs = tuple(exp.out_shardings_jax(self.mesh))
        if len(self.in_shardings) != len(exp.in_avals) or len(outs) != len(exp.out_avals):
            raise ValueError(f"function {exp.fun_name!r}: shardings do not match its avals")
        for s in (*self.in_shardings, *(o for o in outs if o is not None)):
            if not set(s.device_set) <= set(devs):
                raise ValueError(f"function {exp.fun_name!r}: a sharding uses devices outside the slice")
        if any(not 0 <= i < len(exp.in_avals) for i in self.donate):
            raise ValueError(f"donate indices {self.donate} out of range for {len(exp.in_avals)} inputs")
        self.in_avals: tuple[jax.ShapeDtypeStruct, ...] = tuple(
            jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in exp.in_avals
        )
        self.out_avals: tuple[jax.ShapeDtypeStruct, ...] = tuple(
            jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in exp.out_avals
        )

        def flat(*leaves: Any) -> tuple[Any, ...]:
            return call_exported(exp, leaves)

        # Called through jit's C++ fast path (~8 us a call) rather than the AOT `Compiled`
        # object (~15 us); the first call compiles.
        self._jitted = jax.jit(
            flat, in_shardings=self.in_shardings, out_shardings=outs, donate_argnums=self.donate
        )
        self._init_call_path()
        if len(devs) == 1:
            # one device: nothing to communicate with, and no second compilation needed
            self.has_collectives = False
            self.out_shardings = tuple(
                NamedSharding(self.mesh, PartitionSpec()) if o is None else o for o in outs
            )
        else:
            # collectives appear only after SPMD partitioning: read them from the compiled HLO
            specs = [
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                for a, s in zip(self.in_avals, self.in_shardings, strict=True)
            ]
            compiled = self._jitted.lower(*specs).compile()
            # jit keeps one compiled program per pattern of host (numpy) and jax.Array inputs;
            # this one serves its calls with jax.Arrays only, and a first call's inputs are often
            # uploads (host arrays, passed as they are): the first call runs it (`Compiled` takes
            # either kind) rather than compiling once more for its pattern (bench/FINDINGS.md,
            # 2026-11-27 05:49: a training step compiled three times, now twice)
            self._first = compiled
            self.out_shardings = tuple(jax.tree.leaves(compiled.output_shardings))
            self.has_collectives = bool(_HLO_COLLECTIVE_RE.search(compiled.as_text() or ""))

    @property
    def name(self) -> str:
        """The exported function's name."""
        return str(self.exported.fun_name)

class ExecutableCache:
    """Compiled executables keyed by (function_id, device ids, donate); compile once, LRU-bounded."""

    def __init__(self, max_entries: int = 512) -> None:
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[Any, ...], Executable] = OrderedDict()
        self._pending: dict[tuple[Any, ...], threading.Lock] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _lookup(self, key: tuple[Any, ...]) -> Executable | None:
        ex = self._entries.get(key)
        if ex is not None:
            self._entries.move_to_end(key)
        return ex

    def get(
        self, function_id: str, devices: Sequence[jax.Device], donate: tuple[int, ...] = ()
    ) -> Executable | None:
        """The cached executable, or None."""
        with self._lock:
            return self._lookup(self._key(function_id, devices, donate))

    @staticmethod
    def _key(function_id: str, devices: Sequence[jax.Device], donate: tuple[int, ...]) -> tuple[Any, ...]:
        return (function_id, tuple(d.id for d in devices), tuple(sorted(set(donate))))

    def get_or_compile(
        self,
        function_id: str,
        exported: bytes,
        devices: Sequence[jax.Device],
        donate: tuple[int, ...] = (),
    ) -> Executable:
        """Return the executable for this key, compiling it (once, even under concurrency) on a miss."""
        key = self._key(function_id, devices, donate)
        with self._lock:
            ex = self._lookup(key)
            if ex is not None:
                return ex
            key_lock = self._pending.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                ex = self._lookup(key)
            if ex is not None:
                return ex
            try:
                ex = Executable(exported, devices, donate)
                with self._lock:
                    self._entries[key] = ex
                    while len(self._entries) > self.max_entries:
                        self._entries.popitem(last=False)
            finally:
                with self._lock:
                    self._pending.pop(key, None)
        return ex

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()
