"""The fault schedule of a chaos run, named by its seed (pure: no cluster, no clock).

Each phase of a run draws from its own `random.Random`, derived from (seed, phase name)
(`phase_rng`): the fuzz phase ("fuzz") draws as many numbers as its requests take, and the
faults ("faults") draw from a stream of their own, so a seed names the same kills and freezes
(which process, the pause before each, how long it stays down or frozen) whatever the fuzz phase
did. The run prints the schedule in its report (`describe`).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass
from typing import Any

from .freezes import plan

# the pause before each fault (calls flow, then the fault comes at a random moment) and how long a
# killed worker stays down before it is started again (calls meet the loss), in seconds
PAUSE_S = (0.3, 1.5)
DOWN_S = (0.0, 1.0)


def phase_rng(seed: int, phase: str) -> random.Random:
    """The random stream of one phase of the run of `seed` (the same in every process and Python
    run: not `hash`, which is salted per process)."""
    digest = hashlib.sha256(f"pathways-chaos/{seed}/{phase}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


@dataclass(frozen=True)
class Step:
    """One fault of the schedule, in order."""

    fault: str  # "kill" or "freeze"
    target: str  # "controller" or an island (its worker)
    pause_s: float  # calls flow this long after the previous fault recovered, then it comes
    seconds: float = 0.0  # a freeze's length
    during: str = ""  # killed and started again halfway through a freeze: "controller", an island or ""
    down_s: float = 0.0  # a worker's kill: how long it stays down before it starts again


def schedule(seed: int, islands: tuple[str, ...], kills: int, controller_kills: int, freezes: int = 0,
             controller_freezes: int = 0, heartbeat_timeout: float = 2.0) -> list[Step]:
    """The faults of the run of `seed`: `kills` kills (`controller_kills` of the controller, the
    others of random islands' workers) in a random order, with `freezes` freezes among them
    (freezes.py `plan`), each with its pause and, for a worker's kill, its time down."""
    rng = phase_rng(seed, "faults")
    targets = ["controller"] * controller_kills + [rng.choice(islands) for _ in range(max(0, kills - controller_kills))]
    rng.shuffle(targets)
    steps = []
    for fault, target, seconds, during in plan(rng, targets, islands, freezes, controller_freezes, heartbeat_timeout):
        pause = round(rng.uniform(*PAUSE_S), 3)
        down = round(rng.uniform(*DOWN_S), 3) if fault == "kill" and target != "controller" else 0.0
        steps.append(Step(fault, target, pause, seconds, during, down))
    return steps


def describe(steps: list[Step]) -> list[dict[str, Any]]:
    """The schedule as the report prints it."""
    return [asdict(s) for s in steps]
