"""Admission order of the waiting runs of one island, and the wait reasons shown to users.

Candidates are the heads of the clients' queues (a client's runs are never reordered among
themselves), so every function here orders at most one run per client.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from server.scheduler.events import Policy
from server.scheduler.records import RunRecord, Share


def _vtime(shares: Mapping[str, Share], client: str) -> float:
    share = shares.get(client)
    return share.vtime if share is not None else 0.0


def order_candidates(
    policy: Policy, candidates: Sequence[RunRecord], shares: Mapping[str, Share]
) -> list[RunRecord]:
    """Best candidate first. fifo: submit order; priority: highest first, then submit order;
    fair: smallest used/weight first (stride / WFQ), then submit order."""
    if policy is Policy.PRIORITY:
        return sorted(candidates, key=lambda r: (-r.spec.priority, r.order))
    if policy is Policy.FAIR:
        return sorted(candidates, key=lambda r: (_vtime(shares, r.client), r.order))
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
    others = [shares[c].vtime for c in active if c != client and c in shares]
    level = min(others) * share.weight if others else 0.0
    if share.period != period:
        share.used = level
        share.node_time, share.done_nodes = 0.0, 0  # its in-flight estimate starts afresh too
    else:
        share.used = max(share.used, level)
    share.period = period
