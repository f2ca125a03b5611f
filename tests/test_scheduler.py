"""The gang scheduler, event by event, asserting the exact actions. Pure: no network, no clock."""

from __future__ import annotations

import graphlib
import itertools
import random
from collections import Counter, deque
from collections.abc import Iterable, Sequence

import pytest

import server.scheduler as sched_pkg
from server.scheduler import (
    Action,
    CancelRun,
    ClientGone,
    Dispatch,
    DispatchedNode,
    DropRun,
    GangScheduler,
    HangDetected,
    HostLost,
    HostUp,
    NodeFinished,
    NodeSpec,
    NodeStarted,
    Policy,
    RunFinished,
    RunSpec,
    SetPolicy,
    SkippedSeq,
    Submit,
    Tick,
)

# ------------------------------------------------------------------------------------------- helpers


def node(i: int, host: str = "h0", island: str = "a", deps: Sequence[int] = (), label: str = "") -> NodeSpec:
    return NodeSpec(i, host, island, (0,), tuple(deps), label or f"n{i}")


def run(
    rid: int,
    nodes: Iterable[NodeSpec],
    client: str = "c1",
    *,
    priority: int = 0,
    weight: float = 1.0,
    sequential: bool = False,
    job: str | None = None,
) -> RunSpec:
    return RunSpec(rid, f"p-{rid}", client, job, tuple(nodes), priority, weight, sequential)


def chain(rid: int, n: int, host: str = "h0", island: str = "a", client: str = "c1", **kw: object) -> RunSpec:
    nodes = [node(i, host, island, (i - 1,) if i else ()) for i in range(n)]
    return run(rid, nodes, client, **kw)  # type: ignore[arg-type]


def fin(rid: int, i: int, now: float = 1.0, busy: float = 0.0) -> NodeFinished:
    return NodeFinished(rid, i, True, "", busy, now)


def failed(rid: int, i: int, error: str, now: float = 1.0) -> NodeFinished:
    return NodeFinished(rid, i, False, error, 0.0, now)


def d(rid: int, i: int, seq: int) -> DispatchedNode:
    return DispatchedNode(rid, i, seq)


def dispatches(actions: Sequence[Action]) -> dict[str, list[DispatchedNode]]:
    out: dict[str, list[DispatchedNode]] = {}
    for a in actions:
        if isinstance(a, Dispatch):
            assert a.host not in out, "one Dispatch per host per handle()"
            out[a.host] = list(a.nodes)
    return out


def new(**kw: object) -> GangScheduler:
    return GangScheduler(debug=True, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- dispatch


def test_single_run_parallel_dispatch_is_one_batch_in_topo_order() -> None:
    s = new()
    acts = s.handle(Submit(chain(1, 128), now=0.0))
    assert acts == [Dispatch("h0", tuple(d(1, i, i + 1) for i in range(128)))]
    for i in range(127):
        assert s.handle(fin(1, i)) == []
    assert s.handle(fin(1, 127)) == [RunFinished(1, True, "")]
    assert not s.is_live(1)


def test_run_across_two_hosts() -> None:
    s = new()
    spec = run(1, [node(0, "h0"), node(1, "h1", deps=[0]), node(2, "h0", deps=[1]), node(3, "h1", deps=[2])])
    assert s.handle(Submit(spec, now=0.0)) == [
        Dispatch("h0", (d(1, 0, 1), d(1, 2, 2))),
        Dispatch("h1", (d(1, 1, 1), d(1, 3, 2))),
    ]
    # a second run on h1 only continues h1's numbering
    assert s.handle(Submit(chain(2, 2, "h1", client="c2"), now=0.0)) == [
        Dispatch("h1", (d(2, 0, 3), d(2, 1, 4)))
    ]


def test_sequential_dispatches_on_deps() -> None:
    s = new()
    spec = run(1, [node(0, "h0"), node(1, "h1", deps=[0]), node(2, "h0", deps=[1])], sequential=True)
    assert s.handle(Submit(spec, now=0.0)) == [Dispatch("h0", (d(1, 0, 1),))]
    # seqs were assigned at admission: a later parallel run on h0 gets seq 3 and is sent at once
    assert s.handle(Submit(chain(2, 1, "h0", client="c2"), now=0.0)) == [Dispatch("h0", (d(2, 0, 3),))]
    assert s.handle(fin(1, 0)) == [Dispatch("h1", (d(1, 1, 1),))]
    assert s.handle(fin(1, 1)) == [Dispatch("h0", (d(1, 2, 2),))]
    assert s.handle(fin(2, 0)) == [RunFinished(2, True, "")]
    assert s.handle(fin(1, 2)) == [RunFinished(1, True, "")]


def test_sequential_join_waits_for_all_deps() -> None:
    s = new()
    spec = run(1, [node(0, "h0"), node(1, "h1"), node(2, "h0", deps=[0, 1])], sequential=True)
    assert s.handle(Submit(spec, now=0.0)) == [Dispatch("h0", (d(1, 0, 1),)), Dispatch("h1", (d(1, 1, 1),))]
    assert s.handle(fin(1, 1)) == []
    assert s.handle(fin(1, 0)) == [Dispatch("h0", (d(1, 2, 2),))]


# -------------------------------------------------------------------------- atomic admission property


HOST_ISLAND = {"h0": "a", "h1": "a", "h2": "b"}


def _random_run(rng: random.Random, rid: int, client: str) -> RunSpec:
    n = rng.randint(1, 5)
    nodes = []
    for i in range(n):
        host = rng.choice(list(HOST_ISLAND))
        deps = sorted(rng.sample(range(i), rng.randint(0, min(i, 2))))
        nodes.append(node(i, host, HOST_ISLAND[host], deps))
    return run(rid, nodes, client, priority=rng.randint(0, 2), sequential=rng.random() < 0.3)


@pytest.mark.parametrize("seed", range(40))
def test_random_interleavings_keep_one_global_order(seed: int) -> None:
    rng = random.Random(seed)
    s = new(max_inflight_nodes=rng.choice([3, 6, 256]), hang_timeout_s=rng.choice([None, 8.0]))
    s.handle(SetPolicy("a", rng.choice(list(Policy))))
    s.handle(SetPolicy("b", rng.choice(list(Policy))))
    per_host: dict[str, list[tuple[int, int, int]]] = {h: [] for h in HOST_ISLAND}  # (seq, run, node)
    skipped: dict[str, list[int]] = {h: [] for h in HOST_ISLAND}
    sent: list[tuple[int, int]] = []  # dispatched, not yet finished
    submitted: dict[str, list[int]] = {"c1": [], "c2": []}
    results: Counter[int] = Counter()
    now = 0.0
    rid = 0

    def apply(actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Dispatch):
                for dn in a.nodes:
                    per_host[a.host].append((dn.seq, dn.run_id, dn.node_index))
                    sent.append((dn.run_id, dn.node_index))
            elif isinstance(a, RunFinished):
                results[a.run_id] += 1
            elif isinstance(a, DropRun):
                for sk in a.skipped:
                    skipped[sk.host].append(sk.seq)

    for _ in range(300):
        now += 1.0
        r = rng.random()
        if r < 0.05:
            apply(s.handle(Tick(now)))
        elif r < 0.4 or not sent:
            rid += 1
            client = rng.choice(["c1", "c2"])
            submitted[client].append(rid)
            apply(s.handle(Submit(_random_run(rng, rid, client), now)))
        else:
            rid_i, idx = sent.pop(rng.randrange(len(sent)))
            ok = rng.random() > 0.05
            apply(s.handle(NodeFinished(rid_i, idx, ok, "" if ok else "boom", 0.1, now)))
    while sent:  # drain
        now += 1.0
        rid_i, idx = sent.pop(0)
        apply(s.handle(fin(rid_i, idx, now)))

    assert set(results) == set(range(1, rid + 1)) and set(results.values()) == {1}
    graph: dict[int, set[int]] = {}
    for host, entries in per_host.items():
        seqs = sorted([e[0] for e in entries] + skipped[host])
        assert seqs == list(range(1, len(seqs) + 1)), f"seqs on {host} not consecutive"
        order = [run_id for _, run_id, _ in sorted(entries)]
        blocks = [r for i, r in enumerate(order) if i == 0 or order[i - 1] != r]
        assert len(blocks) == len(set(blocks)), f"a run's seqs on {host} are not contiguous"
        for earlier, later in itertools.pairwise(blocks):
            graph.setdefault(later, set()).add(earlier)
        for client_runs in submitted.values():
            mine = [r for r in blocks if r in client_runs]
            assert mine == sorted(mine), "a client's runs were reordered"
    # one global order of runs, consistent with every host's seq order
    list(graphlib.TopologicalSorter(graph).static_order())


# ------------------------------------------------------------------------------ window and policies


def test_window_full_then_admitted_on_finish() -> None:
    s = new(max_inflight_nodes=4)
    assert s.handle(Submit(chain(1, 3), now=0.0)) == [Dispatch("h0", (d(1, 0, 1), d(1, 1, 2), d(1, 2, 3)))]
    assert s.handle(Submit(chain(2, 2, client="c2"), now=1.0)) == []
    (island,) = s.snapshot().islands
    assert [w.wait_reason for w in island.waiting] == ["window full: 3 nodes in flight on island a"]
    assert s.handle(fin(1, 0)) == [Dispatch("h0", (d(2, 0, 4), d(2, 1, 5)))]
    # a run larger than the window waits for an empty island, then runs
    assert s.handle(Submit(chain(3, 6, client="c3"), now=2.0)) == []
    for rid, i in [(1, 1), (1, 2), (2, 0)]:
        assert s.handle(fin(rid, i)) in ([], [RunFinished(1, True, "")])
    assert s.handle(fin(2, 1)) == [
        RunFinished(2, True, ""),
        Dispatch("h0", tuple(d(3, i, 6 + i) for i in range(6))),
    ]


def test_window_is_per_island() -> None:
    s = new(max_inflight_nodes=1)
    assert s.handle(Submit(chain(1, 1, "h0", "a"), now=0.0)) == [Dispatch("h0", (d(1, 0, 1),))]
    assert s.handle(Submit(chain(2, 1, "h2", "b", client="c2"), now=0.0)) == [Dispatch("h2", (d(2, 0, 1),))]


@pytest.mark.parametrize(("policy", "order"), [(Policy.FIFO, [2, 3]), (Policy.PRIORITY, [3, 2])])
def test_fifo_vs_priority(policy: Policy, order: list[int]) -> None:
    s = new(max_inflight_nodes=1)
    s.handle(SetPolicy("a", policy))
    s.handle(Submit(chain(1, 1, client="a"), now=0.0))
    s.handle(Submit(chain(2, 1, client="b", priority=0), now=1.0))
    s.handle(Submit(chain(3, 1, client="c", priority=5), now=2.0))
    reasons = {w.run_id: w.wait_reason for w in s.snapshot().islands[0].waiting}
    first, second = order
    assert reasons[first] == "window full: 1 nodes in flight on island a"
    expected = "behind an earlier run of p-2 (client b)" if policy is Policy.FIFO else \
        "behind a higher-priority run of p-3 (client c)"
    assert reasons[second] == expected
    assert s.handle(fin(1, 0)) == [RunFinished(1, True, ""), Dispatch("h0", (d(first, 0, 2),))]
    assert s.handle(fin(first, 0)) == [RunFinished(first, True, ""), Dispatch("h0", (d(second, 0, 3),))]


def test_priority_never_reorders_one_clients_runs() -> None:
    s = new(max_inflight_nodes=1)
    s.handle(SetPolicy("a", Policy.PRIORITY))
    s.handle(Submit(chain(1, 1, client="x"), now=0.0))
    s.handle(Submit(chain(2, 1, client="y", priority=0), now=1.0))
    s.handle(Submit(chain(3, 1, client="y", priority=9), now=2.0))
    s.handle(Submit(chain(4, 1, client="z", priority=5), now=3.0))
    reasons = {w.run_id: w.wait_reason for w in s.snapshot().islands[0].waiting}
    assert reasons[3] == "behind an earlier run of the same client"
    assert reasons[2] == "behind a higher-priority run of p-4 (client z)"
    assert s.handle(fin(1, 0))[-1] == Dispatch("h0", (d(4, 0, 2),))
    assert s.handle(fin(4, 0))[-1] == Dispatch("h0", (d(2, 0, 3),))
    assert s.handle(fin(2, 0))[-1] == Dispatch("h0", (d(3, 0, 4),))


def test_fair_share_converges_to_weights() -> None:
    s = GangScheduler(max_inflight_nodes=3)
    s.handle(SetPolicy("a", Policy.FAIR))
    weights = {"w1": 1.0, "w2": 2.0, "w4": 4.0, "w8": 8.0}
    admitted: Counter[str] = Counter()
    client_of: dict[int, str] = {}
    running: deque[tuple[int, int]] = deque()
    next_id = 0
    now = 0.0

    def submit(client: str) -> list[Action]:
        nonlocal next_id
        next_id += 1
        client_of[next_id] = client
        return s.handle(Submit(chain(next_id, 1, client=client, weight=weights[client]), now))

    def apply(actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Dispatch):
                for dn in a.nodes:
                    admitted[client_of[dn.run_id]] += 1
                    running.append((dn.run_id, dn.node_index))
            elif isinstance(a, RunFinished):  # always busy: more runs queued than the window holds
                apply(submit(client_of[a.run_id]))

    for client in weights:
        for _ in range(4):
            apply(submit(client))
    for _ in range(3000):
        now += 1.0
        rid, idx = running.popleft()
        apply(s.handle(fin(rid, idx, now, busy=1.0)))
    total = sum(admitted.values())
    for client, w in weights.items():
        share, want = admitted[client] / total, w / sum(weights.values())
        assert abs(share - want) <= 0.05 * want, (client, share, want)
    s.validate()


def test_fair_share_a_joining_client_does_not_take_the_whole_window_before_it_is_billed() -> None:
    """A client none of whose runs has finished yet has its runs in flight estimated at the other
    clients' node time, not at 0: estimated at 0, a weight-1 client that joined a weight-8 one
    got every free slot until its first run was billed (the whole window: 1111), then waited
    while the other caught up (15 in a row); the fair-share test under load saw w=1 take 16 runs
    at once and then wait ~2 s."""
    s = new(max_inflight_nodes=4)
    s.handle(SetPolicy("a", Policy.FAIR))
    client_of: dict[int, str] = {}
    running: deque[int] = deque()
    order: list[str] = []

    def apply(actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Dispatch):
                for dn in a.nodes:
                    running.append(dn.run_id)
                    order.append(client_of[dn.run_id][1])

    def submit(rid: int, client: str, weight: float, now: float) -> None:
        client_of[rid] = client
        apply(s.handle(Submit(chain(rid, 1, client=client, weight=weight), now)))

    for rid in range(1, 41):
        submit(rid, "w8", 8.0, 0.0)
    now = 0.0
    for _ in range(8):  # w8 alone: its node time (1 s) is known
        now += 1.0
        apply(s.handle(fin(running.popleft(), 0, now, busy=1.0)))
    for rid in range(101, 141):
        submit(rid, "w1", 1.0, now)
    joined = len(order)
    for _ in range(20):
        now += 1.0
        apply(s.handle(fin(running.popleft(), 0, now, busy=1.0)))
    assert "".join(order[joined:]) == "81888888881888888881"  # 1:8, from the first slot on
    s.validate()


def test_fair_share_newly_active_client_banks_no_credit() -> None:
    s = new(max_inflight_nodes=1)
    s.handle(SetPolicy("a", Policy.FAIR))
    s.handle(Submit(chain(1, 1, client="old"), now=0.0))
    s.handle(Submit(chain(2, 1, client="old"), now=0.0))
    s.handle(fin(1, 0, now=10.0, busy=10.0))
    s.handle(Submit(chain(3, 1, client="old"), now=10.0))
    s.handle(fin(2, 0, now=20.0, busy=10.0))  # old: 20 s measured + run 3 in flight (10 s estimated)
    s.handle(Submit(chain(4, 1, client="old"), now=20.0))
    assert s.handle(Submit(chain(5, 1, client="new", weight=2.0), now=20.0)) == []
    usage = {c.client: c for c in s.snapshot().islands[0].clients}
    assert usage["old"].used_s == 20.0
    assert usage["new"].used_s == 60.0  # caught up to old's virtual time (30 / 1) at weight 2
    reasons = {w.run_id: w.wait_reason for w in s.snapshot().islands[0].waiting}
    assert reasons[5] == "fair share: client new used 60.0 s at weight 2"
    # tie at virtual time 30: submit order
    assert s.handle(fin(3, 0, now=30.0, busy=10.0))[-1] == Dispatch("h0", (d(4, 0, 4),))
    # old at 40 s; new (virtual 30) runs until it catches up, getting twice old's device time
    assert s.handle(fin(4, 0, now=40.0, busy=10.0))[-1] == Dispatch("h0", (d(5, 0, 5),))
    s.handle(Submit(chain(6, 1, client="new", weight=2.0), now=40.0))
    s.handle(Submit(chain(7, 1, client="old"), now=40.0))
    assert s.handle(fin(5, 0, now=50.0, busy=10.0))[-1] == Dispatch("h0", (d(6, 0, 6),))
    assert s.handle(fin(6, 0, now=60.0, busy=10.0))[-1] == Dispatch("h0", (d(7, 0, 7),))


def test_fair_share_returning_client_is_caught_up() -> None:
    s = new(max_inflight_nodes=1)
    s.handle(SetPolicy("a", Policy.FAIR))
    s.handle(Submit(chain(1, 1, client="idle"), now=0.0))
    s.handle(fin(1, 0, now=1.0, busy=1.0))  # idle: used 1, then goes quiet
    s.handle(Submit(chain(2, 1, client="busy"), now=1.0))
    s.handle(fin(2, 0, now=50.0, busy=49.0))
    s.handle(Submit(chain(3, 1, client="busy"), now=50.0))  # in flight, estimated at 49 s
    s.handle(Submit(chain(4, 1, client="idle"), now=50.0))
    usage = {c.client: c.used_s for c in s.snapshot().islands[0].clients}
    # busy's run 2 ended the island's busy period (nobody had a live run): its 49 s and its node-time
    # estimate are forgotten (a warm-up run charged with its compilation must not weigh on the next
    # busy period), so idle starts level with busy's virtual time, 0
    assert usage == {"busy": 0.0, "idle": 0.0}
    s.handle(fin(3, 0, now=60.0, busy=10.0))
    s.handle(Submit(chain(5, 1, client="busy"), now=60.0))  # same busy period: no reset
    usage = {c.client: c.used_s for c in s.snapshot().islands[0].clients}
    assert usage == {"busy": 10.0, "idle": 0.0}


# -------------------------------------------------------------------------------------- failures


def test_node_failure_fails_run_and_drops_it() -> None:
    s = new(max_inflight_nodes=3)
    spec = run(1, [node(0, "h0", label="embed"), node(1, "h1", deps=[0]), node(2, "h0", deps=[1])])
    s.handle(Submit(spec, now=0.0))
    s.handle(Submit(chain(2, 2, client="c2"), now=0.0))  # waits: window
    assert s.handle(failed(1, 0, "OOM")) == [
        RunFinished(1, False, "node 0 (embed) failed: OOM"),
        DropRun(1, ("h1", "h0"), "node 0 (embed) failed: OOM"),
        Dispatch("h0", (d(2, 0, 3), d(2, 1, 4))),
    ]
    assert s.handle(fin(1, 1)) == []
    assert s.handle(failed(1, 2, "late")) == []


def test_sequential_failure_skips_undispatched_seqs() -> None:
    s = new()
    spec = run(1, [node(0, "h0"), node(1, "h0", deps=[0]), node(2, "h1", deps=[1])], sequential=True)
    assert s.handle(Submit(spec, now=0.0)) == [Dispatch("h0", (d(1, 0, 1),))]
    assert s.handle(failed(1, 0, "bad")) == [
        RunFinished(1, False, "node 0 (n0) failed: bad"),
        DropRun(1, ("h0", "h1"), "node 0 (n0) failed: bad", (SkippedSeq("h0", 2), SkippedSeq("h1", 1))),
    ]


def test_single_node_failure_has_no_droprun() -> None:
    s = new()
    s.handle(Submit(chain(1, 1), now=0.0))
    assert s.handle(failed(1, 0, "x")) == [RunFinished(1, False, "node 0 (n0) failed: x")]


def test_a_lost_host_fails_the_runs_reading_inputs_it_held() -> None:
    """Finding 6 of the trust issue: a run whose input (a future) lives on a host that is then
    lost waited for that input until the hang timeout, holding its host's gang order (and a
    collective held the worker's launch thread). It fails with the loss now."""
    from dataclasses import replace

    s = new()
    s.handle(Submit(replace(chain(1, 1, "h0"), reads_from=("h1",)), now=0.0))
    s.handle(Submit(chain(2, 1, "h0", client="c2"), now=0.0))  # behind it on h0, reads nothing of h1
    assert s.handle(HostUp("h1", now=1.0)) == []  # a re-registration is not a loss
    assert s.is_live(1)
    assert s.handle(HostLost("h1", now=5.0)) == [
        RunFinished(1, False, "host h1 lost: it held inputs of program p-1"),
        DropRun(1, ("h0",), "host h1 lost: it held inputs of program p-1"),
    ]
    assert s.is_live(2)


def test_host_lost() -> None:
    s = new(max_inflight_nodes=2)
    s.handle(Submit(run(1, [node(0, "h0"), node(1, "h1", deps=[0], label="mlp")]), now=0.0))
    s.handle(Submit(chain(2, 1, "h1", client="c2"), now=0.0))  # waiting: window
    s.handle(Submit(chain(3, 1, "h2", "b", client="c3"), now=0.0))  # other island, unaffected
    assert s.handle(HostLost("h1", now=5.0)) == [
        RunFinished(1, False, "host h1 lost: it held node 1 (mlp) of program p-1"),
        DropRun(1, ("h0",), "host h1 lost: it held node 1 (mlp) of program p-1"),
        RunFinished(2, False, "host h1 lost: it held node 0 (n0) of program p-2"),
    ]
    assert s.handle(Submit(chain(4, 1, "h1"), now=6.0)) == [
        RunFinished(4, False, "host h1 is down: node 0 of program p-4 is placed on it")
    ]
    assert s.handle(HostUp("h1", now=7.0)) == []
    assert s.handle(Submit(chain(5, 1, "h1"), now=8.0)) == [Dispatch("h1", (d(5, 0, 1),))]
    assert s.is_live(3)


def test_host_reregistering_fails_its_admitted_runs_and_restarts_seqs() -> None:
    s = new()
    s.handle(Submit(chain(1, 2, "h0"), now=0.0))
    assert s.handle(HostUp("h0", now=1.0)) == [
        RunFinished(1, False, "host h0 re-registered and lost its queue: it held node 0 (n0) of program p-1")
    ]
    assert s.handle(Submit(chain(2, 1, "h0"), now=2.0)) == [Dispatch("h0", (d(2, 0, 1),))]


def test_client_gone() -> None:
    s = new(max_inflight_nodes=2)
    s.handle(Submit(run(1, [node(0, "h0"), node(1, "h1")], client="bye"), now=0.0))
    s.handle(Submit(chain(2, 1, client="bye"), now=0.0))
    s.handle(Submit(chain(3, 1, client="stay"), now=0.0))
    assert s.handle(ClientGone("bye", now=1.0)) == [
        RunFinished(1, False, "cancelled: client bye disconnected"),
        DropRun(1, ("h0", "h1"), "cancelled: client bye disconnected"),
        RunFinished(2, False, "cancelled: client bye disconnected"),
        Dispatch("h0", (d(3, 0, 2),)),
    ]
    assert s.handle(ClientGone("bye", now=2.0)) == []


def test_a_client_cancels_a_run_of_its_own_admitted_or_waiting() -> None:
    """What a `pw` client sends when it could not upload a run's input (CancelRun): the run fails
    with its reason, dropped on its hosts as a lost host's runs are; the next run goes on."""
    s = new(max_inflight_nodes=2)
    s.handle(Submit(run(1, [node(0, "h0"), node(1, "h1")], client="c1"), now=0.0))
    s.handle(Submit(chain(2, 1, client="c1"), now=0.0))  # waits: the window is full
    s.handle(Submit(chain(3, 1, client="c2"), now=0.0))
    assert s.handle(CancelRun("c2", 1, "not yours", now=1.0)) == []  # another client's run: left
    assert s.handle(CancelRun("c1", 2, "input lost", now=1.0)) == [RunFinished(2, False, "input lost")]
    assert s.handle(CancelRun("c1", 1, "input 0x5 lost", now=1.0)) == [
        RunFinished(1, False, "input 0x5 lost"),
        DropRun(1, ("h0", "h1"), "input 0x5 lost"),
        Dispatch("h0", (d(3, 0, 2),)),
    ]
    assert s.handle(CancelRun("c1", 1, "again", now=2.0)) == []  # over already
    assert s.handle(CancelRun("c1", 99, "unknown", now=2.0)) == []


def test_runs_cancelled_in_one_batch_all_fail_before_the_next_admission() -> None:
    """What the controller sends for the runs reading an output of a run that failed before it
    started (server/controller/dispatch.py): cancelled together, none of them is admitted (sent
    to its workers) between two cancels only to be dropped there."""
    from server.scheduler import Batch

    s = new(max_inflight_nodes=1)
    s.handle(Submit(chain(1, 1, "h0", "a"), now=0.0))  # admitted: island a is full
    s.handle(Submit(chain(2, 1, "h0", "a"), now=0.0))  # waits
    s.handle(Submit(chain(3, 1, "h1", "b"), now=0.0))  # waits behind 2 (its client's order), island b idle
    actions = s.handle(Batch((CancelRun("c1", 2, "input lost", 1.0), CancelRun("c1", 3, "reads 2's", 1.0)), 1.0))
    assert actions == [RunFinished(2, False, "input lost"), RunFinished(3, False, "reads 2's")]
    assert all(isinstance(a, RunFinished) and a.unstarted for a in actions)  # neither reached a worker
    assert s.history()[-1].text == ("Batch of 2: CancelRun run 2 client c1: input lost; "
                                    "CancelRun run 3 client c1: reads 2's")
    s2 = new(max_inflight_nodes=1)  # one at a time: 3 is admitted as 2 fails, then dropped
    for r in (chain(1, 1, "h0", "a"), chain(2, 1, "h0", "a"), chain(3, 1, "h1", "b")):
        s2.handle(Submit(r, now=0.0))
    assert s2.handle(CancelRun("c1", 2, "input lost", 1.0)) == [RunFinished(2, False, "input lost"),
                                                                Dispatch("h1", (d(3, 0, 1),))]


# -------------------------------------------------------------------------------- hang detection


def test_hang_never_started() -> None:
    s = new(hang_timeout_s=30.0)
    s.handle(Submit(run(12, [node(0, "h0")] + [node(i, "b", deps=[i - 1]) for i in range(1, 13)]), now=0.0))
    s.handle(fin(12, 0, now=1.0))
    for i in range(1, 12):
        s.handle(fin(12, i, now=2.0))
    assert s.handle(Tick(now=31.0)) == []
    message = "node 12 of program p-12: host b never started it"
    assert s.handle(Tick(now=32.5)) == [
        HangDetected(12, 12, "b", message),
        RunFinished(12, False, f"hang detected: {message}"),
        DropRun(12, ("b",), f"hang detected: {message}"),
    ]
    assert s.handle(Tick(now=100.0)) == []


def test_hang_started_but_not_finished_blames_the_lowest_seq() -> None:
    s = new(hang_timeout_s=30.0)
    s.handle(Submit(chain(3, 1, "b"), now=0.0))
    s.handle(Submit(chain(4, 1, "b", client="c2"), now=0.0))  # queued behind run 3 on host b
    s.handle(NodeStarted(3, 0, now=5.0))
    assert s.handle(Tick(now=30.0)) == []
    message = "node 0 of program p-3: host b started it 31.0 s ago and it has not finished"
    assert s.handle(Tick(now=36.0)) == [
        HangDetected(3, 0, "b", message),
        RunFinished(3, False, f"hang detected: {message}"),
        DropRun(3, ("b",), f"hang detected: {message}"),
    ]
    # run 4 only now reached the head of host b: its clock starts now
    assert s.handle(Tick(now=60.0)) == []
    assert [type(a) for a in s.handle(Tick(now=66.5))] == [HangDetected, RunFinished, DropRun]


def test_hang_blames_the_node_the_others_wait_on() -> None:
    s = new(hang_timeout_s=10.0)
    s.handle(Submit(run(1, [node(0, "h0"), node(1, "h1", deps=[0])]), now=0.0))
    acts = s.handle(Tick(now=11.0))
    assert acts[0] == HangDetected(1, 0, "h0", "node 0 of program p-1: host h0 never started it")


def test_hang_detection_disabled_by_default() -> None:
    s = new()
    s.handle(Submit(chain(1, 1), now=0.0))
    assert s.handle(Tick(now=1e9)) == []


# ------------------------------------------------------------------------------------ idempotency


def test_duplicate_late_and_unknown_events_are_ignored() -> None:
    s = new()
    spec = chain(1, 2)
    s.handle(Submit(spec, now=0.0))
    assert s.handle(Submit(spec, now=0.0)) == []
    assert s.handle(NodeStarted(1, 0, now=1.0)) == []
    assert s.handle(NodeStarted(1, 0, now=1.0)) == []
    assert s.handle(fin(1, 0)) == []
    assert s.handle(fin(1, 0)) == []
    assert s.handle(NodeStarted(1, 0, now=2.0)) == []
    assert s.handle(fin(1, 1)) == [RunFinished(1, True, "")]
    assert s.handle(fin(1, 1)) == []
    assert s.handle(failed(1, 1, "late")) == []
    assert s.handle(Submit(spec, now=3.0)) == []  # finished runs are not re-run
    assert s.handle(fin(99, 0)) == []
    assert s.handle(NodeStarted(99, 0, now=3.0)) == []
    assert s.handle(fin(1, 7)) == []
    assert s.handle(HostLost("nowhere", now=3.0)) == []
    assert s.handle(ClientGone("nobody", now=3.0)) == []


def test_duplicate_deps_count_once() -> None:
    s = new()
    s.handle(Submit(run(1, [node(0), node(1, deps=[0, 0])], sequential=True), now=0.0))
    assert s.handle(fin(1, 0)) == [Dispatch("h0", (d(1, 1, 2),))]


def test_set_policy_without_time_does_not_move_the_clock_back() -> None:
    s = new(hang_timeout_s=10.0, max_inflight_nodes=1)
    s.handle(Submit(chain(1, 1), now=100.0))
    s.handle(Submit(chain(2, 1, client="c2"), now=100.0))
    s.handle(fin(1, 0, now=105.0))
    assert s.handle(SetPolicy("a", Policy.FAIR)) == []
    assert s.snapshot().now == 105.0
    assert s.handle(Tick(now=110.0)) == []


def test_sequential_node_not_yet_sent_ignores_reports() -> None:
    s = new()
    s.handle(Submit(chain(1, 2, sequential=True), now=0.0))
    assert s.handle(fin(1, 1)) == []
    assert s.handle(fin(1, 0)) == [Dispatch("h0", (d(1, 1, 2),))]


def test_invalid_and_empty_runs_finish_at_once() -> None:
    s = new()
    bad = run(1, [node(0, deps=[0])])
    assert s.handle(Submit(bad, now=0.0)) == [
        RunFinished(1, False, "invalid run: node 0 depends on node 0, which is not an earlier node")
    ]
    assert s.handle(Submit(run(2, []), now=0.0)) == [RunFinished(2, True, "")]
    assert s.handle(Submit(chain(3, 1, weight=0.0), now=0.0)) == [
        RunFinished(3, False, "invalid run: weight must be positive, got 0.0")
    ]


# --------------------------------------------------------------------------------------- snapshot


def test_snapshot() -> None:
    s = new(max_inflight_nodes=2)
    s.handle(SetPolicy("a", Policy.PRIORITY))
    s.handle(Submit(run(1, [node(0, "h0"), node(1, "h2", "b")], client="c1", job="j-1", priority=1), 0.0))
    s.handle(Submit(chain(2, 2, client="c2", priority=3), now=1.0))
    s.handle(fin(1, 1, now=2.0, busy=1.5))
    snap = s.snapshot()
    assert snap.now == 2.0
    a, b = snap.islands
    assert (a.island, a.policy, a.inflight_nodes, a.max_inflight_nodes) == ("a", "priority", 1, 2)
    assert (b.island, b.policy, b.inflight_nodes) == ("b", "fifo", 0)
    (running,) = a.running
    assert (running.run_id, running.program, running.client, running.job) == (1, "p-1", "c1", "j-1")
    assert (running.priority, running.weight, running.nodes_total, running.nodes_left) == (1, 1.0, 2, 1)
    assert running.admitted_at == 0.0 and running.wait_reason == ""
    (waiting,) = a.waiting
    assert (waiting.run_id, waiting.client, waiting.priority, waiting.admitted_at) == (2, "c2", 3, None)
    assert waiting.wait_reason == "window full: 1 nodes in flight on island a"
    assert [r.run_id for r in b.running] == [1] and b.waiting == ()
    assert [(c.client, c.used_s, c.active) for c in b.clients] == [("c1", 1.5, False)]
    assert [(h.host, h.up, h.next_seq, h.queued_nodes) for h in snap.hosts] == [
        ("h0", True, 2, 1),
        ("h2", True, 2, 0),
    ]


def test_public_api_is_pinned() -> None:
    assert set(sched_pkg.__all__) == {
        "Action",
        "CancelRun",
            "ClientGone",
        "ClientUsage",
        "Dispatch",
        "DispatchedNode",
        "DropRun",
        "Event",
        "GangScheduler",
        "HangDetected",
        "HostLost",
        "HostUp",
        "HostView",
        "InvalidTransition",
        "Batch",
        "InvariantError",
        "IslandView",
        "NodeFinished",
        "NodeSpec",
        "NodeStarted",
        "Policy",
        "RunFinished",
        "RunSpec",
        "RunView",
        "SchedulerSnapshot",
        "SetPolicy",
        "SkippedSeq",
        "Stall",
        "Submit",
        "Tick",
        "check_spec",
    }


# -------------------------------------------------------------------------------------- invariants


def test_invariant_error_is_the_shared_class() -> None:
    from server.invariants import InvariantError as Shared

    assert sched_pkg.InvariantError is Shared


def test_validation_failure_carries_the_stimuli_that_led_to_it() -> None:
    s = new()
    s.handle(HostUp("h0", now=0.5))
    s.handle(Submit(chain(7, 2, client="alice"), now=1.0))
    s.handle(NodeStarted(7, 0, now=2.0))
    s._inflight["a"] += 1  # corrupt the window accounting on purpose
    with pytest.raises(sched_pkg.InvariantError) as caught:
        s.handle(fin(7, 0, now=3.0))  # validate() runs after the stimulus (debug=True)
    err = caught.value
    assert "window accounting on island a" in err.problem
    texts = [h.text for h in err.history]
    assert texts[0] == "HostUp(host='h0', now=0.5)"
    assert texts[1].startswith("Submit run 7 (p-7) client alice: 2 nodes on ['h0']")
    assert texts[2:] == ["NodeStarted run 7 node 0", "NodeFinished run 7 node 0 ok"]
    assert [h.at for h in err.history] == [0.5, 1.0, 2.0, 3.0]
    message = str(err)
    assert "after these stimuli (oldest first)" in message and "NodeFinished run 7 node 0 ok" in message


def test_history_is_bounded_and_batches_are_summarised() -> None:
    from server.invariants import DEFAULT_HISTORY
    from server.scheduler import Batch

    s = new()
    for i in range(DEFAULT_HISTORY + 10):
        s.handle(Tick(now=float(i)))
    s.handle(Batch(tuple(Submit(chain(100 + i, 1, client=f"c{i}"), now=99.0) for i in range(10)), now=99.0))
    history = s.history()
    assert len(history) == DEFAULT_HISTORY
    assert history[0].text == "Tick(now=11.0)"  # the oldest ten fell out
    assert history[-1].text.startswith("Batch of 10: Submit run 100 ")
    assert history[-1].text.endswith("; ... 2 more")


def test_validation_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATHWAYS_VALIDATE", "1")
    assert GangScheduler().debug
    monkeypatch.setenv("PATHWAYS_VALIDATE", "0")
    assert not GangScheduler().debug
    s = GangScheduler()
    s.handle(Submit(chain(1, 2), now=0.0))
    s._inflight["a"] += 1
    s.handle(fin(1, 0))  # not validated: the corruption goes unnoticed until validate() is asked
    with pytest.raises(sched_pkg.InvariantError, match="window accounting"):
        s.validate()


def test_validate_finds_a_waiting_run_lost_from_its_queue_or_out_of_order() -> None:
    s = new(max_inflight_nodes=1)
    for rid in (1, 2, 3):
        s.handle(Submit(chain(rid, 1), now=0.0))  # run 1 admitted, 2 and 3 wait
    s._queues["c1"].reverse()  # 3 before 2
    with pytest.raises(sched_pkg.InvariantError, match="out of submit order"):
        s.validate()
    s._queues["c1"].clear()  # neither queued any more
    with pytest.raises(sched_pkg.InvariantError, match="2 runs wait but 0 are queued"):
        s.validate()
