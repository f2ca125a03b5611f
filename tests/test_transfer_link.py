"""A worker's first transfers to a peer, several at once, all go by one TCP link.

The sender's pool threads (server/worker/transfer.py) open a peer's TCP link on first use. Two of
them used to open it at once: each asked the peer for its port and connected, and the second
closed the first's connection under the send on it (EBADF), so the transfers to that peer went by
the gRPC stream for the next 30 s (a pipeline's first micro-batches do exactly this; found in the
issue-27 pipeline's profile, bench/FINDINGS.md, 2026-11-27 14:41).

A peer on another host gets a sending thread of its own (a lane, transfer.py), which sends
one array at a time; the pool's threads send to the peers past MAX_LANES, and this test runs them
(PATHWAYS_SEND_LANES=0). The second test sends the same burst through a lane.

Real processes: a controller and two workers whose transfers use the TCP link
(PATHWAYS_TRANSFER=tcp, as between hosts); a `pw` program in its own process."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import LocalCluster

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.cluster(islands=2, devices=1,
                                  worker_env={"PATHWAYS_TRANSFER": "tcp", "PATHWAYS_SEND_LANES": "0"})]

OUTPUTS = 3
TILE = 1 << 21  # (1, 4) -> 32 MiB: a send of many writes, under way when a second link would close it

PROGRAM = f"""\
import json
import jax.numpy as jnp
import numpy as np
import pwctl as pw

vds = pw.make_virtual_device_set()
a, b = vds.add_slice(devices=1, island="a"), vds.add_slice(devices=1, island="b")
# {OUTPUTS} outputs of 32 MiB on a, each sent to b as soon as the node is done: {OUTPUTS} sends at once
make = pw.pmap(lambda v: tuple(jnp.tile(v + k, {TILE}) for k in range({OUTPUTS})), devices=a.devices)
use = pw.pmap(lambda *vs: sum(v.sum(axis=-1, keepdims=True) for v in vs), devices=b.devices)


@pw.program
def across(x):
    return use(*make(x))


x = np.ones((1, 4), np.float32)
print(json.dumps({{"got": np.asarray(across(x)).tolist()}}), flush=True)
"""


def test_a_first_burst_of_transfers_to_a_peer_opens_one_tcp_link(cluster: LocalCluster) -> None:
    _burst_goes_by_one_tcp_link(cluster)


@pytest.mark.cluster(islands=2, devices=1, worker_env={"PATHWAYS_TRANSFER": "tcp"})
def test_a_burst_through_the_peers_lane_goes_by_its_tcp_link(cluster: LocalCluster) -> None:
    _burst_goes_by_one_tcp_link(cluster)


def _burst_goes_by_one_tcp_link(cluster: LocalCluster) -> None:
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=cluster.env(), capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    want = sum(1 + k for k in range(OUTPUTS)) * 4 * TILE  # output k: 4 * TILE elements of 1 + k
    assert json.loads(out.stdout.splitlines()[-1]) == {"got": [[float(want)]]}
    sender = cluster.workers["w-a"].log.read_text(errors="replace")
    ways = re.findall(r"first transfer to \S+ by ([^\n]+?)\s*$", sender, re.M)
    assert ways == ["TCP link"], f"w-a's transfers to w-b went by {ways}:\n{sender[-3000:]}"
    assert "broke" not in sender, sender[-3000:]
