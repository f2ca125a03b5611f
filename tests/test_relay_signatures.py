"""Signed relayed messages (server/relaysig.py): a relay cannot forge, alter or replay what it
carries for its members, and the honest members' messages still flow.

In process, with the controller's real `Relays` and links and the worker's real `Inbox`: every
part a batch carries reaches its member; a part altered in any signed field, signed for another
host or for an earlier registration, or unsigned, is rejected and counted; a replay is handled
once. The controller counts what members report, logs it rate-limited and sends that member
directly. Then a real cluster whose relay is hostile (tests/clients/hostile_relay.py: a real
worker process whose relay forges a Drop under each of one member's messages, with the genuine
signature, and replays the previous one): the program's runs all give the exact results, the
victim rejected the forgeries, the other members' messages keep coming through the relay.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import LocalCluster, wait_for
from test_metrics import metrics_url, scrape, value
from test_relays import (
    RELAYS_FROM_2,
    Pipeline,
    _expand,
    _flush,
    _gang,
    _no_repeats,
    _queued,
    _relay_setup,
    _stats,
)

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb
from server import relaysig
from server.controller.cluster import HostInfo
from server.controller.outbox import GangEnqueue, Message
from server.controller.relays import Relays
from server.worker.relay import Inbox, gang_parts, relayed_message

HOSTILE = Path(__file__).resolve().parent / "clients" / "hostile_relay.py"


def _parts(batch: cpb.ControllerToWorker) -> list[wpb.RelayedMessage]:
    return [*batch.relay.messages, *(p for g in batch.relay.gangs for p in gang_parts(g))]


def _inbox(info: HostInfo) -> Inbox:
    """A fresh worker inbox of `info`'s registration that handled its Registered (seq 1)."""
    assert info.link is not None
    inbox = Inbox()
    inbox.link, inbox.key = info.link.link_id, info.link.relay_key
    assert inbox.accept(cpb.ControllerToWorker(seq=1, registered=cpb.Registered(link=info.link.link_id)))
    return inbox


def _copy(part: wpb.RelayedMessage) -> wpb.RelayedMessage:
    out = wpb.RelayedMessage()
    out.CopyFrom(part)
    return out


def _batch(relays: Relays, hosts: dict[str, HostInfo], gang: bool) -> list[wpb.RelayedMessage]:
    if gang:
        relays.send_all(_gang(sorted(hosts))[1])
    else:
        _flush(relays, sorted(hosts))
    [batch] = _queued(hosts["h0"])
    return _parts(batch)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("gang", [False, True], ids=["plain", "gang"])
def test_a_part_altered_in_any_signed_field_is_rejected(gang: bool) -> None:
    """Each member takes its own part; the same part altered (the message's bytes, or a gang
    member's seq, task numbers or body), with no signature, or with another member's, is dropped
    and counted, and the genuine part is still taken after it."""
    relays, hosts = _relay_setup(4)
    parts = _batch(relays, hosts, gang)
    assert len(parts) == 4 and all(len(p.mac) == relaysig.TAG_BYTES for p in parts)
    if gang:
        assert all(p.HasField("gang") and not p.message for p in parts)
    part = next(p for p in parts if p.host == "h2")
    other = next(p for p in parts if p.host == "h3")

    def altered() -> list[wpb.RelayedMessage]:
        out = []
        unsigned = _copy(part)
        unsigned.ClearField("mac")
        out.append(unsigned)
        swapped = _copy(part)
        swapped.mac = other.mac  # another member's genuine signature
        out.append(swapped)
        if not gang:
            msg = cpb.ControllerToWorker.FromString(part.message)
            forged = cpb.ControllerToWorker(seq=msg.seq, drop=cpb.Drop(run_ids=[99], reason="forged"))
            bad = _copy(part)
            bad.message = forged.SerializeToString()
            out.append(bad)
            flipped = _copy(part)
            flipped.message = part.message[:-1] + bytes([part.message[-1] ^ 1])
            out.append(flipped)
            return out
        for change in ("seq", "segment", "task_seq", "segment_id", "body", "tasks"):
            bad = _copy(part)
            g = bad.gang
            if change == "seq":
                g.seq += 1
            elif change == "segment":
                g.task_segments[0] += 1
            elif change == "task_seq":
                g.task_seqs[0] += 1
            elif change == "segment_id":
                g.segment_ids[0] += 1
            elif change == "body":
                body = cpb.ControllerToWorker.FromString(g.body)
                body.enqueue.tasks[0].run_id = 99
                g.body = body.SerializeToString()
            else:  # a second task
                g.task_segments.append(0)
                g.task_seqs.append(0)
                g.segment_ids.append(0)
            out.append(bad)
        return out

    forgeries = altered()
    inbox = _inbox(hosts["h2"])
    for bad in forgeries:
        assert relayed_message(bad, inbox) is None, bad
    assert inbox.rejected == len(forgeries) and inbox.delivered == 1
    msg = relayed_message(part, inbox)
    assert msg is not None and msg.seq == 2
    assert _expand(cpb.ControllerToWorker(relay=cpb.RelayBatch(messages=[part])), hosts)["h2"] == msg
    assert [m.seq for m in inbox.accept(msg)] == [2]
    for p in parts:  # every member takes its own
        own = _inbox(hosts[p.host])
        assert relayed_message(p, own) is not None and own.rejected == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("gang", [False, True], ids=["plain", "gang"])
def test_replays_are_rejected_or_handled_once(gang: bool) -> None:
    """A part replayed to another host (relabelled with its name and link), or to a later
    registration of its own host (relabelled with the new link: the key is per registration), is
    rejected; the same part twice is handled once (its seq is signed)."""
    relays, hosts = _relay_setup(4)
    parts = _batch(relays, hosts, gang)
    part = next(p for p in parts if p.host == "h1")
    inbox = _inbox(hosts["h2"])
    replay = _copy(part)
    replay.host, replay.address, replay.link = "h2", hosts["h2"].address, hosts["h2"].link.link_id  # type: ignore[union-attr]
    assert relayed_message(replay, inbox) is None and inbox.rejected == 1

    own = _inbox(hosts["h1"])
    msg = relayed_message(part, own)
    assert msg is not None and [m.seq for m in own.accept(msg)] == [2]
    again = relayed_message(part, own)
    assert again is not None and own.accept(again) == [] and own.duplicates == 1  # handled once

    # h1 registers again (the same credential): its new link's key differs, the old part is refused
    credential = "the-credential-of-h1"
    old_link, new_link = 11, 12
    later = Inbox()
    later.link, later.key = new_link, relaysig.link_key(credential, new_link)
    signed_before = _copy(part)
    signed_before.link = old_link
    old_key = relaysig.link_key(credential, old_link)
    if gang:
        g = signed_before.gang
        numbers = relaysig.gang_numbers(g.seq, list(g.task_segments), list(g.task_seqs), list(g.segment_ids))
        signed_before.mac = relaysig.sign_gang(relaysig.keyed(old_key), relaysig.body_digest(g.body), numbers)
    else:
        signed_before.mac = relaysig.sign_message(relaysig.keyed(old_key), signed_before.message)
    signed_before.link = new_link
    assert relayed_message(signed_before, later) is None and later.rejected == 1
    signed_before.link = old_link
    earlier = Inbox()
    earlier.link, earlier.key = old_link, old_key
    assert relayed_message(signed_before, earlier) is not None  # it was genuine for its registration


@pytest.mark.timeout(30)
def test_keys_are_per_host_and_per_registration() -> None:
    a = relaysig.link_key("credential-a", 5)
    assert len(a) == relaysig.KEY_BYTES and a == relaysig.link_key("credential-a", 5)
    assert a != relaysig.link_key("credential-a", 6) and a != relaysig.link_key("credential-b", 5)


@pytest.mark.timeout(30)
def test_the_controller_counts_a_member_s_rejections_logs_once_and_sends_it_directly(
        caplog: pytest.LogCaptureFixture) -> None:
    """A member's report of rejected messages: counted, one warning per interval (naming the
    member and its relay), the member's unacknowledged messages sent directly and its later ones
    too. The relay is demoted: what it carried for the others and nobody acknowledged goes
    again directly, and the group's next host relays from then on."""
    relays, hosts = _relay_setup(4)
    _flush(relays, ["h1", "h2", "h3"])
    _queued(hosts["h0"])
    hosts["h1"].link.ack(2)  # type: ignore[union-attr]  # h1 got its message through h0; h3 did not yet
    with caplog.at_level(logging.WARNING, logger="server.controller.relays"):
        relays.failed("h2", ["h2"], rejected=3)
        relays.failed("h2", ["h2"], rejected=2)  # within the interval: counted, not logged
    assert relays.rejected == 5
    lines = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(lines) == 1 and "host h2 rejected 3 relayed message(s)" in lines[0] and "relay: h0" in lines[0], lines
    demoted = [r.getMessage() for r in caplog.records if "demoted" in r.getMessage()]
    assert len(demoted) == 1 and "relay h0 demoted: host h2" in demoted[0], demoted
    assert [m.seq for m in _queued(hosts["h2"])] == [2]  # the one it rejected (or never got), directly
    assert [m.seq for m in _queued(hosts["h3"])] == [2]  # h0 carried it: sent again directly
    assert not _queued(hosts["h1"])  # acknowledged: not sent again
    _flush(relays, ["h0", "h1", "h2", "h3"])
    [batch] = _queued(hosts["h1"])  # h1 relays now (h2 gets direct sends only, h0 relays no more)
    assert [p.host for p in batch.relay.messages] == ["h0", "h1", "h3"]
    assert not _queued(hosts["h0"]) and not _queued(hosts["h3"])
    assert [m.seq for m in _queued(hosts["h2"])] == [3]


@pytest.mark.timeout(300)
@pytest.mark.cluster(islands=1, devices=1, heartbeat_timeout=15.0,
                     controller_args=(*RELAYS_FROM_2, "--metrics-listen", "127.0.0.1:0"))
def test_a_hostile_relay_cannot_forge_alter_or_replay_a_member_s_messages(cluster: LocalCluster,
                                                                           tmp_path: Path) -> None:
    """A program over three one-device slices on w-a, w-a2, w-a3 runs in a loop; r-0 joins island
    a and, first by name, relays each run's three Enqueues. It is hostile to w-a2: before each of
    w-a2's messages it sends a Drop of that message's runs under the message's numbers and
    signature, and after it a replay of the one before. w-a2 rejects the forgeries (without
    signatures it would take the Drop and discard the genuine Enqueue as a duplicate: its runs
    would never finish), reports them, and gets its messages directly from then on; r-0 is
    demoted (it relays for nobody), and w-a's and w-a3's messages keep coming relayed, through
    the group's next relay (w-a); every run gives the exact result, each task run once."""
    cluster.add_worker("a", 1, name="w-a2")
    cluster.add_worker("a", 1, name="w-a3")
    pipeline = Pipeline(cluster, tmp_path)
    runs, client = pipeline.runs, pipeline.client
    forged = tmp_path / "forged"
    try:
        cluster.add_worker("a", 1, name="r-0", program=(str(HOSTILE),),
                           env={"HOSTILE_RELAY_VICTIM": "w-a2", "HOSTILE_RELAY_COUNT": str(forged)})
        wait_for(lambda: forged.exists() and int(forged.read_text() or 0) >= 1, 60, "r-0 forging w-a2's messages")
        wait_for(lambda: "relay r-0 demoted: host w-a2" in cluster.controller_logs(), 30, "r-0 demoted")
        before = runs()
        wait_for(lambda: runs() >= before + 20 or client.poll() is not None, 90,
                 "runs after the forgeries (a forged Drop taken would stall them)")
        honest = {n: _stats(cluster, n).relayed_in for n in ("w-a", "w-a3")}
        r0_out = _stats(cluster, "r-0").relayed_out
        wait_for(lambda: all(_stats(cluster, n).relayed_in >= honest[n] + 10 for n in honest), 60,
                 "w-a's and w-a3's messages still relayed")
        assert _stats(cluster, "r-0").relayed_out == r0_out  # demoted: it relays for nobody
        assert _stats(cluster, "w-a").relayed_out > 0  # the group's next relay
        pipeline.finish(before + 20)
    finally:
        pipeline.close()
    victim = _stats(cluster, "w-a2")
    assert victim.relayed_rejected >= 1, victim
    for name in ("w-a", "w-a2", "w-a3"):
        _no_repeats(_stats(cluster, name))
    for name in ("w-a", "w-a3"):
        assert _stats(cluster, name).relayed_rejected == 0
    logs = cluster.controller_logs()
    assert "host w-a2 rejected" in logs and "relay: r-0" in logs, logs[-3000:]
    assert logs.count("relayed message(s) whose signature did not match") <= 2, logs[-3000:]  # rate-limited
    samples = scrape(metrics_url(cluster), cluster.token)
    assert value(samples, "pathways_relay_rejected_total") >= victim.relayed_rejected, samples
    assert value(samples, "pathways_relayed_messages_total") > 0


@pytest.mark.timeout(30)
def test_gang_members_with_several_tasks_are_signed_and_checked() -> None:
    """Members whose Enqueue holds two gang tasks (two templates): each takes its own, and one
    task's numbers changed are rejected (the several-task layout of `gang_numbers`)."""
    relays, hosts = _relay_setup(4)
    first, _ = _gang(sorted(hosts))
    second = wpb.Task()
    second.CopyFrom(first)
    second.run_id = 8
    msgs: dict[str, list[Message]] = {n: [GangEnqueue([(first, i, 10 + i, 100 + i), (second, i, 20 + i, 200 + i)])]
                                       for i, n in enumerate(sorted(hosts))}
    relays.send_all(msgs)
    [batch] = _queued(hosts["h0"])
    parts = _parts(batch)
    assert len(parts) == 4 and all(len(p.gang.task_segments) == 2 for p in parts)
    for i, p in enumerate(parts):
        inbox = _inbox(hosts[p.host])
        msg = relayed_message(p, inbox)
        assert msg is not None and [(t.run_id, t.segment_id) for t in msg.enqueue.tasks] == [(7, 100 + i), (8, 200 + i)]
        bad = _copy(p)
        bad.gang.segment_ids[1] += 1
        assert relayed_message(bad, inbox) is None and inbox.rejected == 1


# a psum over 4 hosts, each run on the last one's result (kept: no release joins the next run's
# Enqueue), one at a time: each run's member tasks leave as one relayed gang (RelayedGang)
CHAINED_PSUM = """
import json
import numpy as np
import pwctl as pw
import jax

s = pw.make_virtual_device_set().add_slice(devices=4, island="a")
step = pw.pmap(lambda x: jax.lax.psum(x, "i") * 0.25, devices=s.devices, axis_name="i")
x = np.arange(4 * 5, dtype=np.float32).reshape(4, 5) / 7.0
want = np.broadcast_to(x.mean(0), x.shape)
ys = [step(x)]
got = [np.asarray(ys[-1])]
for _ in range(7):
    ys.append(step(ys[-1]))
    got.append(np.asarray(ys[-1]))
print(json.dumps({"hosts": sorted({d.host for d in s.info.devices}),
                  "close": [bool(np.allclose(g, want, rtol=1e-5)) for g in got]}))
"""


@pytest.mark.timeout(300)
@pytest.mark.cluster(islands=1, devices=1, heartbeat_timeout=15.0, controller_args=RELAYS_FROM_2)
def test_a_hostile_relay_cannot_forge_a_gang_member_s_task(cluster: LocalCluster, tmp_path: Path) -> None:
    """A pmap with a psum over four one-device hosts, r-0 their relay (first by name) and a member,
    hostile to w-a2's gang parts only: it sends a Drop of the gang node's run under w-a2's numbers
    and signature before each. w-a2 rejects them (taken, its member of the psum would never run
    and the collective would hang), the results are NumPy's, and the others' gang parts are taken."""
    forged = tmp_path / "forged"
    cluster.add_worker("a", 1, name="w-a2")
    cluster.add_worker("a", 1, name="w-a3")
    cluster.add_worker("a", 1, name="r-0", program=(str(HOSTILE),),
                       env={"HOSTILE_RELAY_VICTIM": "w-a2", "HOSTILE_RELAY_COUNT": str(forged),
                            "HOSTILE_RELAY_GANGS_ONLY": "1"})
    names = ["r-0", "w-a", "w-a2", "w-a3"]

    def run() -> None:
        deadline = time.monotonic() + 150
        while True:  # the island's group forms first (a run before then is refused, saying so)
            out = subprocess.run([sys.executable, "-c", CHAINED_PSUM], env=cluster.env(), capture_output=True,
                                 text=True, timeout=200)
            if out.returncode == 0 or "forming" not in out.stderr or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["hosts"] == names and got["close"] == [True] * 8, got

    run()
    run()
    assert forged.exists() and int(forged.read_text() or 0) >= 1, "r-0 forged none of w-a2's gang parts"
    victim = _stats(cluster, "w-a2")
    assert victim.relayed_rejected >= 1, victim
    for name in names:
        st = _stats(cluster, name)
        _no_repeats(st)
        if name != "w-a2":
            assert st.relayed_rejected == 0 and st.relayed_in > 0, st
