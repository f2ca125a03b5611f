"""Pure tests of how a placed program is cut into segments (the units of gang order) and of the
structure a worker derives from a segment's definition to fuse it; one in-process JAX test of a
fused chain."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from schemas.pathways.v1 import controller_pb2 as cpb
from server.controller.cluster import HostInfo
from server.controller.programs import analyze
from server.controller.segments import PROGRAM_INPUT, cut
from server.worker.executable import Executable
from server.worker.fusion import FusedExecutable, Segment


def host(name: str, address: str, machine: str = "m") -> HostInfo:
    return HostInfo(id=0, name=name, island=name, address=address, pid=1, kind="cpu", machine_id=machine,
                    device_ids=[10, 11, 12, 13], state="ready")


A, B = host("a", "a:1"), host("b", "b:1")


def out(node: int, output: int = 0) -> cpb.ValueRef:
    return cpb.ValueRef(node_output=cpb.NodeOutput(node=node, output=output))


def inp(i: int) -> cpb.ValueRef:
    return cpb.ValueRef(program_input=i)


def graph(nodes: list[tuple[list[cpb.ValueRef], int]], outputs: list[cpb.ValueRef],
          num_inputs: int = 1) -> cpb.ProgramGraph:
    return cpb.ProgramGraph(
        name="p", num_inputs=num_inputs, outputs=outputs,
        nodes=[cpb.ProgramNode(function_id=f"f{i % 2}", slice="s", inputs=ins, num_outputs=n, name=f"n{i}")
               for i, (ins, n) in enumerate(nodes)])


def plan(g: cpb.ProgramGraph, hosts: list[HostInfo], devices: list[list[int]] | None = None) -> list:
    prog = analyze("p-1", g)
    devices = devices or [[0]] * len(hosts)
    return cut(prog, hosts, devices, [h.island for h in hosts])


def test_a_chain_on_one_device_is_one_segment_returning_only_the_program_output() -> None:
    g = graph([([inp(0)], 1), ([out(0)], 1), ([out(1)], 1)], [out(2)])
    (seg,) = plan(g, [A, A, A])
    assert (seg.first, seg.last, seg.size) == (0, 2, 3)
    assert seg.inputs == [(PROGRAM_INPUT, 0)]
    assert seg.outputs == [(2, 0)] and seg.client_outputs == [0] and seg.visible == [True]
    assert seg.spec.index == 0 and seg.spec.deps == () and seg.spec.devices == (10,)
    assert seg.definition.label == "p/0-2 (n0, n1, n2)"
    s = Segment.of(seg.definition)
    assert s.wiring == (((0, 0),), ((1, 0, 0),), ((1, 1, 0),))
    assert s.keep == ((2, 0),) and s.num_inputs == 1 and not s.is_identity()


def test_structure_is_independent_of_the_program() -> None:
    g1 = graph([([inp(0)], 1), ([out(0)], 1)], [out(1)])
    g2 = graph([([inp(0)], 1), ([out(0)], 1)], [out(1)])
    g2.name = "other"
    a, b = plan(g1, [A, A])[0], plan(g2, [A, A])[0]
    assert Segment.of(a.definition) == Segment.of(b.definition)  # one fused executable for both


def test_outputs_read_elsewhere_are_returned_and_routed() -> None:
    # n0 (a) -> n1 (a) -> n2 (b) reads n0 and n1; n3 (a) reads n2 and n0
    g = graph([([inp(0)], 1), ([out(0), inp(0)], 1), ([out(1), out(0)], 1), ([out(2), out(0)], 1)], [out(3)])
    s0, s1, s2 = plan(g, [A, A, B, A])
    assert (s0.first, s0.last, s1.first, s2.first) == (0, 1, 2, 3)
    assert s0.outputs == [(0, 0), (1, 0)]
    assert s0.client_outputs == [-1, -1] and s0.read_later_here == [True, False]
    assert [(r.output_index, r.address) for r in s0.definition.routes] == [(0, "b:1"), (1, "b:1")]
    assert all(r.same_host for r in s0.definition.routes)  # same machine id
    assert s1.inputs == [(0, 1), (0, 0)] and s1.spec.deps == (0,)
    assert s2.inputs == [(1, 0), (0, 0)] and s2.spec.deps == (0, 1)
    # node 1 reads node 0 (inside) and the program input (external 0)
    wiring = Segment.of(s0.definition).wiring
    assert wiring == (((0, 0),), ((1, 0, 0), (0, 0)))


def test_nodes_with_a_node_elsewhere_between_them_are_not_one_segment() -> None:
    # a -> b -> a: one segment {0, 2} would wait for node 1, which waits for node 0 inside it
    g = graph([([inp(0)], 1), ([out(0)], 1), ([out(1)], 1)], [out(2)])
    assert [(s.first, s.last) for s in plan(g, [A, B, A])] == [(0, 0), (1, 1), (2, 2)]


def test_other_devices_of_the_same_worker_join_the_segment_as_another_part() -> None:
    g = graph([([inp(0)], 1), ([out(0)], 1)], [out(1)])
    (seg,) = plan(g, [A, A], [[0], [0, 1]])
    assert seg.spec.devices == (10, 11) and seg.spec.deps == ()
    s = Segment.of(seg.definition)
    assert s.devices == (0, 1) and s.node_devices == ((0,), (0, 1))
    p0, p1 = s.parts()
    assert (p0.first, p0.sources, p0.produces) == (0, ((0, 0),), ((0, 0),))
    assert p0.segment.devices == (0,) and p0.segment.keep == ((0, 0),)
    assert (p1.first, p1.sources, p1.produces) == (1, ((1, 0, 0),), ((1, 0),))
    assert p1.segment.devices == (0, 1) and p1.segment.wiring == (((0, 0),),) and p1.segment.is_identity()
    # sequential dispatch (each computation waits for the one before) keeps them apart
    s0, s1 = cut(analyze("p-1", g), [A, A], [[0], [0, 1]], ["a", "a"], across_devices=False)
    assert s0.spec.devices == (10,) and s1.spec.devices == (10, 11) and s1.spec.deps == (0,)


def test_the_worker_takes_the_segments_devices_as_the_controller_cut_them() -> None:
    g = graph([([inp(0)], 1), ([out(0)], 1)], [out(1)])
    (seg,) = plan(g, [A, A], [[1], [0, 1]])
    assert list(seg.definition.local_devices) == [1, 0]
    assert Segment.of(seg.definition).devices == (1, 0)  # the controller's order, as given
    d = seg.definition
    d.nodes[1].local_devices.append(3)
    with pytest.raises(ValueError, match="node 1 runs on \\[0, 1, 3\\], outside the segment's devices"):
        Segment.of(d)
    del d.local_devices[:]
    with pytest.raises(ValueError, match="devices \\[\\] are empty"):
        Segment.of(d)


def test_parts_read_the_segment_inputs_and_earlier_parts_and_return_what_is_kept() -> None:
    # stage 0 on device 0 (two nodes), stage 1 on device 1 reads both of them and input 1
    g = graph([([inp(0)], 1), ([out(0)], 2), ([out(1, 1), inp(1), out(0)], 1)], [out(2), out(1, 0)],
              num_inputs=2)
    (seg,) = plan(g, [A, A, A], [[0], [0], [1]])
    s = Segment.of(seg.definition)
    p0, p1 = s.parts()
    assert p0.segment.function_ids == ("f0", "f1") and p0.segment.wiring == (((0, 0),), ((1, 0, 0),))
    assert p0.produces == ((0, 0), (1, 0), (1, 1)) and p0.segment.keep == ((0, 0), (1, 0), (1, 1))
    assert p1.sources == ((1, 1, 1), (0, 1), (1, 0, 0)) and p1.segment.wiring == (((0, 0), (0, 1), (0, 2)),)
    assert s.keep == ((1, 0), (2, 0)) and p1.produces == ((2, 0),)
    # a segment on one device set is its own single part
    (one,) = Segment.of(plan(g, [A, A, A])[0].definition).parts()
    assert one.segment == Segment.of(plan(g, [A, A, A])[0].definition) and one.first == 0


def test_a_single_node_reading_its_inputs_in_order_runs_as_its_executable() -> None:
    g = graph([([inp(0), inp(1)], 2)], [out(0, 0), out(0, 1)], num_inputs=2)
    (seg,) = plan(g, [A])
    s = Segment.of(seg.definition)
    assert s.is_identity() and seg.client_outputs == [0, 1]
    # the same input twice is one external input read twice: not the executable's own signature
    g2 = graph([([inp(0), inp(0)], 1)], [out(0)])
    assert not Segment.of(plan(g2, [A])[0].definition).is_identity()


def test_unused_outputs_are_not_returned() -> None:
    g = graph([([inp(0)], 2), ([out(0, 0)], 1)], [out(1)])
    (seg,) = plan(g, [A, A])
    assert seg.outputs == [(1, 0)]


def chain_of(n: int, fns: str = "f", keep: tuple[tuple[int, int], ...] | None = None,
             extra: dict[int, tuple[tuple[int, ...], ...]] | None = None) -> Segment:
    """n calls, call k > 0 reading (output 0 of call k-1, external input 1)."""
    wiring = [((0, 0), (0, 1))] + [((1, k - 1, 0), (0, 1)) for k in range(1, n)]
    for k, ws in (extra or {}).items():
        wiring[k] = ws
    ids = tuple(fns[k % len(fns)] for k in range(n))
    return Segment(ids, tuple(wiring), keep if keep is not None else ((n - 1, 0),), (0,), ((0,),) * n)


def test_a_chain_of_calls_of_one_function_loops_from_its_first_call() -> None:
    assert chain_of(6).chains() == {0: (6, ((2, 0), (0, 1)))}
    assert chain_of(3).chains() == {}  # shorter than CHAIN_MIN: inlined
    assert chain_of(6, fns="fg").chains() == {}  # alternating functions


def test_a_chain_stops_where_an_intermediate_output_is_read_elsewhere() -> None:
    # call 3's output is returned too: calls 0-3 could loop only up to it, 4-7 are a chain of their own
    s = chain_of(8, keep=((3, 0), (7, 0)))
    assert s.chains() == {0: (4, ((2, 0), (0, 1))), 4: (8, ((2, 0), (0, 1)))}
    # call 6 reads call 4 besides call 5: the first run ends with call 4, and call 6 (wired
    # differently) starts the next
    s = chain_of(10, extra={6: ((1, 5, 0), (1, 4, 0))})
    assert s.chains() == {0: (5, ((2, 0), (0, 1))), 6: (10, ((2, 0), (0, 1)))}


def test_a_fused_chain_compiles_to_one_loop_and_computes_what_the_calls_do() -> None:
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)
    w = (np.eye(4, dtype=np.float32) * 0.9 + 0.05).astype(np.float32)
    spec = jax.ShapeDtypeStruct((4, 4), np.float32)
    blob = jax.export.export(jax.jit(lambda h, w: jnp.tanh(h @ w)))(spec, spec).serialize()
    dev = jax.devices()[:1]
    n = 12
    seg = chain_of(n, keep=((5, 0), (n - 1, 0)))  # call 5 returned too: two loops
    assert seg.chains() == {0: (6, ((2, 0), (0, 1))), 6: (n, ((2, 0), (0, 1)))}
    fused = FusedExecutable(seg, [Executable(bytes(blob), dev) for _ in range(n)])
    mid, last = fused([x, w])
    want, h = [], x
    for _ in range(n):
        h = np.tanh(h @ w)
        want.append(h)
    np.testing.assert_allclose(np.asarray(mid), want[5], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(last), want[-1], rtol=1e-6, atol=1e-6)
    hlo = fused._jitted.lower(x, w).as_text()
    assert hlo.count("stablehlo.while") == 2
