"""The environment of an unmodified JAX program run against the proxy service in tests."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def plugin_path(tmp_path: Path) -> Path:
    """A dist-info declaring the `jax_plugins` entry point exactly as pyproject.toml does (the
    shared editable install may predate it), so JAX's own discovery finds the plugin."""
    entry = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["jax_plugins"]
    info = tmp_path / "site" / "pathways_proxy_entry-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pathways-proxy-entry\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[jax_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in entry.items())
    )
    return info.parent


def client_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "PWCTL_", "PATHWAYS_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(plugin_path(tmp_path))])
    env["PATHWAYS_HOME"] = str(tmp_path / "home")
    env.update(extra)
    return env


def proxy_env(cluster: Any, tmp_path: Path, **extra: str) -> dict[str, str]:
    """`client_env` of a program sent to `cluster`'s proxy service (a `LocalCluster`), with its token."""
    return client_env(tmp_path, JAX_PLATFORMS="proxy", JAX_BACKEND_TARGET=f"grpc://{cluster.address}",
                      PWCTL_TOKEN=cluster.token or "", **extra)
