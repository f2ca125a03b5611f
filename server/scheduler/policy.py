"""Admission order of the waiting runs of one island, and the wait reasons shown to users.

Candidates are the heads of the clients' queues (a client's runs are never reordered among
themselves), so every function here orders at most one run per client.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from server.scheduler.events import Policy
from server.scheduler.records import RunRecord, Share


def typical_node_time(shares: Mapping[str, Share]) -> float:
    """The in-flight estimate for a client none of whose nodes has finished in the island's busy
    period: the mean node time of the clients whose nodes have (0 when none has). Estimated at
    0, a client that joined a busy island was picked for every free slot until its first node
    was billed, a whole window of runs in a row: at weight 1 among 1:2:4:8, 16 runs put it
    ~120 ms of device time ahead, and it then waited ~2 s for the others to catch up."""
    if not shares:
        return 0.0
    period = max(s.period for s in shares.values())
    known = [s.node_time for s in shares.values() if s.period == period and s.done_nodes]
    return sum(known) / len(known) if known else 0.0


def _vtime(shares: Mapping[str, Share], client: str, unknown_node_time: float) -> float:
    share = shares.get(client)
    return share.vtime(unknown_node_time) if share is not None else 0.0


def order_candidates(
    policy: Policy, candidates: Sequence[RunRecord], shares: Mapping[str, Share]
) -> list[RunRecord]:
    """Best candidate first. fifo: submit order; priority: highest first, then submit order;
    fair: smallest used/weight first (stride / WFQ), then submit order."""
    if policy is Policy.PRIORITY:
        return sorted(candidates, key=lambda r: (-r.spec.priority, r.order))
    if policy is Policy.FAIR:
        unknown = typical_node_time(shares)
        return sorted(candidates, key=lambda r: (_vtime(shares, r.client, unknown), r.order))
    return sorted(candidates, key=lambda r: r.order)


def whose(run: RunRecord) -> str:
    """A run as an operator knows it: its program and its job (or client). Not its run id, a
    64-bit number no command takes, which only made the reasons (and the tables showing them) wide."""
    return f"{run.spec.program} ({run.spec.job or 'client ' + run.spec.client})"


def reason_behind(policy: Policy, run: RunRecord, first: RunRecord, shares: Mapping[str, Share]) -> str:
    """Why `run` waits while `first` (the island's best candidate, itself blocked) goes before it."""
    if policy is Policy.PRIORITY and first.spec.priority > run.spec.priority:
        return f"behind a higher-priority run of {whose(first)}"
    if policy is Policy.FAIR:
        share = shares.get(run.client, Share())
        return f"fair share: client {run.client} used {share.used:.1f} s at weight {share.weight:g}"
    return f"behind an earlier run of {whose(first)}"


def catch_up(shares: dict[str, Share], client: str, weight: float, active: set[str], period: int) -> None:
    """`client` becomes active with `weight` in the island's busy `period` (a stretch during which some
    client always had live runs there): it must not bank credit from being idle, so its virtual time is
    raised to the smallest virtual time among the other active clients. Debt from an earlier busy
    period is forgotten: then it starts level with them (or from zero on an idle island), so that a
    client charged for its warm-up long ago is not starved while the others pay the same again."""
    share = shares.setdefault(client, Share())
    share.weight = weight
    unknown = typical_node_time(shares)
    others = [shares[c].vtime(unknown) for c in active if c != client and c in shares]
    level = min(others) * share.weight if others else 0.0
    if share.period != period:
        share.used = level
        share.node_time, share.done_nodes = 0.0, 0  # its in-flight estimate starts afresh too
    else:
        share.used = max(share.used, level)
    share.period = period
