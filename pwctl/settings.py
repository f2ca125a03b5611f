"""Where pwctl talks, in order: the --server flag, $PWCTL_SERVER, the config file, the controller
this data directory runs (the address `pwctl up`/`server start` gave it, e.g. `--listen
127.0.0.1:7391`), the local default (127.0.0.1:7070).

The token likewise: --token, $PWCTL_TOKEN, the config file, the server's token file.
The config file is `$PATHWAYS_HOME/config.json` (or the user's data dir), e.g.
`{"server": "10.0.0.5:7070", "token": "..."}`.

TLS likewise (pwctl/tls.py): the CA bundle from --tls-ca ($PWCTL_TLS_CA), the config file's
"tls_ca", then the copy `pwctl up`/`server start` left in the data directory (`tls-ca.pem`); none:
plaintext. A client certificate (mutual TLS) from $PWCTL_TLS_CERT/$PWCTL_TLS_KEY, "tls_cert"/
"tls_key", then the data directory's `tls-client.pem`/`.key`; the name to check in the server's
certificate instead of the dialled host from $PWCTL_TLS_SERVER_NAME, "tls_server_name", then
the data directory's `tls-server-name`.

A client's settings are all PWCTL_* (PWCTL_SERVER, PWCTL_TOKEN, PWCTL_TLS_{CA,CERT,KEY,SERVER_NAME}),
a server's PATHWAYS_TLS_* (pwctl/tls.py). A client also takes the servers' $PATHWAYS_TLS_SERVER_NAME
where $PWCTL_TLS_SERVER_NAME is unset: clients read it before, and a client in a server's pod
(deploy/kubernetes/) finds the cluster's name there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from . import paths
from .errors import InvalidArgument
from .tls import ENV_SERVER_NAME as SERVER_ENV_SERVER_NAME
from .tls import TlsConfig

ENV_CA = "PWCTL_TLS_CA"
ENV_CERT = "PWCTL_TLS_CERT"
ENV_KEY = "PWCTL_TLS_KEY"
ENV_SERVER_NAME = "PWCTL_TLS_SERVER_NAME"  # the servers' name ($PATHWAYS_TLS_SERVER_NAME) as its alias


@dataclass(frozen=True)
class Target:
    address: str
    token: str | None
    tls: TlsConfig | None = None


CONFIG_KEYS = ("server", "token", "tls_ca", "tls_cert", "tls_key", "tls_server_name")


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


def local_controller() -> str | None:
    """The address of the controller this data directory's pid file names, while that process
    lives (one `pwctl up` or `pwctl server start` started here, on any --listen); a wildcard
    host (0.0.0.0, ::) is dialled at 127.0.0.1. None: no such controller."""
    try:
        info = json.loads(paths.server_pid_path().read_text())
        pid, address = int(info["pid"]), str(info["address"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return f"{'127.0.0.1' if host in ('0.0.0.0', '::', '[::]', '') else host}:{port}"


def checked_address(address: str, source: str) -> str:
    """An address the user gave (`source` says where): HOST:PORT, else InvalidArgument (exit 2),
    not a connection that fails as "cannot reach the server" (a typo, a port left out, grpc://)."""
    try:
        host, port = paths.split_address(address)
    except ValueError as e:
        raise InvalidArgument(f"{source}: {e}") from None
    if "://" in host or not 0 < port < 65536:
        raise InvalidArgument(f"{source}: invalid address {address!r}: expected HOST:PORT with no scheme, "
                              "e.g. 127.0.0.1:7070")
    return address


def resolve(server: str | None = None, token: str | None = None) -> Target:
    cfg = _config()
    given = ((server, "--server"), (os.environ.get("PWCTL_SERVER"), "PWCTL_SERVER"),
             (cfg.get("server"), f"\"server\" in {paths.data_dir() / 'config.json'}"))
    address = next((checked_address(a, source) for a, source in given if a), None)
    address = address or local_controller() or paths.DEFAULT_ADDRESS
    tok = token or os.environ.get("PWCTL_TOKEN") or cfg.get("token")
    return Target(address=address, token=tok or paths.read_token(), tls=resolve_tls(cfg))


def _existing(path: os.PathLike[str]) -> str | None:
    return str(path) if os.path.exists(path) else None


def resolve_tls(cfg: dict[str, str] | None = None) -> TlsConfig | None:
    """The client's TLS settings (the order in the module's docstring); None: plaintext."""
    cfg = _config() if cfg is None else cfg
    env = os.environ
    ca = env.get(ENV_CA) or cfg.get("tls_ca") or _existing(paths.tls_ca_path())
    if not ca:
        return None
    cert = env.get(ENV_CERT) or cfg.get("tls_cert")
    key = env.get(ENV_KEY) or cfg.get("tls_key")
    if not cert and not key:  # the data directory's pair, where both are there
        cert, key = _existing(paths.tls_client_cert_path()), _existing(paths.tls_client_key_path())
        cert, key = (cert, key) if cert and key else (None, None)
    name = (env.get(ENV_SERVER_NAME) or env.get(SERVER_ENV_SERVER_NAME) or cfg.get("tls_server_name")
            or paths.read_tls_server_name())
    try:
        return TlsConfig(ca=ca, cert=cert, key=key, server_name=name or "")
    except InvalidArgument as e:  # name the client-side settings, not the servers' flags
        raise InvalidArgument(str(e).replace("--tls-ca", "the CA bundle (PWCTL_TLS_CA)").replace(
            "--tls-cert", "PWCTL_TLS_CERT").replace("--tls-key", "PWCTL_TLS_KEY")) from None
