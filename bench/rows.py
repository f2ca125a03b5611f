"""What every benchmark yields: result rows (`row`), their paired ratio, and the context a suite
runs in (`Ctx`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench import defs
from bench.cluster import BenchCluster

Row = dict[str, Any]


@dataclass
class Ctx:
    cluster: BenchCluster
    quick: bool
    gpu: bool = False  # island a is one worker's GPUs (`python -m bench --gpu`), not 4 CPU devices
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def budget(self) -> float:
        """Seconds one throughput measurement aims at."""
        return 0.4 if self.quick else 1.0

    def env(self, **extra: str) -> dict[str, str]:
        return self.cluster.env(**extra)


def row(bench: str, variant: str, metric: str, unit: str, pathways: float | None, jax: float | None = None,
        target: str = "", meets: bool | None = None, notes: str = "", ratio: float | None = None,
        paired: float | None = None) -> Row:
    """One result. `ratio` is pathways / jax (each usually the median of its windows); `paired`,
    where the two sides took turns window by window, is the median of the per-window ratios (each
    Pathways window over the JAX window just before it): this machine's speed drifts by tens of
    percent over seconds, and a pair shares most of that drift, so it is the steadier figure of the
    two. Targets are judged on `ratio`."""
    if ratio is None and pathways is not None and jax:
        ratio = pathways / jax
    return {"bench": bench, "variant": variant, "metric": metric, "unit": unit, "pathways": pathways, "jax": jax,
            "ratio": ratio, "paired": paired, "target": target, "meets": meets, "notes": notes}


def paired_ratio(pw_windows: list[float], jax_windows: list[float]) -> float | None:
    """The median over window pairs of Pathways / JAX (see `row`); None without a complete pair."""
    ratios = [p / j for p, j in zip(pw_windows, jax_windows, strict=False) if j > 0]
    return defs.median(ratios) if ratios else None


def at_least(value: float | None, bound: float) -> bool | None:
    return None if value is None else bool(value >= bound)
