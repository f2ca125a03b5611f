"""Relays (issue 31): a large island's controller messages through one relay per group of hosts
(server/controller/relays.py, server/worker/relay.py).

The worker's `Inbox` (the order every worker handles its messages in, whichever way each came)
and the controller's groups in process; then real local clusters whose controller relays from 2
hosts on: a gang program over three workers gives the exact results with its members' messages
relayed, and a relay killed while a program's runs go through it loses and duplicates nothing:
every run succeeds, before and after.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import LocalCluster, wait_for

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc
from server import relaysig
from server.controller.cluster import LOST, READY, HostInfo
from server.controller.links import WorkerLink
from server.controller.outbox import GangEnqueue, Message
from server.controller.relays import Relays, groups_of
from server.worker.relay import Inbox, gang_parts, relayed_message

pytestmark = pytest.mark.timeout(240)

RELAYS_FROM_2 = ("--relay-min-hosts", "2", "--relay-group", "4")


def _msg(seq: int) -> cpb.ControllerToWorker:
    return cpb.ControllerToWorker(release=wpb.ReleaseBuffers(buffer_ids=[seq]), seq=seq)


def _seqs(msgs: list[cpb.ControllerToWorker]) -> list[int]:
    return [m.seq for m in msgs]


def test_the_inbox_hands_out_messages_in_their_order_once() -> None:
    box = Inbox()
    assert _seqs(box.accept(_msg(1))) == [1]
    assert box.accept(_msg(3)) == [] and box.accept(_msg(4)) == []  # came early (own stream)
    assert _seqs(box.accept(_msg(2))) == [2, 3, 4]  # the relayed one fills the gap
    assert box.delivered == 4
    assert box.accept(_msg(3)) == [] and box.accept(_msg(2)) == []  # sent again after a relay failed
    assert box.accept(_msg(6)) == [] and box.accept(_msg(6)) == []  # waiting, and its copy
    assert _seqs(box.accept(_msg(5))) == [5, 6]
    assert box.duplicates == 3
    assert _seqs(box.accept(cpb.ControllerToWorker(release=wpb.ReleaseBuffers()))) == [0]  # unnumbered: at once
    box.reset()  # a new registration
    assert box.delivered == 0 and _seqs(box.accept(_msg(1))) == [1]


def test_a_gap_left_open_is_reported_once_per_limit() -> None:
    box = Inbox()
    box.accept(_msg(1), now=0.0)
    assert not box.stalled(100.0)  # nothing waits
    box.accept(_msg(3), now=10.0)  # 2 is missing
    assert not box.stalled(14.0, limit=5.0) and box.stalled(15.0, limit=5.0)
    assert not box.stalled(16.0, limit=5.0) and box.stalled(20.5, limit=5.0)  # again a limit later
    box.accept(_msg(2), now=21.0)  # filled
    assert box.gap_since is None and not box.stalled(100.0)


def _relay_setup(n: int) -> tuple[Relays, dict[str, HostInfo]]:
    """`n` relayable hosts of one island and group (their Registered sent, acknowledged and taken
    off their queues), and the relays over them."""
    hosts = {}
    for i in range(n):
        info = HostInfo(id=i, name=f"h{i}", island="big", address=f"10.0.0.{i}:7000", pid=0, kind="cpu",
                        machine_id=f"m{i}", device_ids=[i], state=READY)
        info.link = WorkerLink(info.name)
        info.link.ack(0)
        info.link.send(cpb.ControllerToWorker(registered=cpb.Registered(link=info.link.link_id)))
        info.link.ack(1)  # it handled its Registered: relayable
        hosts[info.name] = info
        _queued(info)
    return Relays(hosts, lambda island: sorted(hosts), min_hosts=2, group_size=n), hosts


def _queued(info: HostInfo) -> list[cpb.ControllerToWorker]:
    assert info.link is not None
    out = []
    while not info.link._queue.empty():
        m = info.link._queue.get_nowait()
        assert isinstance(m, cpb.ControllerToWorker)
        out.append(m)
    return out


def _flush(relays: Relays, names: list[str]) -> None:
    relays.send_all({n: [cpb.ControllerToWorker(drop=cpb.Drop(run_ids=[7]))] for n in names})


def test_relayed_messages_are_sent_again_directly_when_their_relay_fails_or_is_lost() -> None:
    relays, hosts = _relay_setup(4)
    _flush(relays, ["h1", "h2", "h3"])  # one group, relay h0 (it has nothing of its own)
    [batch] = _queued(hosts["h0"])
    parts = batch.relay.messages
    assert [p.host for p in parts] == ["h1", "h2", "h3"] and batch.seq == 0
    assert all(cpb.ControllerToWorker.FromString(p.message).seq == 2 for p in parts)
    assert not any(_queued(hosts[n]) for n in ("h1", "h2", "h3"))
    hosts["h1"].link.ack(2)  # type: ignore[union-attr]  # h1 got it through h0
    relays.failed("h0", ["h2"])  # h0 could not reach h2: h2 gets it directly, and from now on
    assert [m.seq for m in _queued(hosts["h2"])] == [2]
    _flush(relays, ["h1", "h2", "h3"])
    [batch] = _queued(hosts["h0"])
    assert [p.host for p in batch.relay.messages] == ["h1", "h3"]
    assert [m.seq for m in _queued(hosts["h2"])] == [3]
    relays.host_lost(hosts["h0"], "its connection closed")  # what h0 carried and nobody acknowledged
    assert _queued(hosts["h1"])[0].seq == 3
    assert [m.seq for m in _queued(hosts["h3"])] == [2, 3]
    assert not _queued(hosts["h2"])
    hosts["h0"].state = LOST
    _flush(relays, ["h1", "h3"])  # the group is h1..h3 now: relay h1
    [batch] = _queued(hosts["h1"])
    assert [p.host for p in batch.relay.messages] == ["h1", "h3"]


def test_groups_are_consecutive_and_balanced() -> None:
    names = [f"h{i:03d}" for i in range(130)]
    groups = groups_of(names, 64)
    assert [len(g) for g in groups] == [44, 43, 43]
    assert [n for g in groups for n in g] == names
    assert groups_of(names[:64], 64) == [tuple(names[:64])]
    assert groups_of([], 64) == []


def _gang(names: list[str], run_id: int = 7) -> tuple[wpb.Task, dict[str, list[Message]]]:
    """One gang node's flush: member i (of `names`) runs segment i at seq 10 + i, segment id 100 + i."""
    template = wpb.Task(run_id=run_id, segment=0, seq=10, segment_id=100, input_ids=[5], output_ids=[6],
                        output_visible=[True], owner="client:c1")
    msgs: dict[str, list[Message]] = {}
    for i, name in enumerate(names):
        msgs[name] = [GangEnqueue([(template, i, 10 + i, 100 + i)])]
    return template, msgs


def _member_task(template: wpb.Task, i: int) -> wpb.Task:
    task = wpb.Task()
    task.CopyFrom(template)
    task.segment, task.seq, task.segment_id = i, 10 + i, 100 + i
    return task


def _expand(batch: cpb.ControllerToWorker, hosts: dict[str, HostInfo]) -> dict[str, cpb.ControllerToWorker]:
    """What each member of a relay batch gets, as its worker reads it (server/worker/relay.py)."""
    out = {}
    for part in [*batch.relay.messages, *(p for g in batch.relay.gangs for p in gang_parts(g))]:
        info = hosts[part.host]
        assert info.link is not None and part.address == info.address
        inbox = Inbox()
        inbox.link, inbox.key = info.link.link_id, info.link.relay_key
        msg = relayed_message(part, inbox)
        assert msg is not None, part
        out[part.host] = msg
    return out


def test_a_relayed_gang_node_is_one_body_and_each_member_gets_its_own_task() -> None:
    """A gang node's members in one group: the batch carries one serialized body and the members'
    numbers, and the relay makes each member exactly its message (its seq, its task's segment,
    seq and segment id); nothing goes on the members' own streams."""
    relays, hosts = _relay_setup(4)
    names = ["h0", "h1", "h2", "h3"]
    template, msgs = _gang(names)
    relays.send_all(msgs)
    [batch] = _queued(hosts["h0"])  # h0 is the relay, and a member
    assert not batch.relay.messages and len(batch.relay.gangs) == 1
    [gang] = batch.relay.gangs
    assert list(gang.hosts) == names and list(gang.seqs) == [2, 2, 2, 2]
    body = cpb.ControllerToWorker.FromString(gang.body)
    assert len(body.enqueue.tasks) == 1 and body.seq == 0
    got = _expand(batch, hosts)
    assert sorted(got) == names
    for i, name in enumerate(names):
        assert got[name] == cpb.ControllerToWorker(seq=2, enqueue=wpb.Enqueue(tasks=[_member_task(template, i)]))
    assert not any(_queued(hosts[n]) for n in names[1:])
    assert relays.batches == 1 and relays.relayed == 4


def test_gang_members_not_acknowledged_get_their_own_messages_directly_when_the_relay_fails() -> None:
    """The controller keeps a relayed gang member's message as its numbers (not a message) until
    the member acknowledges it; when the relay is lost, or says it could not reach a member,
    each unacknowledged member gets, on its own stream, exactly the message the relay would have
    made for it."""
    relays, hosts = _relay_setup(4)
    names = ["h0", "h1", "h2", "h3"]
    template, msgs = _gang(names)
    relays.send_all(msgs)
    relayed = _expand(_queued(hosts["h0"])[0], hosts)
    hosts["h1"].link.ack(2)  # type: ignore[union-attr]  # h1 got it through h0
    relays.host_lost(hosts["h0"], "its connection closed")
    assert not _queued(hosts["h1"])
    for n in ("h2", "h3"):
        assert _queued(hosts[n]) == [relayed[n]]
    hosts["h0"].state = LOST
    # the group is h1..h3 now: relay h1; it cannot reach h3
    template, msgs = _gang(["h1", "h2", "h3"], run_id=8)
    relays.send_all(msgs)
    [batch] = _queued(hosts["h1"])
    relayed = _expand(batch, hosts)
    assert relayed["h3"].seq == 3 and relayed["h3"].enqueue.tasks[0] == _member_task(template, 2)
    relays.failed("h1", ["h3"])
    assert _queued(hosts["h3"]) == [relayed["h3"]]
    template, msgs = _gang(["h1", "h2", "h3"], run_id=9)
    relays.send_all(msgs)  # h3 is sent directly from now on
    [batch] = _queued(hosts["h1"])
    assert list(batch.relay.gangs[0].hosts) == ["h1", "h2"]
    direct = cpb.ControllerToWorker(seq=4, enqueue=wpb.Enqueue(tasks=[_member_task(template, 2)]))
    assert _queued(hosts["h3"]) == [direct]


def test_a_gang_member_alone_in_its_group_is_sent_directly_numbered_in_order() -> None:
    """One member of a group to write to: no batch, its message on its own stream with its seq,
    and nothing kept for a relay; the next message of that host follows it."""
    relays, hosts = _relay_setup(4)
    template, msgs = _gang(["h2"])
    relays.send_all(msgs)
    assert not _queued(hosts["h0"])
    direct = cpb.ControllerToWorker(seq=2, enqueue=wpb.Enqueue(tasks=[_member_task(template, 0)]))
    assert _queued(hosts["h2"]) == [direct]
    assert not hosts["h2"].link.retained  # type: ignore[union-attr]
    _flush(relays, ["h2"])
    assert [m.seq for m in _queued(hosts["h2"])] == [3]


def test_a_relayed_gang_whose_lists_do_not_match_gives_no_message() -> None:
    """A peer's malformed gang (a member list shorter than the others, or a body that does not
    decode) makes no message: its members ask the controller after the gap limit. The relay
    does not decode the body: its members do, after checking their signatures."""
    template, _ = _gang(["h0", "h1"])
    body = cpb.ControllerToWorker(enqueue=wpb.Enqueue(tasks=[template])).SerializeToString()
    good = cpb.RelayedGang(body=body, hosts=["h0", "h1"], addresses=["a0", "a1"], links=[1, 2], seqs=[3, 4],
                           task_segments=[0, 1], task_seqs=[10, 11], segment_ids=[100, 101],
                           macs=[b"m" * 16, b"n" * 16])
    assert [p.host for p in gang_parts(good)] == ["h0", "h1"]
    for field in ("task_seqs", "macs"):
        short = cpb.RelayedGang()
        short.CopyFrom(good)
        del getattr(short, field)[1:]
        assert list(gang_parts(short)) == [], field
    # a body that does not decode, signed (the controller's, were it to send one): its member
    # drops it after the signature check, and takes the next message as usual
    garbage = cpb.RelayedGang()
    garbage.CopyFrom(good)
    garbage.body = b"\xff\xff\xff"
    key = b"k" * 32
    digest = relaysig.body_digest(garbage.body)
    garbage.macs[0] = relaysig.sign_gang(relaysig.keyed(key), digest, relaysig.gang_numbers(3, [0], [10], [100]))
    [part, _] = gang_parts(garbage)
    inbox = Inbox()
    inbox.link, inbox.key = 1, key
    assert relayed_message(part, inbox) is None and inbox.rejected == 0


# six runs, their result; again for each line of input
SPMD = """
import json
import sys
import numpy as np
import pwctl as pw
import jax

s = pw.make_virtual_device_set().add_slice(devices=3, island="a")
step = pw.pmap(lambda x: x * 2.0 + jax.lax.psum(x, "i"), devices=s.devices, axis_name="i")
x = np.arange(3 * 5, dtype=np.float32).reshape(3, 5) / 7.0
want = x * 2.0 + x.sum(0)

def six():
    got = [np.asarray(step(x)) for _ in range(6)]
    print(json.dumps({"hosts": sorted({d.host for d in s.info.devices}),
                      "close": [bool(np.allclose(g, want, rtol=1e-6)) for g in got]}), flush=True)

six()
for _ in sys.stdin:
    six()
"""

PIPELINE = """
import json
import sys
import time
from pathlib import Path
import numpy as np
import pwctl as pw

work = Path(sys.argv[1])
vds = pw.make_virtual_device_set()
s = [vds.add_slice(devices=1, island="a") for _ in range(3)]
f0 = pw.pmap(lambda v: v * 2.0, devices=s[0].devices)
f1 = pw.pmap(lambda v: v + 3.0, devices=s[1].devices)
f2 = pw.pmap(lambda v: v - 1.0, devices=s[2].devices)

@pw.program
def pipe(x):
    return f2(f1(f0(x)))

x = np.arange(64, dtype=np.float32).reshape(1, -1)
want = x * 2.0 + 3.0 - 1.0
ok, wrong, errors = 0, 0, []
hosts = sorted({d.host for sl in s for d in sl.info.devices})
while not (work / "stop").exists():
    try:
        if np.array_equal(np.asarray(pipe(x)), want):
            ok += 1
        else:
            wrong += 1
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")
        if len(errors) > 5:
            break
    (work / "count").write_text(str(ok))
print(json.dumps({"ok": ok, "wrong": wrong, "errors": errors, "hosts": hosts}))
"""


def _stats(cluster: LocalCluster, name: str) -> wpb.WorkerStats:
    address = cluster.hosts()[name].address
    with cluster.channel(address) as ch:
        return wgrpc.WorkerStub(ch).Stats(wpb.WorkerStatsRequest(), timeout=10)


def _add_workers(cluster: LocalCluster, *names: str) -> None:
    """One-device workers of island a, started at once; waits until all are ready."""
    for name in names:
        cluster.add_worker("a", 1, name=name, wait=False)
    cluster.wait_ready(list(names))


def _no_repeats(stats: wpb.WorkerStats) -> None:
    """Each task a worker ran ("run:segment@seq") ran once: no message was handled twice."""
    twice = [e for e, k in Counter(stats.executed_order).items() if k > 1]
    assert not twice, f"{stats.host} ran tasks twice: {twice}"


class Pipeline:
    """PIPELINE's client on `cluster`, its runs counted in `tmp_path`/count; back once its first
    run is done. `finish(at_least)` stops it and checks what it says; `close()` kills it if it runs."""

    def __init__(self, cluster: LocalCluster, tmp_path: Path) -> None:
        self._work = tmp_path
        self.client = subprocess.Popen([sys.executable, "-c", PIPELINE, str(tmp_path)], env=cluster.env(),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: self.runs() > 0 or self.client.poll() is not None, 120, "the program's first run")
            assert self.client.poll() is None, self.client.communicate()[1][-3000:]
        except BaseException:
            self.close()
            raise

    def runs(self) -> int:
        count = self._work / "count"
        return int(count.read_text() or 0) if count.exists() else 0

    def finish(self, at_least: int) -> None:
        """Stops the loop: it ends well, every run was exact and no call failed, at least
        `at_least` ran, and its slices were on w-a, w-a2 and w-a3."""
        (self._work / "stop").write_text("stop")
        out, err = self.client.communicate(timeout=60)
        assert self.client.returncode == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert got["errors"] == [] and got["wrong"] == 0 and got["ok"] >= at_least, got
        assert got["hosts"] == ["w-a", "w-a2", "w-a3"], got

    def close(self) -> None:
        if self.client.poll() is None:
            self.client.kill()
            self.client.communicate()


@pytest.mark.cluster(islands=1, devices=1, heartbeat_timeout=15.0, controller_args=RELAYS_FROM_2)
def test_a_gang_program_through_a_relay_gives_the_exact_results(cluster: LocalCluster, tmp_path: Path) -> None:
    """Three one-device workers of island a, one group (relay w-a, the first by name): every run
    of a pmap with a psum over the three hosts carries its members' Enqueues in one batch to w-a,
    which forwards them; the results are NumPy's."""
    _add_workers(cluster, "w-a2", "w-a3")

    errors = tmp_path / "spmd.err"  # a file: a pipe nobody reads while the program runs could fill

    def start() -> tuple[subprocess.Popen[str], str]:
        deadline = time.monotonic() + 120
        while True:  # the island's group forms first (a run before then is refused, saying so)
            with open(errors, "w") as err:
                proc = subprocess.Popen([sys.executable, "-c", SPMD], env=cluster.env(), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=err, text=True)
            assert proc.stdout is not None
            first = proc.stdout.readline()
            if first:
                return proc, first
            proc.wait(timeout=30)
            if "forming" not in errors.read_text() or time.monotonic() > deadline:
                raise AssertionError(f"the program failed: {errors.read_text()[-3000:]}")
            time.sleep(2)

    def check(line: str) -> None:
        got = json.loads(line)
        assert got["hosts"] == ["w-a", "w-a2", "w-a3"] and got["close"] == [True] * 6, got

    # six runs: the group formed, the function compiled, every worker acknowledged its registration
    proc, first = start()
    try:
        check(first)
        assert proc.stdin is not None and proc.stdout is not None
        names = ("w-a", "w-a2", "w-a3")
        before = {n: _stats(cluster, n) for n in names}
        proc.stdin.write("\n")  # six more
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, f"the program ended: {errors.read_text()[-3000:]}"
        check(line)
        after = {n: _stats(cluster, n) for n in names}
        proc.communicate(timeout=60)
        assert proc.returncode == 0, errors.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # each of the 6 runs: w-a2's and w-a3's Enqueues forwarded by w-a, w-a's own handed to itself
    assert after["w-a"].relayed_out - before["w-a"].relayed_out >= 12, (before, after)
    assert all(after[n].relayed_in - before[n].relayed_in >= 6 for n in names), (before, after)
    for st in after.values():
        _no_repeats(st)


@pytest.mark.cluster(islands=1, devices=1, heartbeat_timeout=15.0, controller_args=RELAYS_FROM_2)
def test_a_relay_killed_mid_run_loses_and_duplicates_nothing(cluster: LocalCluster, tmp_path: Path) -> None:
    """A program over three one-device slices on w-a, w-a2, w-a3 runs in a loop; a fourth worker,
    r-0, joins island a and, first by name, becomes the group's relay: each run's three Enqueues
    go through it. It is killed while runs flow; the controller sends what it had not delivered
    directly, and every run before and after gives the exact result, each task run once."""
    _add_workers(cluster, "w-a2", "w-a3")
    pipeline = Pipeline(cluster, tmp_path)
    try:
        cluster.add_worker("a", 1, name="r-0")
        wait_for(lambda: _stats(cluster, "r-0").relayed_out >= 20, 60, "runs relayed through r-0")
        before = pipeline.runs()
        cluster.kill_worker("r-0")
        wait_for(lambda: pipeline.runs() >= before + 20 or pipeline.client.poll() is not None, 60,
                 "runs after the relay's death")
        pipeline.finish(before + 20)
    finally:
        pipeline.close()
    for name in ("w-a", "w-a2", "w-a3"):
        st = _stats(cluster, name)
        assert st.relayed_in > 0, st
        _no_repeats(st)
