"""A/B of `pwctl`'s per-call latency between source trees (`git archive`s, or a checkout): each
round runs every command once per tree, the trees' order flipping every round, as a fresh
`python -m pwctl ...` with the tree as its working directory (so its packages are the ones
imported). Prints each (command, tree)'s median wall and CPU (user + sys of the child) in ms over
the rounds, and the median of the per-round ratios of the last tree to the first.

The commands run against whatever `$PWCTL_SERVER` / `$PATHWAYS_HOME` name (a cluster started
with `pwctl up`, its own data directory and port); each tree's bytecode is compiled first, as
an installed package's is.

    python -m bench.cli_ab /tmp/base . --rounds 12 -c '--help' -c 'slice list' -c 'slice list -s 127.0.0.1:1'
"""

from __future__ import annotations

import argparse
import compileall
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one(tree: Path, argv: list[str]) -> tuple[float, float, int]:
    """Wall ms, CPU ms and exit code of one `python -m pwctl ARGV` run in `tree`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pwctl", *argv], cwd=tree,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = (time.perf_counter() - t0) * 1000
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, (usage.ru_utime + usage.ru_stime) * 1000, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="+", type=Path)
    ap.add_argument("-c", "--command", action="append", required=True, help="pwctl arguments, one command")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    trees = [t.resolve() for t in args.trees]
    for t in trees:
        if not (t / "pwctl" / "__main__.py").is_file():
            sys.exit(f"error: {t} holds no pwctl/ package")
        for pkg in ("pwctl", "schemas", "server"):
            compileall.compile_dir(t / pkg, quiet=2)
    cmds = [shlex.split(c) for c in args.command]
    runs: dict[tuple[int, int], list[tuple[float, float, int]]] = {}
    for r in range(args.rounds):
        order = list(range(len(trees)))
        if r % 2:
            order.reverse()
        for ci, argv in enumerate(cmds):
            for ti in order:
                runs.setdefault((ci, ti), []).append(one(trees[ti], argv))
    print(f"{args.rounds} rounds, load1 {os.getloadavg()[0]:.2f} at the end; wall / CPU ms, medians")
    for ci, c in enumerate(args.command):
        cells = []
        for ti, t in enumerate(trees):
            rs = runs[(ci, ti)]
            codes = sorted({x[2] for x in rs})
            cells.append(f"{t.name}: {statistics.median(x[0] for x in rs):.0f} / "
                         f"{statistics.median(x[1] for x in rs):.0f} (exit {','.join(map(str, codes))})")
        a, b = runs[(ci, 0)], runs[(ci, len(trees) - 1)]
        ratio = statistics.median(y[0] / x[0] for x, y in zip(a, b, strict=True))
        print(f"pwctl {c}: " + "; ".join(cells) + f"; wall last/first {ratio:.2f}")


if __name__ == "__main__":
    main()
