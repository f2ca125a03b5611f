"""examples/slurm/pathways.sbatch on a real Slurm of two nodes that are separate hosts (network, UTS
and mount namespaces: tests/hosts.py): slurmctld on host 0, one slurmd per host (its NodeName the
host's hostname, its NodeAddr the host's address), one job over both nodes whose two workers form
one island of 8 devices; a program runs one SPMD computation whose psum crosses the hosts, checked
against plain JAX and NumPy; the workers stop on SIGTERM, and afterwards nothing of the job runs on
either node.

One munged, in the root namespaces, serves every host: its socket is a path on the filesystem the
hosts share (path-named Unix sockets do not belong to a network namespace), and one munged is one
key, as the nodes of a real cluster share one. Every Slurm daemon and client runs inside a host
(the root namespace has no route to the hosts' addresses).

Skips, saying why, where Slurm/munge are missing, not root, namespaces cannot be made, or a host's
mount namespace cannot mount the cgroup filesystem slurmd needs (CGROUP_SETUP).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hosts import REPO, XLA_FLAGS, Host, _pids_in_netns, hosts  # noqa: F401  (the fixture)
from test_slurm import (
    PLUGINS_CONF,
    SBATCH,
    TOOLS,
    SlurmClient,
    job_processes,
    start_munged,
    stop,
    stop_munged,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)

SLURMCTLD_PORT = 6817  # each host has a network namespace of its own: the usual ports are free there
SLURMD_PORT = 6818
# `ip netns exec` mounts a sysfs of the namespace's own over /sys, which hides /sys/fs/cgroup, and
# slurmd 22.05 will not start without a cgroup filesystem (its cgroup plugin initialises even with
# proctrack/pgid and task/none): each host gets one in its own mount namespace, the named v1
# hierarchy "systemd" on a tmpfs, which is all slurmd looks for.
CGROUP_SETUP = ["sh", "-c", "mount -t tmpfs -o mode=755 tmpfs /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd "
                "&& mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd"]

PROGRAM = """
import jax
import numpy as np
import pwctl as pw

s = pw.make_virtual_device_set().add_slice(devices=8, island="a")
print("hosts", ",".join(sorted({d.host for d in s.info.devices})), flush=True)
step = pw.pmap(lambda x: x * 2.0 + jax.lax.psum(x, "i"), devices=s.devices, axis_name="i")
x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) / 4.0
print("result", np.asarray(step(x)).tolist(), flush=True)
print("plain", np.asarray(jax.jit(lambda v: v * 2.0 + v.sum(0))(x)).tolist(), flush=True)  # this process's JAX
"""


def conf(root: Path, hs: Sequence[Host], munge_socket: Path) -> str:
    """slurm.conf of a cluster whose controller is host 0 and whose nodes are all of `hs`; slurmd's
    spool, pid and log files are per node (%n: the node's name)."""
    ctl = hs[0]
    with open("/proc/meminfo") as fh:
        mem_mib = int(fh.readline().split()[1]) // 1024
    cpus = os.cpu_count() or 1
    lines = [
        "ClusterName=pwnodes",
        f"SlurmctldHost={ctl.hostname}({ctl.ip})",
        f"SlurmctldPort={SLURMCTLD_PORT}",
        f"SlurmdPort={SLURMD_PORT}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool-%n'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd-%n.log'}",
        *PLUGINS_CONF,
    ]
    lines += [f"NodeName={h.hostname} NodeAddr={h.ip} CPUs={cpus} RealMemory={mem_mib // (2 * len(hs))} "
              "State=UNKNOWN" for h in hs]
    nodes = ",".join(h.hostname for h in hs)
    lines += [f"PartitionName=test Nodes={nodes} Default=YES MaxTime=INFINITE State=UP", ""]
    return "\n".join(lines)


@dataclass
class Nodes(SlurmClient):
    """A Slurm over `hosts`; its clients run on host 0."""

    root: Path
    hosts: list[Host]
    env: dict[str, str]
    daemons: set[int] = field(default_factory=set)  # the pids of slurmctld and the slurmds

    def run(self, *args: str, timeout: float = 30.0, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.hosts[0].argv(args), env=dict(self.env, **env), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def leftovers(self) -> list[str]:
        """What runs on the hosts besides their holders and the Slurm daemons: "host: pid command"."""
        found = []
        for h in self.hosts:
            for pid in _pids_in_netns(h.inode):
                if pid != h.holder.pid and pid not in self.daemons:
                    with contextlib.suppress(OSError):
                        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                        cmd = raw.replace(b"\0", b" ").decode(errors="replace").strip()
                        ppid = int(re.findall(r"^PPid:\s*(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)[0])
                        if not (ppid in self.daemons and cmd.endswith("slurmscriptd")):  # slurmctld's helper
                            found.append(f"{h.hostname}: {pid} (parent {ppid}) {cmd}")
        return found


@pytest.fixture
def nodes(hosts: Any) -> Iterator[Nodes]:  # noqa: F811
    missing = [t for t in (*TOOLS, "srun") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"Slurm/munge not installed ({', '.join(missing)} missing; scripts/test.sh installs "
                    "slurm-wlm and munge as root with apt-get)")
    if os.geteuid() != 0:
        pytest.skip("the test starts munged (as the munge user) and the Slurm daemons: needs root")
    hs = hosts(2)
    root = Path(tempfile.mkdtemp(prefix="pw-slurm-nodes-"))  # munged (another user) reaches its directory
    root.chmod(0o755)
    (root / "state").mkdir()
    for h in hs:
        (root / f"spool-{h.hostname}").mkdir()
        r = h.run(CGROUP_SETUP, timeout=30)
        if r.returncode != 0:
            shutil.rmtree(root, ignore_errors=True)
            pytest.skip(f"cannot mount a cgroup filesystem in a host's mount namespace: {r.stderr.strip()}")
    procs: list[subprocess.Popen[bytes]] = []
    env = {k: v for k, v in os.environ.items() if k not in ("PWCTL_SERVER", "PWCTL_TOKEN", "PATHWAYS_HOME")}
    env["SLURM_CONF"] = str(root / "slurm.conf")
    s = Nodes(root, hs, env)
    munged = None
    try:
        munged, sock = start_munged(root)
        (root / "slurm.conf").write_text(conf(root, hs, sock))
        daemons = [(hs[0], "slurmctld")] + [(h, "slurmd") for h in hs]
        for h, daemon in daemons:  # all at once: slurmd retries its registration until slurmctld answers
            procs.append(subprocess.Popen(h.argv([daemon, "-D"]), env=env, stdout=subprocess.DEVNULL,
                                          stderr=open(root / f"{daemon}-{h.hostname}.err", "wb")))  # noqa: SIM115
            s.daemons.add(procs[-1].pid)  # nsenter execs the daemon: this is its pid

        def idle() -> bool:
            for p, (h, daemon) in zip(procs, daemons, strict=True):
                if p.poll() is not None:
                    raise RuntimeError(f"{daemon} on {h.hostname} exited: {s.log(f'{daemon}-{h.hostname}.err')} "
                                       f"{s.log('slurmctld.log')} {s.log(f'slurmd-{h.hostname}.log')}")
            r = s.run("sinfo", "-h", "-N", "-o", "%N %t")
            return r.returncode == 0 and sorted(r.stdout.split()) == sorted(
                [h.hostname for h in hs] + ["idle"] * len(hs))

        wait_until(idle, 60, "both Slurm nodes to be idle", interval=0.5)
        yield s
    finally:
        with contextlib.suppress(Exception):
            s.run("scontrol", "shutdown", timeout=20)
        for p in reversed(procs):
            stop(p)
        if munged is not None:
            stop_munged(root, munged)
        shutil.rmtree(root, ignore_errors=True)


def test_one_island_over_two_slurm_nodes(nodes: Nodes, tmp_path: Path) -> None:
    """One job on both nodes: a worker on each (PW_ISLANDS=a,a: one island of 8 devices), the
    program's psum over all 8 crossing the hosts; the job ends COMPLETED, its workers stopped
    cleanly on both nodes, and nothing of it left running on either."""
    workdir = tmp_path / "job"
    workdir.mkdir()
    program = workdir / "psum.py"
    program.write_text(PROGRAM)
    # `hostname -I`: the host's own address (the hosts' names resolve nowhere), with a trailing space
    r = nodes.run("sbatch", "--parsable", "--nodes=2", f"--chdir={workdir}", f"--output={workdir}/job-%j.out",
                  str(SBATCH), str(program), PW_PYTHON=sys.executable, PW_DEVICES="4", PW_ISLANDS="a,a",
                  PW_READY_TIMEOUT="90", PW_ADDRESS_CMD="hostname -I", PYTHONPATH=str(REPO), XLA_FLAGS=XLA_FLAGS)
    assert r.returncode == 0, f"sbatch: {r.stderr}"
    job_id = r.stdout.strip().split(";")[0]
    info = nodes.wait_job(job_id)
    out = (workdir / f"job-{job_id}.out").read_text(errors="replace")
    job_dir = workdir / f"pathways-{job_id}"
    names = [h.hostname for h in nodes.hosts]

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in sorted(job_dir.glob("*.log")))

    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out, logs())
    assert info["NumNodes"] == "2", info
    assert f"controller at {nodes.hosts[0].ip}:" in out, out  # on the first node, at its address
    # the slice's 8 devices are on both nodes' workers (named after their nodes)
    assert f"hosts {','.join(names)}" in out, out
    got = {k: np.array(json.loads(v), dtype=np.float32) for k, v in re.findall(r"^(result|plain) (.*)$", out, re.M)}
    assert set(got) == {"result", "plain"}, out
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) / 4.0
    assert np.allclose(got["result"], got["plain"]) and np.allclose(got["result"], x * 2.0 + x.sum(0)), out
    for name, h in zip(names, nodes.hosts, strict=True):
        worker = (job_dir / f"worker-{name}.log").read_text(errors="replace")
        # each node's worker listened on its own host's address, joined the island's group, and
        # stopped on the SIGTERM the launcher had Slurm send (srun's own would have been SIGKILL)
        assert re.search(rf"worker {name} \(island a, 4 cpu devices\) serving at {re.escape(h.ip)}:\d+", worker), \
            worker[-2000:]
        assert re.search(r"island group: generation \d+, process \d of 2", worker), worker[-2000:]
        assert f"worker {name} stopped" in worker, worker[-2000:]
    assert "Killed" not in out and "forcing job termination" not in out, out
    assert not job_processes(job_dir), "the controller or a worker outlived the job"
    try:  # slurmstepd and the like leave within moments of the job's end
        wait_until(lambda: not nodes.leftovers(), 30, "the job's processes to leave both nodes")
    except TimeoutError:
        pytest.fail(f"left running after the job: {nodes.leftovers()}")
