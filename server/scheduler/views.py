"""The scheduler's queries (snapshot, policy, liveness) and its invariants (`validate`)."""

from __future__ import annotations

from server.scheduler.admission import Admission
from server.scheduler.events import Policy
from server.scheduler.records import UNFINISHED, NodeState, RunRecord, RunState
from server.scheduler.snapshot import ClientUsage, HostView, IslandView, RunView, SchedulerSnapshot


class Views(Admission):
    """Read-only views of the scheduler's state, and the check that it is consistent."""

    def policy(self, island: str) -> Policy:
        return self._policy(island)

    def is_live(self, run_id: int) -> bool:
        """Whether the run is waiting or admitted (not finished, not unknown)."""
        return run_id in self._runs

    def snapshot(self) -> SchedulerSnapshot:
        islands: set[str] = set(self._policies) | set(self._shares)
        islands |= {i for i, n in self._inflight.items() if n}
        for run in self._runs.values():
            islands.update(run.islands)
        views: list[IslandView] = []
        for island in sorted(islands):
            touching = [r for r in self._runs.values() if island in r.nodes_per_island]
            running = sorted(
                (r for r in touching if r.state is RunState.ADMITTED), key=lambda r: r.admit_order
            )
            waiting = [r for r in touching if r.state is RunState.WAITING]
            active = {c for (i, c) in self._active if i == island}
            clients = tuple(
                ClientUsage(c, s.used, s.weight, c in active)
                for c, s in sorted(self._shares.get(island, {}).items())
            )
            views.append(
                IslandView(
                    island=island,
                    policy=str(self._policy(island)),
                    inflight_nodes=self._inflight.get(island, 0),
                    max_inflight_nodes=self.max_inflight_nodes,
                    running=tuple(self._view(r) for r in running),
                    waiting=tuple(self._view(r) for r in waiting),
                    clients=clients,
                )
            )
        hosts = tuple(
            HostView(h.name, h.up, h.next_seq, len(h.live))
            for h in sorted(self._hosts.values(), key=lambda h: h.name)
        )
        return SchedulerSnapshot(self._now, tuple(views), hosts)

    def _view(self, run: RunRecord) -> RunView:
        reason = ""
        if run.state is RunState.WAITING:
            head = self._queues[run.client][0]
            reason = "behind an earlier run of the same client" if head != run.run_id else run.wait_reason
        spec = run.spec
        return RunView(
            run_id=spec.run_id,
            program=spec.program,
            client=spec.client,
            job=spec.job,
            priority=spec.priority,
            weight=spec.weight,
            sequential=spec.sequential,
            nodes_total=len(run.nodes),
            nodes_left=run.nodes_left,
            submitted_at=run.submitted_at,
            admitted_at=run.admitted_at,
            wait_reason=reason,
        )

    # ---------------------------------------------------------------------------------- invariants

    def validate(self) -> None:
        """Check every invariant; raise `InvariantError` on the first violation."""

        def check(ok: bool, message: str) -> None:
            if not ok:
                raise self._broken(message)

        check(not self._outbox and not self._actions, "outbox not flushed")
        check(not any(rid in self._finished for rid in self._runs), "a run is both live and finished")
        # Runs may number thousands (a client's burst waits here): waiting runs are checked in one
        # pass over the queues, and messages are formatted only on failure, so that validating
        # after every stimulus stays cheap enough for real traffic.
        queued = 0
        for client, queue in self._queues.items():
            last = 0
            for rid in queue:
                run = self._runs.get(rid)
                if run is None or run.state is not RunState.WAITING or run.spec.client != client:
                    raise self._broken(f"run {rid} queued under client {client} is not a waiting run of it")
                if run.order <= last:
                    raise self._broken(f"client {client}'s waiting runs are out of submit order")
                last = run.order
                if any(n.seq or n.state is not NodeState.WAITING for n in run.nodes):
                    raise self._broken(f"waiting run {rid} has assigned nodes")
                queued += 1
        inflight: dict[str, int] = {}
        live: dict[str, dict[int, tuple[int, int]]] = {}
        active: dict[tuple[str, str], int] = {}
        seq_owner: dict[str, list[tuple[int, int]]] = {}  # host -> (seq, admit order)
        share_inflight: dict[tuple[str, str], int] = {}
        waiting = 0
        for run in self._runs.values():
            key = (run.policy_island, run.spec.client)
            active[key] = active.get(key, 0) + 1
            if run.state is RunState.WAITING:
                waiting += 1
                continue
            if run.state is not RunState.ADMITTED:
                raise self._broken(f"run {run.run_id} is {run.state}")
            left = 0
            per_host: dict[str, list[int]] = {}
            for node in run.nodes:
                spec = node.spec
                if node.seq <= 0:
                    raise self._broken(f"admitted node {run.run_id}/{spec.index} has no seq")
                if node.state is NodeState.WAITING or node.state is NodeState.DROPPED:
                    raise self._broken(f"admitted node {run.run_id}/{spec.index} is {node.state}")
                deps_left = len({d for d in spec.deps if run.nodes[d].state is not NodeState.DONE})
                if node.deps_left != deps_left:
                    raise self._broken(f"node {run.run_id}/{spec.index} deps_left is wrong")
                if node.state is NodeState.ASSIGNED and not (run.spec.sequential and deps_left > 0):
                    raise self._broken(f"node {run.run_id}/{spec.index} not sent")
                per_host.setdefault(spec.host, []).append(node.seq)
                seq_owner.setdefault(spec.host, []).append((node.seq, run.admit_order))
                if node.state in UNFINISHED:
                    left += 1
                    inflight[spec.island] = inflight.get(spec.island, 0) + 1
                    key = (spec.island, run.client)
                    share_inflight[key] = share_inflight.get(key, 0) + 1
                    live.setdefault(spec.host, {})[node.seq] = (run.run_id, spec.index)
            check(run.nodes_left == left, f"run {run.run_id} nodes_left {run.nodes_left} != {left}")
            for host_name, seqs in per_host.items():
                first = seqs[0]
                check(
                    seqs == list(range(first, first + len(seqs))),
                    f"run {run.run_id} seqs on {host_name}: {seqs}",
                )
        check(waiting == queued, f"{waiting} runs wait but {queued} are queued (one twice, or one not at all)")
        check(active == self._active, "active-client counts are wrong")
        for island, shares in self._shares.items():
            for client, share in shares.items():
                want = share_inflight.get((island, client), 0)
                check(share.inflight_nodes == want, f"client {client} in-flight count on island {island}")
        for island in set(inflight) | set(self._inflight):
            have, want = self._inflight.get(island, 0), inflight.get(island, 0)
            check(have == want, f"window accounting on island {island}: {have} != {want}")
        for name, host in self._hosts.items():
            check(host.live == live.get(name, {}), f"host {name}'s queue disagrees with its runs")
            keys = list(host.live)
            check(keys == sorted(keys), f"host {name}'s queue is out of seq order")
            owners = sorted(seq_owner.get(name, []))
            check(len({s for s, _ in owners}) == len(owners), f"duplicate seq on host {name}")
            check(all(s < host.next_seq for s, _ in owners), f"seq beyond counter on host {name}")
            admit = [a for _, a in owners]
            check(admit == sorted(admit), f"host {name}'s seqs disagree with the admission order")
        for name in live:
            check(name in self._hosts, f"unknown host {name}")
