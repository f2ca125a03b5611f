"""Pure tests of how a run's consecutive nodes are planned into one fused segment."""

from __future__ import annotations

from schemas.pathways.v1 import worker_pb2 as wpb
from server.worker.fusion import fusable, plan_segment


def node(i: int, inputs: list[int], outputs: list[int], visible: list[bool] | None = None,
         routes: list[int] | None = None, run: int = 1, devices: tuple[int, ...] = (0,)) -> wpb.NodeExec:
    return wpb.NodeExec(run_id=run, node_index=i, seq=i + 1, function_id=f"f{i % 2}", local_devices=devices,
                        input_ids=inputs, output_ids=outputs, output_visible=visible or [False] * len(outputs),
                        routes=[wpb.OutputRoute(output_index=r, address="peer") for r in routes or []])


def test_chain_keeps_only_the_visible_output() -> None:
    nodes = [node(0, [100], [1]), node(1, [1], [2]), node(2, [2], [3], visible=[True])]
    plan = plan_segment(nodes, {1: 1, 2: 1, 3: 0})
    assert plan.external_ids == [100]
    assert plan.kept_ids == [3]
    assert plan.internal_ids == [1, 2]
    assert plan.reads == [100]
    assert plan.segment.wiring == (((0, 0),), ((1, 0, 0),), ((1, 1, 0),))
    assert plan.segment.keep == ((2, 0),)


def test_outputs_read_outside_or_routed_are_kept_and_their_internal_reads_released() -> None:
    # node 0's output is read by node 1 (inside) and by a later node outside the segment
    nodes = [node(0, [100, 101], [1]), node(1, [1, 100], [2], routes=[0])]
    plan = plan_segment(nodes, {1: 2, 2: 1})
    assert plan.external_ids == [100, 101]
    assert plan.kept_ids == [1, 2]
    assert plan.internal_ids == []
    assert sorted(plan.reads) == [1, 100, 100, 101]


def test_structure_is_independent_of_buffer_ids() -> None:
    a = plan_segment([node(0, [100], [1]), node(1, [1], [2], visible=[True])], {1: 1})
    b = plan_segment([node(0, [900], [7]), node(1, [7], [8], visible=[True])], {7: 1})
    assert a.segment == b.segment  # every run of a program reuses one fused executable


def test_only_one_run_on_the_same_devices_fuses() -> None:
    head = node(0, [100], [1])
    assert fusable(head, node(1, [1], [2]))
    assert not fusable(head, node(1, [1], [2], run=2))
    assert not fusable(head, node(1, [1], [2], devices=(1,)))


def test_nodes_with_a_node_elsewhere_between_them_do_not_fuse() -> None:
    # a -> b -> a: nodes 0 and 2 have consecutive seqs here, but node 2 waits for node 1 (elsewhere)
    n0, n2 = node(0, [100], [1], routes=[0]), node(2, [2], [3], visible=[True])
    assert not fusable(n0, n2)
    assert fusable(n0, node(1, [1], [2]))
