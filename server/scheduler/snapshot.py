"""Read-only views of the scheduler for the status command (`pwctl status`, `island` views)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunView:
    run_id: int
    program: str
    client: str
    job: str | None
    priority: int
    weight: float
    sequential: bool
    nodes_total: int
    nodes_left: int
    submitted_at: float
    admitted_at: float | None  # None while waiting
    wait_reason: str  # "" once admitted


@dataclass(frozen=True, slots=True)
class ClientUsage:
    client: str
    used_s: float  # device-seconds charged on this island (after idle catch-up)
    weight: float
    active: bool


@dataclass(frozen=True, slots=True)
class IslandView:
    island: str
    policy: str
    inflight_nodes: int
    max_inflight_nodes: int
    running: tuple[RunView, ...]  # admitted runs with a node here, in admission order
    waiting: tuple[RunView, ...]  # waiting runs with a node here, in submit order
    clients: tuple[ClientUsage, ...]


@dataclass(frozen=True, slots=True)
class HostView:
    host: str
    up: bool
    next_seq: int
    queued_nodes: int  # admitted, unfinished nodes placed on it


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    now: float  # time of the last event handled
    islands: tuple[IslandView, ...]
    hosts: tuple[HostView, ...]
