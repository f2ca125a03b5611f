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
from .errors import InvalidArgument


@dataclass(frozen=True)
class Target:
    address: str
    token: str | None


CONFIG_KEYS = ("server", "token")


def _config() -> dict[str, str]:
    """The config file's settings ({} when there is none). A file that is there but not what it
    should be (not JSON, not an object, a key it does not know, a value that is not a string) is
    an error naming the file and the problem, never silently ignored."""
    path = paths.data_dir() / "config.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise InvalidArgument(f"cannot read {path}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(f"{path} is not valid JSON ({e}); fix or remove it "
                              '(e.g. {"server": "10.0.0.5:7070", "token": "..."})') from None
    if not isinstance(data, dict):
        raise InvalidArgument(f'{path} must hold a JSON object such as {{"server": "10.0.0.5:7070"}}, '
                              f"not a {type(data).__name__}")
    unknown = sorted(set(data) - set(CONFIG_KEYS))
    if unknown:
        raise InvalidArgument(f"{path}: unknown key(s) {', '.join(map(repr, unknown))} "
                              f"(known: {', '.join(CONFIG_KEYS)})")
    wrong = sorted(k for k, v in data.items() if not isinstance(v, str))
    if wrong:
        raise InvalidArgument(f"{path}: {', '.join(map(repr, wrong))} must be a string")
    return dict(data)


def resolve(server: str | None = None, token: str | None = None) -> Target:
    cfg = _config()
    address = server or os.environ.get("PWCTL_SERVER") or cfg.get("server") or paths.DEFAULT_ADDRESS
    tok = token or os.environ.get("PWCTL_TOKEN") or cfg.get("token")
    return Target(address=address, token=tok or paths.read_token())
