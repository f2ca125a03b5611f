"""Who a session's caller is, and how many sessions each caller holds (issue 29).

Every holder of the cluster token may open sessions, and each open session costs the controller
memory (its queue, its state): the controller-wide `--max-sessions` bounds them all, and
`--max-sessions-per-caller` keeps one caller from taking every place. A caller is

- a job, for a session that proved it is the job's driver (its Hello carries the job's secret):
  `job:<id>`, so drivers never compete with the other clients of their machine;
- otherwise the network address the session comes from, without its port (`127.0.0.1`, `::1`,
  `10.0.0.5`): every process of one machine is one caller, whatever connections it opens.

One session over the cap is refused RESOURCE_EXHAUSTED with one line naming the limit.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from .errors import Rejected


def caller_of(peer: str, job_id: str = "") -> str:
    """The caller a session counts against: `job:<id>` for a (verified) job's driver, else the
    host part of gRPC's peer string (`ipv4:127.0.0.1:5432` -> `127.0.0.1`, `ipv6:[::1]:5432` ->
    `::1`, `unix:/path` as it is)."""
    if job_id:
        return f"job:{job_id}"
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        host = rest.rpartition(":")[0] or rest
        return host.strip("[]")
    return peer


class CallerSessions:
    """Open sessions per caller, at most `most` each."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.open: Counter[str] = Counter()

    @contextlib.contextmanager
    def enter(self, caller: str) -> Iterator[None]:
        """Holds one of `caller`'s places for the block; raises Rejected when it has none left."""
        if self.open[caller] >= self.most:
            raise Rejected(f"{caller} has {self.open[caller]} client sessions open, the limit per caller "
                           "(the controller's --max-sessions-per-caller): close some and retry")
        self.open[caller] += 1
        try:
            yield
        finally:
            self.open[caller] -= 1
            if self.open[caller] <= 0:
                del self.open[caller]
