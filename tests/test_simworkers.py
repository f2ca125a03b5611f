"""The simulated workers (bench/simworkers.py) against a real controller that requires its token:
8 simulated hosts register with 4 devices each in islands of 4, a silenced host and a disconnected
host are marked lost and come back when resumed, and after a controller restart every host
registers again and none is marked lost. With a slice over an island's hosts, the simulated hosts
answer the controller's `JoinGroup`s, and a gang node's runs (bench/gang.py) finish and are
recorded by the dispatch probe."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.gang import gang_dispatch, probe_lines, stop_island_services
from bench.scale import Controller, island_sizes
from bench.simworkers import SimWorkers, island_layout
from tests.conftest import LocalCluster, base_env, wait_for

HOSTS = 8


def test_island_layout() -> None:
    assert island_layout(6, [4]) == ["i0000-4"] * 4 + ["i0001-4"] * 2
    assert island_layout(10, [3, 2]) == ["i0000-3"] * 3 + ["i0001-2"] * 2 + ["i0002-2"] * 2 + ["i0003-2"] * 2 \
        + ["i0004-2"]
    for hosts, want in ((64, {4: 16}), (512, {64: 4, 4: 64}), (2048, {512: 1, 64: 12, 4: 192})):
        names = island_layout(hosts, island_sizes(hosts))
        assert len(names) == hosts
        counts: dict[int, int] = {}
        for island in set(names):
            counts[names.count(island)] = counts.get(names.count(island), 0) + 1
        assert counts == want
    with pytest.raises(ValueError):
        island_layout(4, [0])


@pytest.fixture
def controller(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    # not the default interval (1 s): the simulated hosts must beat at the one the controller gives
    c = make_cluster(start=False, controller_args=("--heartbeat-interval", "0.5"),
                     heartbeat_timeout=2.0)
    c.start_controller()
    assert c.token, "the controller writes its token"
    return c


@pytest.fixture
def sim(controller: LocalCluster) -> Iterator[SimWorkers]:
    with SimWorkers(controller.address, HOSTS, (4,), 4, token=controller.token,
                    env=controller.env(), log=controller.home / "sim.log") as s:
        yield s


def _hosts_json(c: LocalCluster) -> dict[str, dict[str, object]]:
    doc = c.pwctl_json("host", "list", PWCTL_TOKEN=c.token or "")
    assert doc["kind"] == "HostList"
    return {h["name"]: h for h in doc["items"]}


def _state(c: LocalCluster, name: str) -> object:
    return _hosts_json(c)[name]["state"]


@pytest.mark.timeout(180)
def test_simulated_hosts_register_are_lost_and_come_back(controller: LocalCluster, sim: SimWorkers) -> None:
    c = controller
    reg = sim.wait_registered(timeout=60)
    assert reg["ok"], reg

    hosts = _hosts_json(c)
    assert sorted(hosts) == sim.names
    assert all(h["state"] == "ready" and h["devices"] == 4 and h["device_kind"] == "cpu" for h in hosts.values())
    assert {n: h["island"] for n, h in hosts.items()} == dict(zip(sim.names, sim.islands, strict=True))
    islands = {i["name"]: i for i in c.pwctl_json("island", "list", PWCTL_TOKEN=c.token or "")["items"]}
    assert sorted(islands) == ["i0000-4", "i0001-4"]
    assert all(i["hosts"] == 4 and i["devices"] == 16 and i["available_devices"] == 16 for i in islands.values())
    with c.client() as client:
        devices = client.devices()
    assert len(devices) == HOSTS * 4
    detail = sim.status(detail=True)
    # each host got its own 4 cluster device ids and the controller's heartbeat interval
    ids = [d for name in sim.names for d in detail["device_ids"][name]]
    assert sorted(ids) == sorted(d.id for d in devices)
    assert detail["intervals"] == [0.5]
    assert detail["rejected"] == []
    beats = detail["heartbeats"]
    wait_for(lambda: sim.status()["heartbeats"] >= beats + HOSTS, 10, "a round of heartbeats")

    silent, closed = sim.names[1], sim.names[6]
    sim.silence([silent])
    sim.disconnect([closed])
    wait_for(lambda: _state(c, closed) == "lost", 10, f"{closed} lost")
    wait_for(lambda: _state(c, silent) == "lost", 20, f"{silent} lost")
    states = {n: h["state"] for n, h in _hosts_json(c).items()}
    assert [n for n, s in states.items() if s != "ready"] == sorted([silent, closed])
    assert "no heartbeat" in c.controller_logs() and "its connection closed" in c.controller_logs()

    sim.resume([silent, closed])
    assert sim.wait_registered(timeout=30)["ok"]
    wait_for(lambda: all(h["state"] == "ready" for h in _hosts_json(c).values()), 20, "all ready again")

    c.stop_controller()
    stopped = time.monotonic()
    c.start_controller()
    back = sim.wait_registered(since=stopped, timeout=30)
    assert back["ok"], back
    hosts = _hosts_json(c)
    assert sorted(hosts) == sim.names and all(h["state"] == "ready" and h["devices"] == 4 for h in hosts.values())
    # past the restarted controller's reconnect timeout (2 s): still nobody lost. (A sleep: what is
    # checked is that nothing happens within the timeout.)
    restarted_log = sorted(c.home.glob("controller-*.log"))[-1]
    time.sleep(2.5)
    assert " lost: " not in restarted_log.read_text()
    assert all(h["state"] == "ready" for h in _hosts_json(c).values())


@pytest.mark.timeout(60)
def test_wrong_token_is_rejected(controller: LocalCluster) -> None:
    with SimWorkers(controller.address, 2, (4,), 4, token="not-the-token", env=controller.env()) as s:
        # (gRPC sometimes ends the stream as INTERNAL instead, before the abort's status arrives)
        def rejected() -> dict[str, Any] | None:
            st = s.status()
            return st if "UNAUTHENTICATED: missing or wrong token" in st["rejected"] else None

        status = wait_for(rejected, 30, "the rejection")
        assert status["registered"] == 0 and status["registrations"] == 0
    with controller.client() as client:
        assert client.hosts() == []


@pytest.mark.timeout(120)
def test_simulated_hosts_join_the_island_group_and_finish_gang_runs(tmp_path: Path) -> None:
    env = base_env(tmp_path, PATHWAYS_DISPATCH_PROBE=str(tmp_path / "probe.jsonl"))
    ctl = Controller(tmp_path)
    ctl.start(env)
    try:
        with SimWorkers(ctl.address, 4, (4,), 4, env=env, log=tmp_path / "sim.log", complete=True) as sim:
            assert sim.wait_registered(timeout=60)["ok"]
            assert sim.status()["joins"] == 0  # no slice spans hosts yet: no group
            # a slice over the island's 16 devices spans its 4 hosts: the answer waits for the group
            r = gang_dispatch(ctl.address, "i0000-4", 4, 16, tmp_path / "probe.jsonl", runs=3, warmup=1,
                              token=ctl.token)
            assert sim.status()["joins"] == 4  # one JoinGroup per member, each answered
            assert r.tasks == 4 and len(r.latencies_s) == 3
            recs = probe_lines(tmp_path / "probe.jsonl")
            assert len(recs) == 4 and all(rec["ok"] and rec["tasks"] == rec["segments"] == 4 for rec in recs.values())
            for rec in recs.values():
                assert rec["arrived"] <= rec["queued"] <= rec["handed"]  # type: ignore[operator]
                assert 0 <= rec["queued_cpu"] <= rec["cpu"] <= rec["handed"] - rec["arrived"] + 0.01  # type: ignore[operator]
            assert sim.status()["rejected"] == []
    finally:
        ctl.stop()
        stop_island_services(tmp_path)


@pytest.mark.timeout(120)
def test_simulated_hosts_relay_a_gang_nodes_enqueues(tmp_path: Path) -> None:
    """The simulator speaks the relay protocol (server/worker/relay.py): 8 hosts in one island,
    a controller relaying from 4 hosts on in groups of 4: each gang run leaves the controller as
    two relay batches, the relays forward over real `Relayed` streams, and every member receives
    its task once (the dispatch probe counts 8 tasks a run, the simulator none twice)."""
    env = base_env(tmp_path, PATHWAYS_DISPATCH_PROBE=str(tmp_path / "probe.jsonl"))
    ctl = Controller(tmp_path, ("--relay-min-hosts", "4", "--relay-group", "4"))
    ctl.start(env)
    try:
        with SimWorkers(ctl.address, 8, (8,), 4, env=env, log=tmp_path / "sim.log", complete=True,
                        listen_min=4) as sim:
            assert sim.wait_registered(timeout=60)["ok"]
            time.sleep(1.5)  # a heartbeat each: every host acknowledged its registration (relayable)
            r = gang_dispatch(ctl.address, "i0000-8", 8, 32, tmp_path / "probe.jsonl", runs=4, warmup=1,
                              token=ctl.token, received=sim.received)
            st = sim.status()
            assert r.tasks == 8 and len(r.latencies_s) == 4
            assert st["relayed_out"] >= 4 * 6, st  # each run: 3 members of each of the 2 groups
            assert st["relayed_in"] >= 4 * 8, st  # ... and the relays' own parts
            assert st["duplicates"] == 0 and st["rejected"] == [], st
            assert len(r.received_s) == 4 and all(0 < x < 10 for x in r.received_s), r.received_s
    finally:
        ctl.stop()
        stop_island_services(tmp_path)
