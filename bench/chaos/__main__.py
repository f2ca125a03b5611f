"""`python -m bench.chaos [--seed N] [--requests N] [--proxy-requests N] [--kills N] [--freezes N] [--quick]
[--out FILE] [--keep DIR]`"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from .cluster import ChaosCluster
from .fuzz import Fuzzer
from .kills import KillRun
from .proxyfuzz import ProxyFuzzer
from .schedule import describe, phase_rng, schedule

FULL = {"requests": 12_000, "kills": 50, "controller_kills": 6, "freezes": 12, "controller_freezes": 4,
        "proxy_requests": 3000}
QUICK = {"requests": 600, "kills": 5, "controller_kills": 1, "freezes": 1, "controller_freezes": 0,
         "proxy_requests": 100}


def rss_mib(pid: int) -> float:
    return round(psutil.Process(pid).memory_info().rss / 2**20, 1)


def run(seed: int, requests: int, kills: int, controller_kills: int, home: Path | None = None, freezes: int = 0,
        controller_freezes: int = 0, proxy_requests: int = 0) -> dict[str, Any]:
    cluster = ChaosCluster(home=home)
    # each phase draws from its own stream (schedule.py): the seed names the same faults every time
    faults = schedule(seed, cluster.islands, kills, controller_kills, freezes, controller_freezes,
                      cluster.heartbeat_timeout)
    report: dict[str, Any] = {"seed": seed, "data_dir": str(cluster.home), "schedule": describe(faults)}
    try:
        cluster.start()
        assert cluster.controller is not None
        report["controller_rss_mib_before"] = rss_mib(cluster.controller.pid)
        before = cluster.snapshot()
        hosts = [f"chaos-{i}" for i in cluster.islands]
        addresses = [h.address for h in cluster.hosts().values()]
        fuzzer = Fuzzer(phase_rng(seed, "fuzz"), cluster.address, addresses, hosts, cluster.token)
        try:
            report["fuzz"] = fuzzer.run(requests)
        finally:
            fuzzer.close()
        report["fuzz"]["controller_up"] = cluster.answers() and cluster.controller.poll() is None
        report["fuzz"]["state_unchanged"] = report["fuzz"]["controller_up"] and cluster.snapshot() == before
        report["fuzz"]["workers_alive"] = all(p.poll() is None for p in cluster.workers.values())
        report["controller_rss_mib_after_fuzz"] = rss_mib(cluster.controller.pid)
        # a fresh start for the kills: hostile requests may have left a worker wedged (its own issue)
        for island in cluster.islands:
            cluster.kill(cluster.workers[island])
            cluster.start_worker(island)
        cluster.wait_ready()
        # the proxy fuzz runs beside the workloads, before the first fault (proxyfuzz.py)
        proxy = ProxyFuzzer(phase_rng(seed, "proxyfuzz"), cluster.address, cluster.token, "chaos-named")
        kill_run = KillRun(cluster, faults, beside=(lambda: proxy.run(proxy_requests)) if proxy_requests else None)
        report["kills"] = kill_run.run()
        report["proxy_fuzz"] = kill_run.beside_report
    finally:
        if cluster.controller is not None and cluster.controller.poll() is None:
            cluster.controller.terminate()
            cluster.controller.wait(timeout=30)
        report["database_integrity"] = cluster.integrity() if (cluster.home / "pw.db").exists() else "missing"
        report["controller_tracebacks"] = cluster.tracebacks("controller")
        report["worker_tracebacks"] = cluster.tracebacks("worker")
        cluster.close()  # keeps a --keep directory (only a temporary one is removed)
    k, f, pf = report.get("kills", {}), report.get("fuzz", {}), report.get("proxy_fuzz", {})
    beside = pf.get("workloads_beside", {})
    fz = k.get("freezes", {})
    report["checks"] = {
        "controller_tracebacks == 0": report["controller_tracebacks"] == 0,
        "controller UNKNOWN statuses == 0": f.get("controller_unknown") == 0,
        "controller up after fuzz": bool(f.get("controller_up")),
        "islands, hosts, named slices unchanged by fuzz": bool(f.get("state_unchanged")),
        "proxy fuzz: no UNKNOWN status, no answer saying '(a bug)'":
            not proxy_requests or (pf.get("unknown") == 0 and pf.get("bug_answers") == 0),
        "proxy fuzz: no workload call failed or was wrong beside it, each served after it":
            not proxy_requests or (bool(beside) and all(not w["failed"] and not w["wrong_results"]
                                                        and w["served_after"] for w in beside.values())),
        "proxy fuzz: a fresh proxy session computes right after it":
            not proxy_requests or bool(pf.get("fresh_session_ok")),
        "proxy fuzz: a client that never reads is held back, its session kept":
            not proxy_requests or (pf.get("never_reads", {}).get("writes_held_back") is True
                                   and pf["never_reads"]["ended_early"] is False),
        "wrong results == 0": k.get("wrong_results") == 0 and k.get("job", {}).get("wrong_results", 0) == 0,
        "every workload (across, psum, proxy) served again after the last kill":
            bool(k.get("workloads")) and all(w["served_after_last_kill"] for w in k["workloads"].values()),
        "the job survived every kill (succeeded, served after the last)":
            k.get("job", {}).get("state") == "JOB_STATE_SUCCEEDED" and bool(k["job"].get("served_after_last_kill"))
            and k["job"].get("stuck_calls") == 0,
        f"calls waiting > {15:g} s after a kill == 0": k.get("stuck_calls") == 0,
        "every kill recovered": k.get("not_recovered") == 0,
        "state consistent after controller restarts": k.get("inconsistent_after_restart") == 0,
        "every freeze recovered (calls succeed again after SIGCONT)": fz.get("not_recovered") == 0,
        "a worker frozen past the heartbeat timeout was declared lost": fz.get("long_worker_not_lost") == 0,
        "every frozen process carried on (a lost worker rejoined in the same process)": fz.get("not_rejoined") == 0,
        "state consistent after every freeze (database agrees)": fz.get("inconsistent") == 0,
        "a freeze lost no host but the frozen one (a frozen controller none)": fz.get("others_lost") == 0,
        "no buffer left on a worker once every session ended":
            bool(k.get("buffers_left")) and not any(k["buffers_left"].values()),
        "database integrity ok": report["database_integrity"] == "ok",
    }
    report["worker_checks"] = {  # the worker's own hardening is tracked apart (server/worker)
        "worker_tracebacks == 0": report["worker_tracebacks"] == 0,
        "worker UNKNOWN statuses == 0": f.get("worker_unknown") == 0,
        "workers alive after fuzz": bool(f.get("workers_alive")),
    }
    return report


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__)
    p.add_argument("--seed", type=int, default=29)
    p.add_argument("--requests", type=int, default=None, help=f"hostile requests (default {FULL['requests']})")
    p.add_argument("--kills", type=int, default=None, help=f"kills (default {FULL['kills']})")
    p.add_argument("--controller-kills", type=int, default=None,
                   help=f"how many of the kills hit the controller (default {FULL['controller_kills']})")
    p.add_argument("--freezes", type=int, default=None,
                   help=f"SIGSTOP/SIGCONT freezes among the kills (default {FULL['freezes']}; freezes.py)")
    p.add_argument("--controller-freezes", type=int, default=None,
                   help=f"how many of the freezes hit the controller (default {FULL['controller_freezes']})")
    p.add_argument("--proxy-requests", type=int, default=None,
                   help=f"hostile IFRT proxy requests beside the workloads (default {FULL['proxy_requests']}; "
                   "proxyfuzz.py; 0: none)")
    p.add_argument("--quick", action="store_true",
                   help=f"the short run the test suite does (600 requests, {QUICK['proxy_requests']} proxy requests, "
                   "5 kills, 1 freeze)")
    p.add_argument("--out", default=None, help="also write the JSON report here")
    p.add_argument("--keep", default=None, help="keep the cluster's data directory (logs, database) here")
    ns = p.parse_args()
    # a stopped run still stops its cluster (the finally clauses run)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    base = QUICK if ns.quick else FULL
    requests = ns.requests if ns.requests is not None else base["requests"]
    kills = ns.kills if ns.kills is not None else base["kills"]
    ck = ns.controller_kills if ns.controller_kills is not None else min(base["controller_kills"], kills)
    freezes = ns.freezes if ns.freezes is not None else base["freezes"]
    cf = ns.controller_freezes if ns.controller_freezes is not None else min(base["controller_freezes"], freezes)
    proxy_requests = ns.proxy_requests if ns.proxy_requests is not None else base["proxy_requests"]
    home = Path(ns.keep) if ns.keep else None
    if home is not None:
        home.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    report = run(ns.seed, requests, kills, ck, home, freezes, cf, proxy_requests)
    report["seconds"] = round(time.monotonic() - start, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if ns.out:
        Path(ns.out).write_text(text + "\n")
    sys.exit(0 if all(report["checks"].values()) else 1)


if __name__ == "__main__":
    main()
