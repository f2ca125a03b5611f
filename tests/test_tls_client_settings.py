"""A client's TLS settings (pwctl/settings.py): all PWCTL_*, as PWCTL_SERVER and PWCTL_TOKEN; the
servers' PATHWAYS_TLS_SERVER_NAME still names the server name to check where PWCTL_TLS_SERVER_NAME
is unset (clients read it before); a job's driver gets the client names. Under mutual TLS a
cluster started here leaves local clients a certificate of their own (--tls-client-cert), never
a copy of the server's key (pwctl/local/tlsfiles.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import base_env, free_port, run_pwctl
from tlscerts import Cert, make_ca, make_cert

from pwctl import settings, tls
from pwctl.local import tlsfiles
from server.controller.job_process import driver_env


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Cert:
    return make_ca(tmp_path_factory.mktemp("tls-names"))


@pytest.fixture(scope="module")
def pair(ca: Cert, tmp_path_factory: pytest.TempPathFactory) -> tuple[Cert, Cert]:
    """(this host's certificate, the local clients' own), both signed by `ca`."""
    folder = tmp_path_factory.mktemp("tls-pair")
    return make_cert(ca, folder, "host", ["127.0.0.1"]), make_cert(ca, folder, "local", ["local.client"])


def _copies_of(secret: Path, folder: Path) -> list[Path]:
    data = secret.read_bytes()
    return [p for p in folder.rglob("*") if p.is_file() and p.read_bytes() == data]


@pytest.mark.parametrize(("new", "old", "checked"), [
    ("ctl.cluster", None, "ctl.cluster"),  # the client's own name
    (None, "pods.cluster", "pods.cluster"),  # the servers' name, as before
    ("ctl.cluster", "pods.cluster", "ctl.cluster"),  # both: the client's wins
])
def test_a_client_checks_the_server_name_its_own_variable_or_the_servers_names(
        ca: Cert, pw_home: Path, monkeypatch: pytest.MonkeyPatch, new: str | None, old: str | None,
        checked: str) -> None:
    monkeypatch.setenv("PWCTL_TLS_CA", str(ca.cert))
    for name, value in (("PWCTL_TLS_SERVER_NAME", new), ("PATHWAYS_TLS_SERVER_NAME", old)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    found = settings.resolve_tls()
    assert found is not None and found.server_name == checked


def test_a_jobs_driver_gets_the_client_variables(ca: Cert, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PATHWAYS_TLS_SERVER_NAME", raising=False)
    host = make_cert(ca, tmp_path, "host", ["127.0.0.1"])
    config = tls.TlsConfig(ca=str(ca.cert), cert=str(host.cert), key=str(host.key), server_name="ctl.cluster")
    env = driver_env("j1", 0, 1.0, "127.0.0.1:7070", "tok", tmp_path, tls=config)
    assert env["PWCTL_TLS_CA"] == str(ca.cert) and env["PWCTL_TLS_SERVER_NAME"] == "ctl.cluster", env
    assert "PATHWAYS_TLS_SERVER_NAME" not in env


def test_mutual_tls_leaves_no_copy_of_the_servers_key_for_clients(ca: Cert, pair: tuple[Cert, Cert],
                                                                 pw_home: Path) -> None:
    """Without a local clients' pair, nothing is left for clients to present (they are told to
    bring their own); with one, that one, and neither time the server's key."""
    host, local = pair
    config = tls.server_config(str(host.cert), str(host.key), str(ca.cert), require_client_cert=True)
    tlsfiles.publish(config)
    assert (pw_home / "tls-ca.pem").exists() and not (pw_home / "tls-client.pem").exists()
    assert not (pw_home / "tls-client.key").exists() and not _copies_of(host.key, pw_home)
    tlsfiles.publish(config, tlsfiles.client_pair(config, str(local.cert), str(local.key)))
    assert (pw_home / "tls-client.pem").read_bytes() == local.cert.read_bytes()
    assert (pw_home / "tls-client.key").read_bytes() == local.key.read_bytes()
    assert not _copies_of(host.key, pw_home)
    found = settings.resolve_tls()
    assert found is not None and found.cert == str(pw_home / "tls-client.pem")


@pytest.mark.parametrize(("flags", "said"), [
    (["--tls-client-cert", "HOST_CERT", "--tls-client-key", "HOST_KEY"], "that is the server's own certificate"),
    (["--tls-client-cert", "LOCAL_CERT"], "go together"),
    (["--tls-client-cert", "LOCAL_CERT", "--tls-client-key", "HOST_KEY"], "--tls-client-key"),
])
def test_a_wrong_local_clients_pair_is_refused_in_one_line(ca: Cert, pair: tuple[Cert, Cert], pw_home: Path,
                                                          flags: list[str], said: str) -> None:
    host, local = pair
    names = {"HOST_CERT": host.cert, "HOST_KEY": host.key, "LOCAL_CERT": local.cert}
    r = run_pwctl("up", "--islands", "1", "--devices", "1", "--listen", f"127.0.0.1:{free_port()}",
                  "--tls-cert", str(host.cert), "--tls-key", str(host.key), "--tls-ca", str(ca.cert),
                  "--tls-require-client-cert", *(str(names.get(f, f)) for f in flags), env=base_env(pw_home))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and said in lines[0], r.stderr
    assert not (pw_home / "server.pid").exists() and not _copies_of(host.key, pw_home)


def test_mutual_tls_up_gives_local_clients_their_own_certificate_which_is_accepted(
        ca: Cert, pair: tuple[Cert, Cert], pw_home: Path) -> None:
    host, local = pair
    address = f"127.0.0.1:{free_port()}"
    env = base_env(pw_home, PWCTL_SERVER=address)
    r = run_pwctl("up", "--islands", "1", "--devices", "1", "--listen", address, "--tls-cert", str(host.cert),
                  "--tls-key", str(host.key), "--tls-ca", str(ca.cert), "--tls-require-client-cert",
                  "--tls-client-cert", str(local.cert), "--tls-client-key", str(local.key), env=env, timeout=120)
    try:
        assert r.returncode == 0 and "(TLS)" in r.stdout, r.stderr
        assert (pw_home / "tls-client.pem").read_bytes() == local.cert.read_bytes() != host.cert.read_bytes()
        assert not _copies_of(host.key, pw_home)
        # no PWCTL_TLS_*: the data directory's CA and pair, which the controller requires and takes
        ok = run_pwctl("island", "list", "-o", "name", env=env)
        assert ok.returncode == 0 and ok.stdout.split() == ["a"], ok.stderr
    finally:
        down = run_pwctl("down", "-y", env=env, timeout=60)
    assert down.returncode == 0, down.stderr


def test_a_jobs_driver_presents_the_local_clients_pair_where_one_was_left(
        ca: Cert, pair: tuple[Cert, Cert], pw_home: Path) -> None:
    host, local = pair
    config = tls.server_config(str(host.cert), str(host.key), str(ca.cert), require_client_cert=True)
    assert config is not None
    tlsfiles.publish(config)  # none left: the controller's own, as before (the driver runs beside it)
    env = driver_env("j1", 0, 1.0, "127.0.0.1:7070", "tok", pw_home, tls=config)
    assert (env["PWCTL_TLS_CERT"], env["PWCTL_TLS_KEY"]) == (str(host.cert), str(host.key))
    tlsfiles.publish(config, tlsfiles.client_pair(config, str(local.cert), str(local.key)))
    env = driver_env("j1", 0, 1.0, "127.0.0.1:7070", "tok", pw_home, tls=config)
    assert (env["PWCTL_TLS_CERT"], env["PWCTL_TLS_KEY"]) == (str(pw_home / "tls-client.pem"),
                                                             str(pw_home / "tls-client.key"))
