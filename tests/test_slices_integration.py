"""Virtual slices end to end: the real `pwctl` against a controller and two workers (subprocesses).

Islands: "a" with 4 devices (worker w-a), "b" with 2 devices (worker w-b). Device ids are the
controller's database ids, so tests read them from `pwctl device list -o json`, never assume them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import REPO, LocalCluster, wait_for
from together import pwctls

from pwctl.client import Client
from pwctl.errors import PathwaysError, Rejected
from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def shared_lc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One cluster for the module's tests: starting one takes seconds, and each test leaves it as
    it found it (see `lc`). Its logs are checked for broken invariants when the module ends."""
    with LocalCluster(tmp_path_factory.mktemp("slices-cluster")) as c:
        c.start([("a", 4), ("b", 2)])
        yield c


@pytest.fixture
def lc(shared_lc: LocalCluster) -> Iterator[LocalCluster]:
    """The module's cluster, as every test finds it: no slices, both workers ready. A test that
    killed a worker started it again; the slices a test leaves are deleted after it."""
    c = shared_lc
    with c.client() as client:
        assert not client.slices(), "a previous test left slices behind"
    yield c
    with c.client() as client:
        for s in client.slices():
            client.delete_slice(s.name)
    for name, w in c.workers.items():
        if w.proc.poll() is not None:
            c.add_worker(w.island, w.devices, name=name, wait=False)
    c.wait_ready()


def slices(c: LocalCluster) -> dict[str, Any]:
    doc = c.pwctl_json("slice", "list")
    assert doc["kind"] == "SliceList"
    return {s["name"]: s for s in doc["items"]}


def mapping(s: dict[str, Any]) -> list[int]:
    return [d["device_id"] for d in s["devices"]]


def wait_slices(c: LocalCluster, ok: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
    """Polls `pwctl slice list` until `ok(slices)`; returns those slices."""

    def check() -> dict[str, Any] | None:
        s = slices(c)
        return s if ok(s) else None

    return wait_for(check, 30, what)


def island_devices(c: LocalCluster) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for d in c.pwctl_json("device", "list")["items"]:
        out.setdefault(d["island"], []).append(d["id"])
    return out


def test_create_list_describe_delete(lc: LocalCluster) -> None:
    ids = island_devices(lc)

    # dry run: a placement and its explanation, nothing reserved
    r = lc.pwctl("slice", "create", "train", "--devices", "4", "--mesh", "2x2", "--dry-run", "-o", "json")
    assert r.returncode == 0, r.stderr
    preview = json.loads(r.stdout)["item"]
    assert preview["state"] == "preview" and mapping(preview) == ids["a"]
    assert "nothing was reserved" in r.stderr and "island a" in r.stderr
    assert slices(lc) == {}

    r = lc.pwctl("slice", "create", "train", "--devices", "4", "--mesh", "2x2", "-o", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["apiVersion"] == "pathways/v1" and doc["kind"] == "Slice"
    train = doc["item"]
    assert train["state"] == "ready" and train["spec"]["mesh"] == [2, 2]
    assert mapping(train) == ids["a"]
    assert [d["index"] for d in train["devices"]] == [0, 1, 2, 3]
    assert [d["local_index"] for d in train["devices"]] == [0, 1, 2, 3]
    assert {d["host"] for d in train["devices"]} == {"w-a"} and all(d["address"] for d in train["devices"])
    assert train["created_at"].endswith("Z")

    # the human view shows the virtual -> physical mapping; the placement reason goes to stderr
    r = lc.pwctl("slice", "create", "--devices", "2")
    assert r.returncode == 0, r.stderr
    assert "slice-1" in r.stdout and "w-b" in r.stdout and "placement:" in r.stderr
    assert mapping(slices(lc)["slice-1"]) == ids["b"]  # spread: the idle island

    # capacity: exit 4 with the resource manager's reason
    r = lc.pwctl("slice", "create", "big", "--devices", "8")
    assert r.returncode == 4
    assert r.stderr.strip() == (
        "error: needs 8 devices on one island; the largest island has 4 (island a, 4 free)"
    )

    # bad input: refused, state unchanged (the refusals change nothing: they run at once)
    before = slices(lc)
    cases = [
        (["--devices", "0"], 2, "devices must be positive"),
        (["--devices", "-1"], 2, "devices must be positive"),
        (["--devices", "3", "--mesh", "2x2"], 2, "mesh (2, 2) has 4 devices"),
        (["--mesh", "2xq"], 2, "invalid --mesh '2xq'"),
        (["--devices", "1", "--island", "nope"], 3, "unknown island 'nope'"),  # not found, as in host list
        (["--devices", "1", "--kind", "tpu"], 2, "unknown device kind 'tpu'"),
        (["--devices", "1", "--kind", "gpu"], 2, "no gpu devices"),
        (["train", "--devices", "1"], 4, "already exists"),
        (["Bad_Name", "--devices", "1"], 2, "invalid slice name"),
    ]
    refused = pwctls(lc, *(["slice", "create", *args] for args, _, _ in cases))
    for (args, code, text), r in zip(cases, refused, strict=True):
        assert r.returncode == code, (args, r.returncode, r.stderr)
        assert text in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert slices(lc) == before

    # exclusive: needs unshared devices; a's are shared by train, b's by slice-1
    r = lc.pwctl("slice", "create", "ex", "--devices", "2", "--exclusive")
    assert r.returncode == 4 and "unshared" in r.stderr
    r = lc.pwctl("slice", "delete", "slice-1", "-y")
    assert r.returncode == 0, r.stderr
    ex = lc.pwctl_json("slice", "create", "ex", "--devices", "2", "--exclusive")["item"]
    assert mapping(ex) == ids["b"] and ex["spec"]["exclusive"]
    r = lc.pwctl("slice", "create", "shared", "--devices", "1", "--island", "b")
    assert r.returncode == 4 and "held exclusively" in r.stderr

    # describe (a unique prefix is enough), device slice counts, server info
    d = lc.pwctl_json("slice", "describe", "tr")
    assert d["kind"] == "Slice" and d["item"]["name"] == "train"
    r = lc.pwctl("slice", "describe", "train")
    assert r.returncode == 0 and "VIRTUAL" in r.stdout and "2x2" in r.stdout
    counts = {d["id"]: d["slices"] for d in lc.pwctl_json("device", "list")["items"]}
    assert all(counts[i] == 1 for i in ids["a"] + ids["b"])
    with lc.client() as c:
        assert c.info().slices == 2
    r = lc.pwctl("slice", "describe", "nope")
    assert r.returncode == 3 and "no slice named 'nope'" in r.stderr

    # delete: refuses without -y on a non-interactive stdin; unknown names delete nothing
    r = subprocess.run([sys.executable, "-m", "pwctl.cli.main", "slice", "delete", "train"], env=lc.env(),
                       cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert r.returncode == 2 and "pass -y" in r.stderr
    r = lc.pwctl("slice", "delete", "train", "nope", "-y")
    assert r.returncode == 3
    assert set(slices(lc)) == {"train", "ex"}
    r = lc.pwctl("slice", "delete", "train", "ex", "-y")
    assert r.returncode == 0, r.stderr
    assert slices(lc) == {}
    assert lc.pwctl("slice", "list").returncode == 0


def test_concurrent_exclusive_creates_exactly_one_wins(lc: LocalCluster) -> None:
    """Two clients, connected beforehand, released by one barrier: their creates are in flight
    together. Over several rounds exactly one wins island b's last two unshared devices each time."""
    ids = island_devices(lc)
    r = lc.pwctl("slice", "create", "hold", "--devices", "4", "--island", "a", "--exclusive")
    assert r.returncode == 0, r.stderr
    clients = [lc.client(timeout=30) for _ in range(2)]
    try:
        for c in clients:
            c.info()  # connected: the barrier releases requests, not connection set-ups
        for round_ in range(5):
            names = [f"r{round_}-{i}" for i in range(2)]
            barrier = threading.Barrier(len(names))
            outcomes: dict[str, object] = {}

            def create(client: Client, name: str, barrier: threading.Barrier = barrier,
                       outcomes: dict[str, object] = outcomes) -> None:
                barrier.wait(timeout=30)
                try:
                    outcomes[name] = client.create_slice(cpb.SliceSpec(name=name, devices=2, exclusive=True))
                except PathwaysError as e:
                    outcomes[name] = e

            threads = [threading.Thread(target=create, args=(c, n)) for c, n in zip(clients, names, strict=True)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            won = [n for n in names if isinstance(outcomes[n], cpb.CreateSliceResponse)]
            lost = [outcomes[n] for n in names if n not in won]
            assert len(won) == 1, outcomes
            assert isinstance(lost[0], Rejected) and "unshared" in str(lost[0]), lost
            state = slices(lc)
            assert set(state) == {"hold", won[0]}
            assert mapping(state[won[0]]) == ids["b"]
            clients[0].delete_slice(won[0])
        clients[0].delete_slice("hold")
    finally:
        for c in clients:
            c.close()


def test_restart_keeps_slices_and_mappings(lc: LocalCluster) -> None:
    for args in (["one", "--devices", "2", "--mesh", "1x2", "--island", "b"],
                 ["two", "--devices", "3", "--exclusive"],
                 ["three", "--devices", "1", "--island", "b"]):
        r = lc.pwctl("slice", "create", *args)
        assert r.returncode == 0, r.stderr
    before = slices(lc)
    lc.restart_controller()
    after = slices(lc)  # straight from the database, before the workers re-registered
    assert after == before
    lc.wait_ready()
    assert slices(lc) == before
    # the restored state is live: the exclusive slice still holds its devices
    r = lc.pwctl("slice", "create", "more", "--devices", "2", "--exclusive", "--island", "a")
    assert r.returncode == 4, r.stderr


def test_lost_worker_remaps_or_degrades_and_recovers(lc: LocalCluster) -> None:
    ids = island_devices(lc)
    assert lc.pwctl("slice", "create", "big", "--devices", "4").returncode == 0  # island a
    assert lc.pwctl("slice", "create", "small", "--devices", "2").returncode == 0  # spread: island b
    assert lc.pwctl("slice", "create", "pinned", "--devices", "1", "--island", "b").returncode == 0
    s = slices(lc)
    assert mapping(s["big"]) == ids["a"] and mapping(s["small"]) == ids["b"]
    small_before = mapping(s["small"])

    # island b goes away: its unpinned slice moves to a, the pinned one cannot and degrades
    lc.kill_worker("w-b")
    s = wait_slices(lc, lambda s: s["small"]["state"] == "remapped", "small to be remapped")
    small = s["small"]
    assert set(mapping(small)) <= set(ids["a"]) and small["generation"] == 1
    assert small["reason"] == "host w-b lost"
    history = [(h["old_devices"], h["new_devices"]) for h in small["history"]]
    assert history == [(small_before, mapping(small))]
    assert s["pinned"]["state"] == "degraded" and "island b has 0 healthy devices" in s["pinned"]["reason"]
    assert s["big"]["state"] == "ready"
    r = lc.pwctl("slice", "describe", "small")
    assert "history" in r.stdout and "old [" in r.stdout and "-> new [" in r.stdout

    # island a goes away too: nothing fits anywhere, both placed slices degrade
    lc.kill_worker("w-a")
    s = wait_slices(lc, lambda s: all(x["state"] == "degraded" for x in s.values()), "all slices degraded")
    assert "host w-a lost" in s["big"]["reason"]

    # the workers come back: slices are placed again (big on its old devices)
    lc.add_worker("a", 4, wait=False)
    lc.add_worker("b", 2, wait=False)
    lc.wait_ready()
    s = wait_slices(lc, lambda s: all(x["state"] != "degraded" for x in s.values()), "all slices placed")
    assert mapping(s["big"]) == ids["a"] and s["big"]["state"] == "ready"
    assert s["pinned"]["state"] == "ready" and set(mapping(s["pinned"])) <= set(ids["b"])
    assert lc.hosts()["w-b"].state == pb.HOST_STATE_READY


@pytest.mark.cluster(islands=2, devices=2, controller_args=["--session-grace", "1"])
def test_client_owned_slices_go_with_a_controller_restart(cluster: LocalCluster) -> None:
    """A client's session that does not resume within the grace after a controller restart loses
    its unnamed slices; named slices stay."""
    stop = threading.Event()

    def hello() -> Iterator[cpb.ClientMessage]:
        yield cpb.ClientMessage(hello=cpb.Hello(client_name="test"))
        stop.wait(30)

    with cluster.client() as c:
        session = c.session(hello())  # a slice is owned only by a session of the caller (issue 29)
        welcome = next(iter(session)).welcome
        c.create_slice(cpb.SliceSpec(devices=1), owner=f"client:{welcome.client_id}")
        c.create_slice(cpb.SliceSpec(name="keep", devices=1))
        cluster.restart_controller(kill=True)  # the session's end is never handled: the restart drops its slice
        stop.set()
    wait_for(lambda: {s["name"] for s in cluster.pwctl_json("slice", "list")["items"]} == {"keep"}, 30,
             "the unresumed session's slice to go")
