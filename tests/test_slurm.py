"""examples/slurm/pathways.sbatch on a real Slurm: munged, slurmctld and slurmd started here with a
generated slurm.conf in a temporary directory (one node: this machine), the batch script submitted
with `sbatch` (two jobs side by side), the seed program's output checked in the job's output file, the exit code of a
failing program checked as the job's, and nothing of the job left running afterwards.

scripts/test.sh installs Debian's slurm-wlm and munge when it can (root, apt-get); where they are
missing this module skips, saying so.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tlscerts import make_ca, make_cert

from server.ports import held_port

REPO = Path(__file__).resolve().parent.parent
SBATCH = REPO / "examples" / "slurm" / "pathways.sbatch"
SEED = REPO / "examples" / "seed_program.py"
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
JOB_TIMEOUT_S = 150.0

pytestmark = pytest.mark.timeout(400)


def free_port() -> int:
    """A port held bound (SO_REUSEADDR, not listening) for the test session (server/ports.py),
    so no other `bind(0)` gets it before the Slurm daemon binds it: they set SO_REUSEADDR too."""
    return held_port()


def wait_until(pred, timeout: float, what: str, interval: float = 0.2):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def start_munged(root: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """munged (as the munge user) with its socket, pid, log and seed in `root`/munge; (its
    process, its socket). Skips where there is no munge user; fails where munged exits."""
    try:
        munge_user = pwd.getpwnam("munge")
    except KeyError:
        pytest.skip("no munge user (the munge package creates it)")
    munge_dir = root / "munge"
    munge_dir.mkdir()
    os.chown(munge_dir, munge_user.pw_uid, munge_user.pw_gid)
    sock = munge_dir / "munge.socket"
    # munged refuses to run as root with the packaged key ("Keyfile is insecure")
    proc = subprocess.Popen(
        ["runuser", "-u", "munge", "--", "munged", "--foreground", f"--socket={sock}",
         f"--pid-file={munge_dir / 'munged.pid'}", f"--log-file={munge_dir / 'munged.log'}",
         f"--seed-file={munge_dir / 'munged.seed'}"],
        stdout=subprocess.DEVNULL, stderr=open(root / "munged.err", "wb"))  # noqa: SIM115
    wait_until(lambda: sock.exists() or proc.poll() is not None, 15, "munged's socket")
    if proc.poll() is not None:
        logs = [(root / f).read_text(errors="replace")[-3000:] for f in ("munged.err", "munge/munged.log")
                if (root / f).exists()]
        pytest.fail(f"munged exited: {' '.join(logs)}")
    return proc, sock


def stop_munged(root: Path, proc: subprocess.Popen[bytes]) -> None:
    """munged (under runuser) does not stop with its parent: SIGTERM to its pid (from its pid file),
    then its runuser is waited for."""
    with contextlib.suppress(OSError, ValueError):
        os.kill(int((root / "munge" / "munged.pid").read_text()), signal.SIGTERM)
    stop(proc)
    with contextlib.suppress(OSError, ValueError):  # make sure the daemon itself is gone
        os.kill(int((root / "munge" / "munged.pid").read_text()), signal.SIGTERM)


def stop(p: subprocess.Popen[bytes]) -> None:
    """Waits for `p` to end (10 s), then SIGTERM, then SIGKILL."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=10)
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")  # a job's end states


class SlurmClient:
    """What the tests ask a Slurm (`run` says where its client commands run; logs under `root`)."""

    root: Path

    def run(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        raise NotImplementedError

    def log(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.root / name).read_text(errors="replace")[-3000:]
        return ""

    def job(self, job_id: str) -> dict[str, str]:
        r = self.run("scontrol", "-o", "show", "job", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", r.stdout)) if r.returncode == 0 else {}

    def wait_job(self, job_id: str) -> dict[str, str]:
        def ended() -> dict[str, str] | None:
            info = self.job(job_id)
            return info if info.get("JobState") in ENDED else None

        try:
            return wait_until(ended, JOB_TIMEOUT_S, f"job {job_id}", interval=0.5)
        except TimeoutError:
            self.run("scancel", job_id)
            raise


@dataclass
class Slurm(SlurmClient):
    root: Path
    env: dict[str, str]
    procs: list[subprocess.Popen[bytes]]

    def run(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)


# slurm.conf lines both Slurm tests use: no cgroups, accounting or MPI; nodes back in service by themselves
PLUGINS_CONF = (
    "ProctrackType=proctrack/pgid",  # with linuxproc a job's background process outlives the job
    "TaskPlugin=task/none",
    "JobAcctGatherType=jobacct_gather/none",
    "AccountingStorageType=accounting_storage/none",
    "SelectType=select/cons_tres",
    "SelectTypeParameters=CR_Core",
    "MpiDefault=none",
    "ReturnToService=2",
    "MinJobAge=600",  # the ended job stays visible to `scontrol show job`
)


def slurm_conf(root: Path, munge_socket: Path) -> str:
    host = socket.gethostname()
    cpus = os.cpu_count() or 1
    with open("/proc/meminfo") as fh:
        mem_mib = int(fh.readline().split()[1]) // 1024
    return "\n".join([
        "ClusterName=pwtest",
        f"SlurmctldHost={host}",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd.log'}",
        *PLUGINS_CONF,
        f"NodeName={host} CPUs={cpus} RealMemory={mem_mib // 2} State=UNKNOWN",
        f"PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"Slurm/munge not installed ({', '.join(missing)} missing; scripts/test.sh installs "
                    "slurm-wlm and munge as root with apt-get)")
    if os.geteuid() != 0:
        pytest.skip("the test starts munged (as the munge user) and the Slurm daemons: needs root")
    # not under pytest's base directory: that is 0700, and munged (another user) must reach its own
    root = Path(tempfile.mkdtemp(prefix="pw-slurm-"))
    root.chmod(0o755)
    for d in ("state", "spool"):
        (root / d).mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PWCTL_SERVER", "PWCTL_TOKEN")}
    env["SLURM_CONF"] = str(root / "slurm.conf")
    procs: list[subprocess.Popen[bytes]] = []
    s = Slurm(root, env, procs)
    try:
        munged, sock = start_munged(root)
        procs.append(munged)
        (root / "slurm.conf").write_text(slurm_conf(root, sock))
        for daemon in ("slurmctld", "slurmd"):
            procs.append(subprocess.Popen([daemon, "-D"], env=env, stdout=subprocess.DEVNULL,
                                          stderr=open(root / f"{daemon}.err", "wb")))  # noqa: SIM115

        def node_idle() -> bool:
            for p, name in zip(procs[1:], ("slurmctld", "slurmd"), strict=True):
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited: {s.log(name + '.err')} {s.log(name + '.log')}")
            r = s.run("sinfo", "-h", "-o", "%t")
            return r.returncode == 0 and r.stdout.strip() == "idle"

        wait_until(node_idle, 60, "the Slurm node to be idle", interval=0.5)
        yield s
    finally:
        with contextlib.suppress(Exception):
            s.run("scontrol", "shutdown", timeout=20)
        for k, p in reversed(list(enumerate(procs))):
            if k == 0:
                stop_munged(root, p)
            else:
                stop(p)
        shutil.rmtree(root, ignore_errors=True)


def sbatch(slurm: Slurm, workdir: Path, program: Path, **env: str) -> str:
    """sbatch the launcher with `program` (in `workdir`); its job id."""
    workdir.mkdir()
    job_env = dict(slurm.env, PW_PYTHON=sys.executable, PW_DEVICES="8", PW_READY_TIMEOUT="90",
                   PYTHONPATH=str(REPO), XLA_FLAGS="", **env)
    job_env.pop("PATHWAYS_HOME", None)  # the launcher must make its own, under the job's directory
    r = subprocess.run(["sbatch", "--parsable", "--nodes=1", f"--chdir={workdir}",
                        f"--output={workdir}/job-%j.out", str(SBATCH), str(program)],
                       env=job_env, cwd=workdir, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"sbatch: {r.stderr}"
    return r.stdout.strip().split(";")[0]


@dataclass
class Job:
    workdir: Path
    id: str

    def wait(self, slurm: Slurm) -> tuple[dict[str, str], str]:
        """Waits for the job to end; (its info, its output)."""
        info = slurm.wait_job(self.id)
        return info, (self.workdir / f"job-{self.id}.out").read_text(errors="replace")


FAILS = "import sys\nprint('about to fail', flush=True)\nsys.exit(3)\n"


@pytest.fixture(scope="module")
def jobs(slurm: Slurm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Job]]:
    """The module's two jobs, submitted at once (the node runs both side by side: most of a job's
    time is the launcher waiting for its controller and worker): "ok", the seed program; "fail",
    a program exiting 3, its worker named into island "main". Each test waits for its own."""
    root = tmp_path_factory.mktemp("slurm-jobs")
    program = root / "fails.py"
    program.write_text(FAILS)
    # the failing job runs with TLS: per-node certificates ("{node}" in the path) naming the address
    # the launcher's servers use (the node's hostname), signed by a throwaway CA
    certs = root / "certs"
    ca = make_ca(certs)
    make_cert(ca, certs, socket.gethostname(), [socket.gethostname()])
    tls = {"PW_TLS_CERT": f"{certs}/{{node}}.pem", "PW_TLS_KEY": f"{certs}/{{node}}.key", "PW_TLS_CA": str(ca.cert)}
    made = {"ok": Job(root / "ok", sbatch(slurm, root / "ok", SEED))}
    made["fail"] = Job(root / "fail", sbatch(slurm, root / "fail", program, PW_ISLANDS="main", **tls))
    yield made
    for job in made.values():  # none left running, whichever test ran
        with contextlib.suppress(TimeoutError):
            slurm.wait_job(job.id)


def job_processes(job_dir: Path) -> list[int]:
    """Processes still running with a data directory inside `job_dir` (the launcher's)."""
    found = []
    needle = f"PATHWAYS_HOME={job_dir}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{entry}/environ").read_bytes():
                    found.append(int(entry))
    return found


def test_seed_program_on_slurm(slurm: Slurm, jobs: dict[str, Job]) -> None:
    job = jobs["ok"]
    info, out = job.wait(slurm)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out)
    assert "(array([3., 5.]), array([2., 4.]))" in out, out
    job_dir = job.workdir / f"pathways-{job.id}"
    token = job_dir / "token"
    assert token.stat().st_mode & 0o777 == 0o600
    assert job_dir.stat().st_mode & 0o777 == 0o700
    assert token.read_text().strip() not in out  # the token is never printed
    assert (job_dir / "pathways.db").exists(), "the controller's data directory is the job's"
    assert not job_processes(job_dir), "the controller or a worker outlived the job"


def test_program_exit_code_is_the_jobs(slurm: Slurm, jobs: dict[str, Job]) -> None:
    job = jobs["fail"]
    info, out = job.wait(slurm)
    assert "about to fail" in out, out
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "3:0", (info, out)
    job_dir = job.workdir / f"pathways-{job.id}"
    assert not job_processes(job_dir)
    # PW_ISLANDS named the node's worker into island "main" (by default: the node's name)
    node = socket.gethostname()
    worker = (job_dir / f"worker-{node}.log").read_text()
    assert f"worker {node} (island main," in worker, out
    assert f"worker {node} stopped" in worker, worker[-2000:]  # SIGTERM (Slurm's), not srun's SIGKILL
    # PW_TLS_*: the controller and the worker served TLS only, and the launcher's pwctl and the
    # program's driver found the CA (the program ran)
    assert re.search(r"serving at \S+ \(TLS\)", worker), worker[-2000:]
    assert "(TLS)" in (job_dir / "server.log").read_text()
