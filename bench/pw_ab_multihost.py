"""A/B of the issue-27 blocking psum (bench/multihost.py `psum`, the `pw` side), or with `--mode
pipeline` of its 4-stage one-hop pipeline (`pipeline`, the `pw` side), between two source trees
(two commits' `git archive`s), both up at once on the same three hosts (network namespaces,
bench/netns.py; needs root): per tree a controller and the client on host 0 and, for psum, a
worker `--island pod --devices 2` on each of hosts A and B; for the pipeline, a worker `--island
a --devices 4` on host A and `--island b --devices 4` on host B. Every process is started from its
tree (its cwd and PYTHONPATH) with its own PATHWAYS_HOME; the pipeline's client is this
repository's bench/multihost_side.py `pipeline_pw` (the trees' own may lack it) running on the
tree's modules. Windows alternate between the two, the order flipping every pair; per window,
calls/s (micro-batches/s) and the CPU per call (micro-batch) of each process (from /proc).
Prints one JSON line per window and a summary (medians, per-pair ratio B / A).

    python -m bench.pw_ab_multihost /tmp/base /tmp/new --pairs 8 --calls 300
    python -m bench.pw_ab_multihost /tmp/base /tmp/new --mode pipeline --pairs 8 --calls 640
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import defs, netns
from bench.multihost import PSUM_DEVICES, Side, SideError
from bench.proxy_ab import cpu_seconds, processes

ENV = {"PATHWAYS_VALIDATE": "0"}
SIDE = Path(__file__).resolve().parent / "multihost_side.py"
STAGES = 4


class TreeSide(Side):
    """A bench.multihost_side process started by `Tree.popen` (not from this repository)."""

    def __init__(self, proc: subprocess.Popen[str], task: str) -> None:
        import queue
        import threading

        self.proc, self.task = proc, task
        self.lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()


class Tree:
    """One tree's cluster on the hosts, and its client (psum, or pipeline)."""

    def __init__(self, label: str, tree: Path, hosts: list[netns.Host], root: Path) -> None:
        self.label, self.tree, self.hosts = label, tree, hosts
        self.homes = [root / label / f"h{i}" for i in range(len(hosts))]
        for h in self.homes:
            h.mkdir(parents=True)
        self.address = self.token = ""
        self.client: TreeSide | None = None
        self.pids: dict[str, int] = {}

    def _argv(self, host: netns.Host, cmd: list[str]) -> list[str]:
        return ["nsenter", "-t", str(host.holder.pid), "-n", "-m", "-u", f"--wd={self.tree}", "--", *cmd]

    def _env(self, i: int, **extra: str) -> dict[str, str]:
        return self.hosts[i].env(PATHWAYS_HOME=str(self.homes[i]), PYTHONPATH=str(self.tree), **ENV, **extra)

    def pwctl(self, i: int, *args: str, **extra: str) -> str:
        r = subprocess.run(self._argv(self.hosts[i], [sys.executable, "-m", "pwctl.cli.main", *args]),
                           env=self._env(i, **extra), capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise SideError(f"{self.label}: pwctl {' '.join(args)}: {(r.stdout + r.stderr)[-1500:]}")
        return r.stdout

    def up(self, mode: str, calls: int) -> None:
        h0 = self.hosts[0]
        out = self.pwctl(0, "server", "start", "--listen", f"{h0.ip}:0")
        m = re.search(r"at (\S+:\d+)", out)
        if not m:
            raise SideError(f"{self.label}: server start: {out}")
        self.address = m.group(1)
        self.token = (self.homes[0] / "token").read_text().strip()
        for i in (1, 2):
            island, devices = ("pod", PSUM_DEVICES) if mode == "psum" else ("ab"[i - 1], defs.PIPE_DEVICES // 2)
            self.pwctl(i, "worker", "start", "--island", island, "--devices", str(devices), "--name", f"{island}{i}",
                       "--listen", f"{self.hosts[i].ip}:0", "--server", self.address, PWCTL_TOKEN=self.token)
        if mode == "psum":
            cmd = ["-m", "bench.multihost_side", "psum_pw",
                   json.dumps({"island": "pod", "devices": 2 * PSUM_DEVICES, "calls": calls})]
        else:  # -P: the tree's modules, not this file's directory's, come first
            cmd = ["-P", str(SIDE), "pipeline_pw", json.dumps({"stages": STAGES, "micro_batches": defs.MICRO_BATCHES,
                                                                "passes": calls // defs.MICRO_BATCHES})]
        proc = subprocess.Popen(self._argv(h0, [sys.executable, *cmd]),
                                env=self._env(0, PWCTL_SERVER=self.address, PWCTL_TOKEN=self.token),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                stdin=subprocess.PIPE)
        self.client = TreeSide(proc, f"{self.label} {mode}")
        ready = self.client.read(600)
        if "error" in ready:
            raise SideError(f"{self.label}: {ready['error']}")
        self._find_pids()

    def _find_pids(self) -> None:
        homes = {str(h): i for i, h in enumerate(self.homes)}
        for pid, env, cmd in processes():
            i = homes.get(env.get("PATHWAYS_HOME", ""))
            if i is None or "nsenter" in cmd:
                continue
            words = cmd.split()
            if "bench.multihost_side" in words or str(SIDE) in words:
                self.pids["client"] = pid
            elif "server.controller" in words:  # (not its island coordination service)
                self.pids["controller"] = pid
            elif "server.worker" in words and i:
                self.pids[f"worker{'AB'[i - 1]}"] = pid
        print(f"# {self.label} {self.tree}: {self.pids}", flush=True)

    def cpu(self) -> dict[str, float]:
        return cpu_seconds(self.pids)

    def window(self, calls: int) -> dict[str, Any]:
        assert self.client is not None
        before = self.cpu()
        out = self.client.ask("go", 300)
        after = self.cpu()
        out["cpu_us_per_call"] = {r: round((after[r] - before[r]) / calls * 1e6, 1) for r in before}
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--mode", choices=("psum", "pipeline"), default="psum")
    ap.add_argument("--calls", type=int, default=None,
                    help="calls per window (psum: 300); micro-batches per window for the pipeline, whole passes "
                    f"of {defs.MICRO_BATCHES} (640)")
    args = ap.parse_args()
    if args.calls is None:
        args.calls = 300 if args.mode == "psum" else 640
    if args.mode == "pipeline":
        args.calls = max(1, args.calls // defs.MICRO_BATCHES) * defs.MICRO_BATCHES
    why = netns.unavailable()
    if why:
        sys.exit(f"cannot make hosts here: {why}")
    tmp = Path(tempfile.mkdtemp(prefix="pw-ab-mh-"))
    made = netns.Hosts(tmp / "hosts")
    rates: dict[str, list[float]] = {"A": [], "B": []}
    cpu: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    loads: list[float] = []
    try:
        hosts = made.start(3)
        sides = [Tree("A", args.a.resolve(), hosts, tmp), Tree("B", args.b.resolve(), hosts, tmp)]
        for s in sides:
            s.up(args.mode, args.calls)
        for s in sides:  # one untimed window each
            s.window(args.calls)
        for i in range(args.pairs):
            for s in sides if i % 2 == 0 else sides[::-1]:
                out = s.window(args.calls)
                rates[s.label].append(float(out["per_s"]))
                for role, us in out["cpu_us_per_call"].items():
                    cpu[s.label].setdefault(role, []).append(us)
                loads.append(os.getloadavg()[0])
                print(json.dumps({"pair": i, "side": s.label, "per_s": round(out["per_s"], 1),
                                  "cpu_us_per_call": out["cpu_us_per_call"], "load1": loads[-1],
                                  "t": time.strftime("%H:%M:%S")}), flush=True)
    finally:
        made.close()
    a, b = rates["A"], rates["B"]
    ratios = [y / x for x, y in zip(a, b, strict=False) if x > 0]
    print(json.dumps({"A_median": round(statistics.median(a), 1), "B_median": round(statistics.median(b), 1),
                      "B_over_A_pair_median": round(statistics.median(ratios), 4),
                      "B_faster_pairs": sum(r > 1 for r in ratios), "pairs": len(ratios),
                      "cpu_us_per_call_medians": {side: {r: statistics.median(v) for r, v in cpu[side].items()}
                                                  for side in ("A", "B")},
                      "load1_min": min(loads), "load1_max": max(loads)}), flush=True)


if __name__ == "__main__":
    main()
