"""Where pwctl talks, in order: the --server flag, $PWCTL_SERVER, the config file, the local default.

The token likewise: --token, $PWCTL_TOKEN, the config file, the server's token file.
The config file is `$PATHWAYS_HOME/config.json` (or the user's data dir), e.g.
`{"server": "10.0.0.5:7070", "token": "..."}`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from . import paths


@dataclass(frozen=True)
class Target:
    address: str
    token: str | None


def _config() -> dict[str, str]:
    path = paths.data_dir() / "config.json"
    try:
        data = json.loads(path.read_text())
        return {k: str(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def resolve(server: str | None = None, token: str | None = None) -> Target:
    cfg = _config()
    address = server or os.environ.get("PWCTL_SERVER") or cfg.get("server") or paths.DEFAULT_ADDRESS
    tok = token or os.environ.get("PWCTL_TOKEN") or cfg.get("token")
    if not tok:
        try:
            tok = paths.token_path().read_text().strip() or None
        except OSError:
            tok = None
    return Target(address=address, token=tok)
