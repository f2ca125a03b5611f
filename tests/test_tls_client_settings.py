"""A client's TLS settings (pwctl/settings.py): all PWCTL_*, as PWCTL_SERVER and PWCTL_TOKEN; the
servers' PATHWAYS_TLS_SERVER_NAME still names the server name to check where PWCTL_TLS_SERVER_NAME
is unset (clients read it before); a job's driver gets the client names."""

from __future__ import annotations

from pathlib import Path

import pytest
from tlscerts import Cert, make_ca, make_cert

from pwctl import settings, tls
from server.controller.job_process import driver_env


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Cert:
    return make_ca(tmp_path_factory.mktemp("tls-names"))


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

