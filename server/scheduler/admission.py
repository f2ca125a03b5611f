"""Admission and ordering: which waiting run gets its seqs next (rules in `state`'s docstring)."""

from __future__ import annotations

from server.scheduler.book import SchedulerBook
from server.scheduler.events import DispatchedNode
from server.scheduler.policy import order_candidates, reason_behind
from server.scheduler.records import InvalidTransition, NodeState, RunRecord, RunState


class Admission(SchedulerBook):
    """The admission pass: the best candidate of each island is admitted or blocks the others."""

    def _admit(self) -> None:
        """Admit waiting runs while the best candidate of some island fits (see module docstring)."""
        while True:
            by_island: dict[str, list[RunRecord]] = {}
            for queue in self._queues.values():
                if queue:
                    head = self._runs[queue[0]]
                    by_island.setdefault(head.policy_island, []).append(head)
            reserved: dict[str, int] = {}
            admitted = False
            for island in sorted(by_island):
                policy = self._policy(island)
                shares = self._shares.get(island, {})
                ordered = order_candidates(policy, by_island[island], shares)
                first = ordered[0]
                blocked = self._blocked(first, reserved)
                if blocked is None:
                    self._admit_run(first)
                    admitted = True
                    break
                first.wait_reason = blocked
                for touched in first.islands:
                    reserved.setdefault(touched, first.run_id)
                for other in ordered[1:]:
                    other.wait_reason = reason_behind(policy, other, first, shares)
            if not admitted:
                return

    def _blocked(self, run: RunRecord, reserved: dict[str, int]) -> str | None:
        for island, count in run.nodes_per_island.items():
            inflight = self._inflight.get(island, 0)
            if inflight > 0 and inflight + count > self.max_inflight_nodes:
                return f"window full: {inflight} nodes in flight on island {island}"
        for island in run.islands:
            if island in reserved:
                return f"island {island} reserved for run {reserved[island]}"
        return None

    def _admit_run(self, run: RunRecord) -> None:
        queue = self._queues[run.client]
        if queue[0] != run.run_id:
            raise self._broken(f"run {run.run_id} admitted ahead of run {queue[0]} of its client")
        queue.popleft()
        run.to(RunState.ADMITTED)
        self._admit_counter += 1
        run.admit_order = self._admit_counter
        run.admitted_at = self._now
        run.wait_reason = ""
        # The atomic step: every node's seq on its host, in topological (index) order; in parallel
        # mode every node is dispatched with it (sequential: those with no deps), in index order.
        # (Per node only what is the node's own: a gang run has a node per member host, hundreds
        # of them; the node goes WAITING -> ASSIGNED -> DISPATCHED in one step.)
        hosts, run_id, now, outbox = self._hosts, run.run_id, self._now, self._outbox
        sequential = run.spec.sequential
        waiting, assigned, dispatched = NodeState.WAITING, NodeState.ASSIGNED, NodeState.DISPATCHED
        new = tuple.__new__
        for node in run.nodes:
            spec = node.spec
            name, index = spec.host, spec.index
            host = hosts[name]
            node.seq = seq = host.next_seq
            host.next_seq = seq + 1
            host.live[seq] = (run_id, index)
            if node.state is not waiting:
                raise InvalidTransition(f"node {index}: {node.state} -> {assigned}")
            if node.deps_left == 0:
                node.ready_at = now
            elif sequential:
                node.state = assigned
                continue
            node.state = dispatched
            node.dispatched_at = now
            d = new(DispatchedNode, (run_id, index, seq))  # DispatchedNode(...) without its frame
            q = outbox.get(name)
            if q is None:
                outbox[name] = [d]
            else:
                q.append(d)
        for island, count in run.nodes_per_island.items():
            self._inflight[island] = self._inflight.get(island, 0) + count
            self._share(island, run.client).inflight_nodes += count
