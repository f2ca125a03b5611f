"""`python -m server.worker`: one worker process owning the devices of one host.

The device count must be fixed before JAX starts its backend, so this module sets it
from the command line before anything imports jax.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from .. import stackdump
from ..tlsflags import add_tls_flags, tls_from_flags

COLLECTIVE_TIMEOUT_S = 5


def _token() -> str | None:
    """$PWCTL_TOKEN, else the token file a controller on this machine wrote."""
    token = os.environ.get("PWCTL_TOKEN")
    if token:
        return token
    from .. import paths

    try:
        return paths.token_path().read_text().strip() or None
    except OSError:
        return None


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m server.worker")
    p.add_argument("--server", default=os.environ.get("PWCTL_SERVER", "127.0.0.1:7070"))
    p.add_argument("--island", required=True)
    p.add_argument("--devices", default="1", help="number of virtual CPU devices, or 'all' for real accelerators")
    p.add_argument("--name", default=None, help="stable host name (default: <hostname>-<island>)")
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--unload-after", type=float, default=60.0, metavar="SECONDS",
                   help="unload compiled programs not run for this long once the worker is idle; they "
                        "compile again when called (default 60; 0 keeps them)")
    p.add_argument("--no-token", action="store_true",
                   help="require no cluster token of callers (a private machine); they still need the "
                        "credentials the controller issues, and the worker still presents a token it finds")
    p.add_argument("--log-level", default="INFO")
    add_tls_flags(p)
    ns = p.parse_args()
    stackdump.install()
    from pwctl.errors import FailedPrecondition

    tls = tls_from_flags(p, ns)
    from pwctl.version import check_jax

    try:  # before jax is imported: a jax of another release may fail in ways that name nothing
        for warning in check_jax("the worker"):
            sys.stderr.write(f"WARNING {warning}\n")
    except FailedPrecondition as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    if ns.devices != "all":
        if not ns.devices.isdigit() or int(ns.devices) <= 0:
            p.error("--devices must be a positive number or 'all'")
        os.environ["JAX_PLATFORMS"] = "cpu"
    # An island spanning hosts (server/worker/group.py): a collective whose peer died fails after
    # this many seconds instead of hanging (XLA reads the flag when it creates the backend).
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_collective_timeout_seconds" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_collective_timeout_seconds={COLLECTIVE_TIMEOUT_S}".strip()
    import jax

    if ns.devices != "all":
        jax.config.update("jax_num_cpu_devices", int(ns.devices))
    jax.config.update("jax_enable_x64", True)  # pw follows NumPy dtypes (float64 stays float64)
    # the preemption service would swallow SIGTERM once the worker is in a distributed group
    jax.config.update("jax_enable_preemption_service", False)
    from .group import install_backend_factory

    install_backend_factory()  # before anything creates the CPU backend

    from ..envsetting import SettingError
    from .config import WorkerConfig

    try:  # the modules read their PATHWAYS_* tuning settings as they load
        from .process import run_worker
    except SettingError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)

    name = ns.name or f"{socket.gethostname()}-{ns.island}"
    run_worker(
        WorkerConfig(
            server=ns.server,
            island=ns.island,
            devices=ns.devices,
            name=name,
            listen=ns.listen,
            token=_token(),
            check_token=not ns.no_token,
            unload_after_s=ns.unload_after,
            tls=tls,
            health_listen=ns.health_listen,
        ),
        log_level=ns.log_level,
    )


if __name__ == "__main__":
    main()
