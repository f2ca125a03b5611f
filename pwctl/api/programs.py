"""Programs: the tracer that turns a block of compiled-function calls into one dataflow
graph, registration (once per input signature), and running a registered program.

Calling a `@pw.program` function traces it with abstract values; every compiled-function
call becomes a node whose outputs are abstract futures. The graph is registered with the
server once; every later call with the same signature only sends inputs, as one message
on the session stream, and gets output futures back at once.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from schemas.pathways.v1 import controller_pb2 as cpb

from ..compile import ExportedFunction, signature_key
from ..errors import InvalidArgument, ProgramError
from .futures import Future, settle
from .runtime import Runtime

if TYPE_CHECKING:
    from .functions import CompiledFunction


@dataclass(frozen=True)
class TracedValue:
    """An abstract future inside a trace: shape, dtype and where the value comes from."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    ref: cpb.ValueRef = field(compare=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"TracedValue({self.dtype}{list(self.shape)})"

    def __array__(self, *a: Any, **k: Any) -> np.ndarray:
        raise ProgramError(
            "a program's values are futures while it is traced: only compiled functions (pw.pmap, pw.jit) "
            "can use them inside @pw.program; read values after the program returns"
        )


_current: contextvars.ContextVar[Trace | None] = contextvars.ContextVar("pw_trace", default=None)


def current_trace() -> Trace | None:
    return _current.get()


def _input_ref(i: int) -> cpb.ValueRef:
    return cpb.ValueRef(program_input=i)


def _node_ref(node: int, output: int) -> cpb.ValueRef:
    return cpb.ValueRef(node_output=cpb.NodeOutput(node=node, output=output))


class Trace:
    """Records the nodes of one program while its Python function runs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[cpb.ProgramNode] = []
        self.node_slices: list[str] = []
        self.functions: dict[str, ExportedFunction] = {}
        self.captured: list[Any] = []  # values from outside the program: extra inputs
        self.num_inputs = 0

    def new_input(self, shape: tuple[int, ...], dtype: Any) -> TracedValue:
        tv = TracedValue(tuple(shape), np.dtype(dtype), _input_ref(self.num_inputs))
        self.num_inputs += 1
        return tv

    def call(self, cf: CompiledFunction, args: tuple[Any, ...]) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        refs: list[cpb.ValueRef] = []
        for leaf in leaves:
            if isinstance(leaf, TracedValue):
                refs.append(leaf.ref)
            else:  # a future or a constant from outside the program: becomes an input
                value = leaf if isinstance(leaf, Future) else np.asarray(leaf)
                tv = self.new_input(value.shape, value.dtype)
                self.captured.append((tv.ref.program_input, value))
                refs.append(tv.ref)
        exp = cf.export(args)
        self.functions[exp.function_id] = exp
        index = len(self.nodes)
        self.nodes.append(
            cpb.ProgramNode(function_id=exp.function_id, slice=cf.slice.name, inputs=refs,
                            num_outputs=len(exp.out_avals), name=exp.name)
        )
        self.node_slices.append(cf.slice.name)
        outs = [
            TracedValue(tuple(a.shape), np.dtype(a.dtype), _node_ref(index, j)) for j, a in enumerate(exp.out_avals)
        ]
        del treedef
        return jax.tree_util.tree_unflatten(exp.out_tree, outs)


@dataclass(frozen=True)
class _Slot:
    """A leaf of a program's result: output k of the run, or program input k passed through."""

    is_output: bool
    index: int


@dataclass
class Registered:
    """A program the server knows: run it by sending inputs only."""

    program_id: str
    num_inputs: int
    captured: list[tuple[int, Any]]
    input_slice: list[str | None]  # the slice of the first node reading each input (None: unused)
    outputs: list[tuple[int, int]]  # unique (node, output) pairs the client receives
    output_slice: list[str]
    output_avals: list[tuple[tuple[int, ...], np.dtype[Any]]]
    result_tree: Any  # the program's return structure with _Slot leaves
    slices: list[str] = field(default_factory=list)  # every slice it runs on, in name order


def register_trace(rt: Runtime, trace: Trace, result: Any) -> Registered:
    leaves, tree = jax.tree_util.tree_flatten(result)
    outputs: list[tuple[int, int]] = []
    slots: list[_Slot] = []
    for leaf in leaves:
        if not isinstance(leaf, TracedValue):
            raise ProgramError(
                f"program {trace.name!r} must return values computed by compiled functions or its inputs, "
                f"not {type(leaf).__name__}"
            )
        if leaf.ref.WhichOneof("source") == "program_input":
            slots.append(_Slot(False, leaf.ref.program_input))
            continue
        key = (leaf.ref.node_output.node, leaf.ref.node_output.output)
        if key not in outputs:
            outputs.append(key)
        slots.append(_Slot(True, outputs.index(key)))
    graph = cpb.ProgramGraph(
        name=trace.name,
        num_inputs=trace.num_inputs,
        nodes=trace.nodes,
        outputs=[_node_ref(n, o) for n, o in outputs],
    )
    input_slice: list[str | None] = [None] * trace.num_inputs
    for node, slice_name in zip(trace.nodes, trace.node_slices, strict=True):
        for ref in node.inputs:
            if ref.WhichOneof("source") == "program_input" and input_slice[ref.program_input] is None:
                input_slice[ref.program_input] = slice_name
    program_id = rt.register(graph, list(trace.functions.values()))
    avals = []
    for n, o in outputs:
        exp = trace.functions[trace.nodes[n].function_id]
        a = exp.out_avals[o]
        avals.append((tuple(a.shape), np.dtype(a.dtype)))
    return Registered(
        program_id=program_id,
        num_inputs=trace.num_inputs,
        captured=list(trace.captured),
        input_slice=input_slice,
        outputs=outputs,
        output_slice=[trace.node_slices[n] for n, _ in outputs],
        output_avals=avals,
        result_tree=jax.tree_util.tree_unflatten(tree, slots),
        slices=sorted(set(trace.node_slices)),
    )


def execute(rt: Runtime, reg: Registered, flat_args: list[Any]) -> Any:
    """Runs a registered program: upload array inputs, send one run message, return futures.
    Waits first while the process has `rt.max_in_flight` runs in flight (uploads included)."""
    if rt.registrations.refused:  # refused when the session resumed: registered again first
        rt.registrations.ensure(reg.program_id)
    rt.wait_for_room()
    if rt.on_lost_worker:  # a slice's host was lost: has it moved since? (not on the usual path)
        rt.catch_up(set(reg.slices))
    values: list[Any] = list(flat_args) + [None] * (reg.num_inputs - len(flat_args))
    for i, v in reg.captured:
        values[i] = v
    if rt.resume.uncertain:  # an input computed by a run in flight at a controller restart: does it exist?
        for v in values:
            if isinstance(v, Future):
                settle(rt, v, None)
    futures = _Sent(reg, values).send(rt)

    def pick(slot: _Slot) -> Any:
        return futures[slot.index] if slot.is_output else values[slot.index]

    return jax.tree_util.tree_map(pick, reg.result_tree)


class _Sent:
    """A run of a registered program, as sent: what sends it (again: replan.py `Sent`)."""

    __slots__ = ("futures", "out_ids", "reg", "replans", "run_id", "slices", "values")

    def __init__(self, reg: Registered, values: list[Any]) -> None:
        self.reg = reg
        self.slices = reg.slices
        self.values = values
        self.out_ids: list[int] = []
        self.futures: list[Future] = []
        self.replans = 0  # times sent again (replan.py)
        self.run_id = 0

    def send(self, rt: Runtime, again: bool = False) -> list[Future]:
        """Uploads the array inputs to the worker of the slice that reads each and sends the run;
        its outputs' futures (`again`: those made when it was first sent, moved). Planned on the
        slices as the runtime knows them: their generations are read before their addresses (a
        move meanwhile is then refused, not missed)."""
        reg, slices = self.reg, rt.slices
        gens = [slices[s].info.generation for s in reg.slices] if rt.checks_generations else None
        run_id = self.run_id = rt.new_id()  # named with its uploads: should one be lost, the run fails at once
        input_ids: list[Any] = [0] * len(self.values)  # (worker_client.py)
        homes: list[str] = [""] * len(self.values)
        uploads: list[tuple[int, str]] = []
        for i, v in enumerate(self.values):
            slice_name = reg.input_slice[i]
            if slice_name is None or isinstance(v, Future):  # not read by any node; a future (below)
                continue
            address = slices[slice_name].address
            bid = rt.new_id()
            rt.worker(address).put(bid, np.asarray(v), run_id)
            input_ids[i], homes[i] = bid, address
            uploads.append((bid, address))
        with rt.plan_lock:  # futures' homes read, and the run sent, in order with a re-sending (replan.py)
            for i, v in enumerate(self.values):
                if isinstance(v, Future):
                    input_ids[i], homes[i] = v.id, v.wire_home
            # once per slice, not per output
            addresses = {s: (slices[s].address, slices[s].peers) for s in set(reg.output_slice)}
            if again:  # the same outputs, made where the slices are now (the run id last: futures.py `_where`)
                for f, s in zip(self.futures, reg.output_slice, strict=True):
                    f.home, f.peers, f.run_id = addresses[s][0], addresses[s][1], run_id
            else:
                self.out_ids = [rt.new_id() for _ in reg.outputs]
                self.futures = [
                    Future(rt, oid, addresses[s][0], shape, dtype, run_id, addresses[s][1])
                    for oid, s, (shape, dtype) in zip(self.out_ids, reg.output_slice, reg.output_avals, strict=True)
                ]
            if gens is not None:  # kept before it is sent: its refusal, read on the session's thread, finds it
                rt.replans.keep(run_id, self)
            rt.send_run(cpb.ClientMessage(run=cpb.RunProgram(
                run_id=run_id, program_id=reg.program_id, input_ids=input_ids, output_ids=self.out_ids,
                input_homes=homes, slice_generations=gens)))
        for bid, address in uploads:  # the run holds them now; ours go (ordered after the run)
            rt.release(bid, address)
        return self.futures

    def send_again(self, rt: Runtime) -> int:
        """replan.py: sent again, planned on the slices as they are now. Counted once it went out
        (a send that raised, the runtime closing, is not: the run's error says how many did)."""
        self.send(rt, again=True)
        self.replans += 1
        return self.run_id

    def producers(self) -> list[tuple[int, int]]:
        """replan.py: (input index, its run's id) for each input that is a future."""
        return [(k, v.run_id) for k, v in enumerate(self.values) if isinstance(v, Future)]


class Program:
    """`@pw.program`: traced once per input signature, then run as one registered graph."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.name = getattr(fn, "__name__", "program")
        self._cache: dict[Any, Registered] = {}
        self._quick: dict[Any, Registered] = {}
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any) -> Any:
        if current_trace() is not None:
            return self.fn(*args)  # a program called inside another: inline it
        rt = Runtime.get()
        from .functions import fast_key  # (functions imports this module)

        quick, flat = fast_key(args)
        reg = self._quick.get(quick) if quick is not None else None
        if reg is not None:
            return execute(rt, reg, flat)
        with jax.enable_x64(True):
            key = signature_key(args)
        with self._lock:
            reg = self._cache.get(key)
            if reg is None:
                reg = self._cache[key] = self._trace(rt, args)
            if quick is not None:
                self._quick[quick] = reg
        return execute(rt, reg, flat)

    def _trace(self, rt: Runtime, args: tuple[Any, ...]) -> Registered:
        trace = Trace(self.name)
        leaves, treedef = jax.tree_util.tree_flatten(args)
        traced = []
        for leaf in leaves:
            if not hasattr(leaf, "shape"):
                leaf = np.asarray(leaf)
            traced.append(trace.new_input(tuple(leaf.shape), leaf.dtype))
        token = _current.set(trace)
        try:
            result = self.fn(*jax.tree_util.tree_unflatten(treedef, traced))
        finally:
            _current.reset(token)
        if not trace.nodes:
            raise InvalidArgument(f"program {self.name!r} calls no compiled function (use pw.pmap or pw.jit)")
        return register_trace(rt, trace, result)


def program(fn: Callable[..., Any]) -> Program:
    """Decorator: trace `fn` into one dataflow program (once per input signature)."""
    return Program(fn)
