"""`python -m bench [--only NAME ...] [--quick] [--gpu] [--out bench/results]`: starts a local
cluster (controller + workers on islands a and b, 4 virtual CPU devices each), runs the benchmarks,
writes one JSON line per result to `<out>/<UTC timestamp>.jsonl` and `<out>/latest.jsonl`, a
markdown table to `<out>/latest.md`, and prints a table.

With `--gpu` (a machine with NVIDIA GPUs) island a is one worker owning the GPUs and the
benchmarks are those that fit one GPU (dispatch of x+1, the transformer step), each against plain
JAX on the same GPU; files are named `gpu-*`. The worker and the plain-JAX process share the GPU,
so each may take XLA_PYTHON_CLIENT_MEM_FRACTION (default here 0.4) of its memory.

`--only scale` (never part of the default run) starts no such cluster: it measures the control plane
against thousands of simulated hosts (bench/scale.py); alone it writes `scale-latest.*`.
`--only proxy` alone (it is part of the default run too) writes `proxy-latest.*`: unmodified JAX
programs through the IFRT proxy against plain JAX (bench/proxy.py).
`--only multihost` (likewise opt-in; root) makes separate hosts as network namespaces and measures
islands on them (bench/multihost.py); alone it writes `multihost-latest.*`."""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if v != v:
            return "nan"
        a = abs(v)
        if unit == "abs" or (a and a < 0.01):
            return f"{v:.2e}"
        if a >= 1000:
            return f"{v:,.0f}"
        return f"{v:.3g}" if a < 100 else f"{v:.0f}"
    return str(v)


COLUMNS = ["bench", "variant", "metric", "pathways", "jax", "ratio", "paired", "target", "meets"]


def table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in results:
        unit = r.get("unit", "")
        cells = [
            r.get("bench", ""), r.get("variant", ""),
            f"{r.get('metric', '')} ({unit})" if unit else r.get("metric", ""),
            fmt(r.get("pathways"), unit), fmt(r.get("jax"), unit),
            (f"{r['ratio']:.2f}x" if isinstance(r.get("ratio"), float) else ""),
            (f"{r['paired']:.2f}x" if isinstance(r.get("paired"), float) else ""),
            r.get("target", ""),
            "ERROR" if "error" in r else fmt(r.get("meets")),
        ]
        out.append([str(c) for c in cells])
    return out


def write_markdown(path: Path, results: list[dict[str, Any]], info: dict[str, Any], wall_s: float,
                   quick: bool) -> None:
    gpu = f"{', '.join(info['gpus'])}; " if info.get("gpus") else ""
    lines = [
        f"Machine: {gpu}{info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB RAM; Python {info['python']}, "
        f"jax {info['jax']}; {info['date']}; {'quick' if quick else 'full'} run, {wall_s / 60:.1f} min.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for cells in table_rows(results):
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    errors = [r for r in results if "error" in r]
    if errors:
        lines += ["", "Errors:", ""]
        lines += [f"- {r['bench']} {r.get('variant', '')}: {str(r['error']).splitlines()[0][:300]}" for r in errors]
    path.write_text("\n".join(lines) + "\n")


def print_table(results: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Pathways vs plain JAX (same run, same devices)")
    for c in COLUMNS:
        t.add_column(c, justify="right" if c in ("pathways", "jax", "ratio", "paired") else "left")
    for cells, r in zip(table_rows(results), results, strict=True):
        style = "red" if ("error" in r or r.get("meets") is False) else None
        t.add_row(*cells, style=style)
    Console(width=200).print(t)


def main(argv: list[str] | None = None) -> int:
    from bench import suites
    from bench.machine import gpus, machine
    from bench.multihost import bench_multihost

    standalone_benches = {**suites.STANDALONE, "multihost": bench_multihost}

    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--only", nargs="+", choices=[*suites.BENCHES, *standalone_benches],
                   help="run only these benchmarks (scale and multihost run only when named here)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (< 3 minutes)")
    p.add_argument("--gpu", action="store_true", help="on this machine's GPUs (dispatch, transformer)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ns = p.parse_args(argv)
    benches = suites.GPU_BENCHES if ns.gpu else suites.BENCHES
    names = ns.only or list(benches)
    if ns.gpu and not gpus():
        p.error("--gpu needs an NVIDIA GPU, and nvidia-smi lists none")
    if unknown := [n for n in names if n not in benches and (ns.gpu or n not in standalone_benches)]:
        p.error(f"not a --gpu benchmark: {', '.join(unknown)} (those are: {', '.join(benches)})")
    out_dir = Path(ns.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    on_cluster = [n for n in names if n in benches]
    standalone = [n for n in names if n not in benches]
    # `latest.*` is the last run of every on-cluster suite (the README's table); a run of some
    # suites (`--only`) keeps its own files, named for them (`proxy-latest.md`, `multihost-...`)
    if ns.gpu:
        prefix = "gpu-"
    elif set(on_cluster) == set(benches) and not standalone:
        prefix = ""
    else:
        prefix = "-".join(names) + "-"
    stamp = prefix + dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    info = machine()
    t_start = time.perf_counter()

    from bench.cluster import BenchCluster

    if ns.gpu:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")
    results: list[dict[str, Any]] = []
    run_file = out_dir / f"{stamp}.jsonl"

    def run(fh: Any, name: str, rows: Callable[[], Iterator[dict[str, Any]]]) -> None:
        t0 = time.perf_counter()
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        try:
            for r in rows():
                results.append(r)
                fh.write(json.dumps(r) + "\n")
                fh.flush()
        except Exception as e:
            traceback.print_exc()
            r = {"bench": name, "variant": "", "metric": "", "unit": "", "pathways": None, "jax": None,
                 "ratio": None, "target": "", "meets": None, "notes": "",
                 "error": f"{type(e).__name__}: {e}"}
            results.append(r)
            fh.write(json.dumps(r) + "\n")
            fh.flush()
        print(f"[bench] {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    with open(run_file, "w") as fh:
        if on_cluster:
            with BenchCluster(islands=("a",), devices="all") if ns.gpu else BenchCluster() as cluster:
                cluster.start()
                # this process is a pw client of its own cluster (1 CPU device of its own)
                for k in ("PWCTL_DISPATCH", "PWCTL_WEIGHT", "PWCTL_PRIORITY", "PWCTL_TOKEN"):
                    os.environ.pop(k, None)
                os.environ["PWCTL_SERVER"] = cluster.address
                os.environ["PATHWAYS_HOME"] = str(cluster.home)
                ctx = suites.Ctx(cluster=cluster, quick=ns.quick, gpu=ns.gpu)
                ctx.notes["pss_idle_gib"] = suites.idle_pss_gib(cluster)
                for name in on_cluster:
                    run(fh, name, functools.partial(benches[name], ctx))
                try:
                    from pwctl.api.runtime import Runtime

                    if Runtime._instance is not None:
                        Runtime._instance.close()
                except Exception:
                    pass
        for name in standalone:
            run(fh, name, functools.partial(standalone_benches[name], ns.quick, dict(os.environ)))
        fh.write(json.dumps({"machine": info, "quick": ns.quick, "wall_s": time.perf_counter() - t_start}) + "\n")
    wall = time.perf_counter() - t_start
    (out_dir / f"{prefix}latest.jsonl").write_text(run_file.read_text())
    write_markdown(out_dir / f"{prefix}latest.md", results, info, wall, ns.quick)
    print_table(results)
    print(f"wrote {run_file}, {out_dir / f'{prefix}latest.md'} ({wall / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
