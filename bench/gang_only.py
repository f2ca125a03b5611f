"""Only the scale suite's gang rows (bench/scale.py, step 7): a quick A/B of one gang node's admission
and dispatch at N simulated hosts, without the suite's other steps (heartbeat window, listings,
losses, restart), ~30 s at 2,048 hosts instead of several minutes.

    python -m bench.gang_only 2048 --label after [--out FILE.jsonl] [--controller-args "--relay-group 128"]

Run it from the tree under test (its cwd and PYTHONPATH): for an A/B, `git archive main | tar -x -C
/tmp/main` and run the same command there, alternating. Prints one JSON line (the load average at
the start, when the gang rows began and at the end, and each row's figure) and appends it, with the
rows, to `--out`. The controller starts as the suite's does (dispatch probe on, default relays);
the hosts have all registered and settled for 3 s when the gang rows begin.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import psutil

from bench import scale
from bench.simworkers import SimWorkers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hosts", type=int, nargs="?", default=2048)
    p.add_argument("--label", default="")
    p.add_argument("--out", default="")
    p.add_argument("--controller-args", default="", help="extra controller flags, space-separated")
    ns = p.parse_args()
    load0 = psutil.getloadavg()[0]
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="pw-gang-") as tmp:
        home = Path(tmp)
        probe_file = home / "dispatch-probe.jsonl"
        env = {**os.environ, "PATHWAYS_HOME": str(home), "PATHWAYS_DISPATCH_PROBE": str(probe_file)}
        env.pop("PWCTL_TOKEN", None)
        ctl = scale.Controller(home, tuple(ns.controller_args.split()))
        ctl.start(env)
        sizes = scale.island_sizes(ns.hosts)
        sim = SimWorkers(ctl.address, ns.hosts, sizes, scale.DEVICES_PER_HOST, env=env, log=home / "sim.log",
                         complete=True)
        try:
            reg = sim.wait_registered(timeout=scale.READY_TIMEOUT_S)
            if not reg["ok"]:
                raise SystemExit(f"only {reg['count']} of {ns.hosts} hosts registered")
            time.sleep(3.0)
            load_gang = psutil.getloadavg()[0]
            rows = list(scale._gang_rows(f"{ns.hosts} hosts", ctl.address, sim, sizes[0], probe_file,
                                         ns.hosts >= 2048, ctl.token))
        finally:
            sim.close()
            ctl.stop()
            scale.stop_island_services(home)
    out = {"label": ns.label, "utc": time.strftime("%H:%M:%S", time.gmtime(t0)), "load_start": round(load0, 2),
           "load_gang": round(load_gang, 2), "load_end": round(psutil.getloadavg()[0], 2),
           **{r["metric"]: round(r["pathways"], 3) for r in rows}}
    print(json.dumps(out), flush=True)
    if ns.out:
        with open(ns.out, "a") as fh:
            fh.write(json.dumps({**out, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
