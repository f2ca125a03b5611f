"""TLS on every link (pwctl/tls.py; README.md, "TLS"), with a throwaway CA made by `openssl`
(tests/tlscerts.py).

(a) `pwctl up` with TLS on loopback: listings, a `pw` program whose array crosses islands by the
(TLS) TCP link, a `pwctl submit` job and an unmodified JAX one (`--proxy`) all work, and `up` run
again keeps TLS; a plaintext client, one trusting another CA and one checking another name each
get one line saying so (exit 1), and the cluster keeps serving with no traceback logged;
(b) mutual TLS: a client without a certificate is refused with one line
saying it needs one, one with a certificate the CA signs works, a worker trusting another CA
never registers and logs why, an unmodified JAX program reaches it through the plugin's TLS bridge
(pwctl/tlsbridge.py), and `--health-listen` answers the health service alone, plaintext;
(c) bad settings are one line and exit 2, before anything starts; (d) on separate hosts
(network namespaces, tests/hosts.py) with per-host IP-SAN certificates, workers on two hosts
register over TLS and a program's array crosses from one host to the other by the TLS TCP link;
(e) the proxy bridge moves bytes unchanged both ways against a real TLS server; (f) a certificate
naming one cluster-wide name works by the server-name override, and says so without it.
"""

from __future__ import annotations

import http.client
import json
import re
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import REPO, LocalCluster, base_env, free_port, run_pwctl, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hosts import hosts, start_controller  # noqa: F401  (the fixture)
from proxy_env import proxy_env
from tlscerts import Cert, make_ca, make_cert
from together import together

from pwctl import tls
from pwctl.errors import InvalidArgument
from pwctl.local import tlsfiles
from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc

pytestmark = pytest.mark.timeout(180)

# a's slice doubles, b's adds one: b(a(x)) sends a's output from island a's worker to b's
PROGRAM = """
import json, numpy as np, pwctl as pw
vds = pw.make_virtual_device_set()
a, b = vds.add_slice(devices=1, island="a"), vds.add_slice(devices=1, island="b")
twice = pw.pmap(lambda v: v * 2.0, devices=a.devices)
plus = pw.pmap(lambda v: v + 1.0, devices=b.devices)
x = np.arange(300_000, dtype=np.float32).reshape(1, -1)
print(json.dumps({"exact": bool(np.array_equal(np.asarray(plus(twice(x))), x * 2.0 + 1.0))}))
"""


JAX_PROGRAM = """
import jax, numpy as np
x = jax.device_put(np.arange(3, dtype=np.float32))
big = np.arange(3 << 20, dtype=np.float32)  # 12 MiB up and back (streamed: a staged upload, a download)
print(np.asarray(jax.jit(lambda v: v + 1)(x)).tolist(), np.array_equal(np.asarray(jax.jit(lambda v: v * 2)(
    jax.device_put(big))), big * 2))
"""


class Certs:
    def __init__(self, folder: Path) -> None:
        self.ca = make_ca(folder)
        self.host = make_cert(self.ca, folder, "host", ["127.0.0.1", "localhost"])
        self.client = make_cert(self.ca, folder, "client", ["client.example"])
        self.named = make_cert(self.ca, folder, "named", ["pathways.cluster"])  # one cluster-wide name
        self.other = make_ca(folder, "other")  # a CA that signs none of them


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return Certs(tmp_path_factory.mktemp("tls"))


def one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 1, one line on stderr (no gRPC log lines, no traceback) containing every needle."""
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for needle in needles:
        assert needle in lines[0], r.stderr


def server_flags(cert: Cert, ca: Cert) -> list[str]:
    return ["--tls-cert", str(cert.cert), "--tls-key", str(cert.key), "--tls-ca", str(ca.cert)]


def scrape_over_https(url: str, token: str, ca: Path) -> None:
    """The Prometheus endpoint of a TLS controller is HTTPS with its certificate: a scrape
    trusting the CA gets the metrics; plain HTTP, or a scrape trusting no CA, gets none."""
    assert url.startswith("https://127.0.0.1:"), url
    auth = {"Authorization": f"Bearer {token}"}
    with urllib.request.urlopen(urllib.request.Request(url, headers=auth), timeout=10,
                                context=ssl.create_default_context(cafile=str(ca))) as resp:
        assert resp.status == 200 and b"pathways_uptime_seconds" in resp.read()
    with pytest.raises(urllib.error.URLError) as e:  # the system's CAs do not sign the cluster's certificate
        urllib.request.urlopen(urllib.request.Request(url, headers=auth), timeout=10)
    assert "CERTIFICATE_VERIFY_FAILED" in str(e.value)
    with pytest.raises((ConnectionError, http.client.HTTPException, urllib.error.URLError)):
        urllib.request.urlopen(urllib.request.Request(url.replace("https://", "http://"), headers=auth), timeout=10)


def test_up_with_tls_serves_only_tls_and_says_why_a_client_fails(certs: Certs, pw_home: Path, tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    # PATHWAYS_TRANSFER=tcp (inherited by the workers): islands a and b send by the TCP link, as between hosts
    env = base_env(pw_home, PWCTL_SERVER=address, PATHWAYS_TRANSFER="tcp")
    r = run_pwctl("up", "--islands", "2", "--devices", "1", "--listen", address,
                  *server_flags(certs.host, certs.ca), env=env, timeout=120)
    try:
        assert r.returncode == 0, r.stderr
        assert "(TLS)" in r.stdout
        assert (pw_home / "tls-ca.pem").read_bytes() == certs.ca.cert.read_bytes()  # where clients find it
        assert not (pw_home / "tls-client.pem").exists()  # no mutual TLS: no client certificate left
        islands = json.loads(run_pwctl("island", "list", "-o", "json", env=env).stdout)
        assert [i["name"] for i in islands["items"]] == ["a", "b"]
        scrape_over_https(json.loads(run_pwctl("server", "info", "-o", "json", env=env).stdout)["item"]["metrics_url"],
                          (pw_home / "token").read_text().strip(), certs.ca.cert)

        # a `pw` program: the client to the controller and the workers, worker to worker by the TCP link
        prog = tmp_path / "prog.py"
        prog.write_text(PROGRAM)
        out = subprocess.run([sys.executable, str(prog)], env=env, capture_output=True, text=True, timeout=90,
                             cwd=tmp_path)
        assert out.returncode == 0 and json.loads(out.stdout.splitlines()[-1]) == {"exact": True}, out.stderr[-3000:]
        sender = (pw_home / "logs" / "worker-local-a.log").read_text()
        assert re.search(r"first transfer to 127\.0\.0\.1:\d+ by TCP link", sender), sender[-3000:]
        # `up` again without the flags: the worker it starts again joins with the cluster's TLS
        assert run_pwctl("worker", "stop", "local-b", env=env).returncode == 0
        again = run_pwctl("up", "--islands", "2", "--devices", "1", "--listen", address, env=env, timeout=120)
        assert again.returncode == 0 and "(TLS)" in again.stdout, again.stdout + again.stderr
        # a job's driver finds the CA too (the controller passes it on)
        job = run_pwctl("submit", str(prog), env=env, timeout=90)
        assert job.returncode == 0 and '{"exact": true}' in job.stdout, job.stdout + job.stderr
        # and an unmodified JAX program as a job (`--proxy`): its driver reaches the controller by the bridge
        jax_prog = tmp_path / "unmodified.py"
        jax_prog.write_text(JAX_PROGRAM)
        job = run_pwctl("submit", str(jax_prog), "--proxy", "--devices", "1", env=env, timeout=120)
        assert job.returncode == 0 and "[1.0, 2.0, 3.0] True" in job.stdout, job.stdout + job.stderr

        token = (pw_home / "token").read_text().strip()
        elsewhere = tmp_path / "elsewhere"  # a client with no data directory of the cluster's
        elsewhere.mkdir()
        plain = base_env(elsewhere, PWCTL_SERVER=address, PWCTL_TOKEN=token)
        one_line_error(run_pwctl("island", "list", env=plain), "requires TLS", "PWCTL_TLS_CA")
        one_line_error(run_pwctl("island", "list", env={**plain, "PWCTL_TLS_CA": str(certs.other.cert)}),
                       "does not sign", str(certs.other.cert))
        one_line_error(run_pwctl("island", "list", env={**plain, "PWCTL_TLS_CA": str(certs.ca.cert),
                                                        "PWCTL_TLS_SERVER_NAME": "pathways.cluster"}),
                       "does not name", "PWCTL_TLS_SERVER_NAME")
        # `--tls-ca` names the CA as PWCTL_TLS_CA does
        ok = run_pwctl("--tls-ca", str(certs.ca.cert), "island", "list", "-o", "name", env=plain)
        assert ok.returncode == 0 and ok.stdout.split() == ["a", "b"], ok.stderr
        log = (pw_home / "server.log").read_text()
        assert "Traceback" not in log, log[-3000:]
    finally:
        down = run_pwctl("down", "-y", env=env, timeout=60)
    assert down.returncode == 0, down.stderr


def test_mutual_tls_refuses_a_client_without_certificate(certs: Certs, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # the workers take their TLS from PATHWAYS_TLS_* (the flags' defaults), the controller from flags
    worker_env = {"PATHWAYS_TLS_CERT": str(certs.host.cert), "PATHWAYS_TLS_KEY": str(certs.host.key),
                  "PATHWAYS_TLS_CA": str(certs.ca.cert), "PATHWAYS_TLS_REQUIRE_CLIENT_CERT": "1",
                  "PATHWAYS_TRANSFER": "tcp"}  # worker to worker by the TCP link, as between hosts
    client = {"PWCTL_TLS_CA": str(certs.ca.cert), "PWCTL_TLS_CERT": str(certs.client.cert),
              "PWCTL_TLS_KEY": str(certs.client.key)}
    for k, v in client.items():  # this process's clients (the fixture's readiness checks)
        monkeypatch.setenv(k, v)
    health = f"127.0.0.1:{free_port()}"  # the plaintext health port (Kubernetes' grpc probes)
    flags = [*server_flags(certs.host, certs.ca), "--tls-require-client-cert", "--health-listen", health]
    with LocalCluster(tmp_path / "c", controller_args=flags, worker_env=worker_env) as c:
        c.start([("a", 2), ("b", 1)])
        assert c.pwctl("island", "list", "-o", "name").stdout.split() == ["a", "b"]
        with grpc.insecure_channel(health) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as refused:  # that port serves nothing else
                cgrpc.ControllerStub(ch).GetInfo(cpb.GetInfoRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        basics = subprocess.run([sys.executable, str(REPO / "tests" / "clients" / "basics.py")], env=c.env(),
                                capture_output=True, text=True, timeout=90, cwd=REPO / "tests" / "clients")
        assert basics.returncode == 0 and json.loads(basics.stdout.splitlines()[-1])["loop"] == [2048.0, 2048.0], \
            basics.stderr[-3000:]
        # a's output to b's worker by the TCP link, each end checking the other's certificate
        prog = tmp_path / "prog.py"
        prog.write_text(PROGRAM)
        out = subprocess.run([sys.executable, str(prog)], env=c.env(), capture_output=True, text=True, timeout=90,
                             cwd=tmp_path)
        assert out.returncode == 0 and json.loads(out.stdout.splitlines()[-1]) == {"exact": True}, out.stderr[-3000:]
        assert re.search(r"first transfer to \S+ by TCP link", c.workers["w-a"].log.read_text())
        no_cert = c.env(PWCTL_TLS_CERT="", PWCTL_TLS_KEY="")
        one_line_error(c.pwctl("island", "list", env=no_cert), "requires a client certificate", "PWCTL_TLS_CERT")
        plain = {k: v for k, v in c.env().items() if not k.startswith("PWCTL_TLS_")}
        one_line_error(c.pwctl("island", "list", env=plain), "requires TLS with a client certificate")
        # an unmodified JAX program (JAX_PLATFORMS=proxy): the jaxlib client has no TLS, so the plugin
        # bridges it over TLS, presenting the client certificate; the proxy service reaches the
        # worker over mutual TLS with the controller's certificate
        ok, wrong = (subprocess.run([sys.executable, "-c", JAX_PROGRAM], capture_output=True, text=True, timeout=120,
                                    env=proxy_env(c, tmp_path, **{**client, **extra}))
                     for extra in ({}, {"PWCTL_TLS_CA": str(certs.other.cert)}))
        assert ok.returncode == 0 and ok.stdout.split() == ["[1.0,", "2.0,", "3.0]", "True"], ok.stderr[-3000:]
        # on gRPC: a cluster with TLS keeps the proxy's bulk bytes there (server/proxy/bulk.py)
        assert not any("bulk connection from" in w.log.read_text() for w in c.workers.values())
        assert wrong.returncode != 0 and "does not sign" in wrong.stderr.strip().splitlines()[-1], wrong.stderr[-3000:]
        # a worker trusting another CA: refused by its own check of the controller, says so, never registers
        w = c.add_worker("c", 1, wait=False, env={"PATHWAYS_TLS_CA": str(certs.other.cert)})
        wait_for(lambda: "does not sign" in w.log.read_text(), 60, "the worker's TLS error")
        assert "c" not in c.pwctl("island", "list", "-o", "name").stdout.split()
        assert c.controller is not None and c.controller.poll() is None
        assert "Traceback" not in c.controller_logs()


def test_bad_settings_are_one_line(certs: Certs, pw_home: Path, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    for kwargs, needle in (({"cert": str(certs.host.cert)}, "go together"),
                           ({"cert": str(certs.host.cert), "key": str(certs.host.key)}, "needs --tls-ca"),
                           ({"require_client_cert": True}, "needs --tls-cert"),
                           ({"cert": str(tmp_path / "nope.pem"), "key": str(certs.host.key), "ca": str(certs.ca.cert)},
                            "cannot read"),
                           ({"cert": str(certs.host.key.with_suffix(".ext")), "key": str(certs.host.key),
                             "ca": str(certs.ca.cert)}, "not a PEM file"),
                           # files gRPC would take, and fail on only when serving ('cannot listen')
                           ({"cert": str(certs.host.cert), "key": str(certs.client.key), "ca": str(certs.ca.cert)},
                            "is not the private key of --tls-cert"),
                           ({"cert": str(certs.host.cert), "key": str(certs.host.cert), "ca": str(certs.ca.cert)},
                            "are not a certificate and its unencrypted private key"),
                           ({"cert": str(certs.host.cert), "key": str(certs.host.key), "ca": str(garbage)},
                            "--tls-ca: no usable certificate")):
        with pytest.raises(InvalidArgument, match=needle):
            tls.server_config(**kwargs)  # type: ignore[arg-type]
    assert tls.server_config() is None  # off unless configured
    env = base_env(pw_home)
    r = run_pwctl("up", "--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(certs.host.key), env=env)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --tls-cert: cannot read"), r.stderr
    assert not (pw_home / "server.pid").exists()
    r = subprocess.run([sys.executable, "-m", "server.controller", "--tls-cert", str(certs.host.cert)], env=env,
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "go together" in r.stderr.splitlines()[-1], r.stderr
    r = run_pwctl("island", "list", env={**env, "PWCTL_TLS_CA": str(tmp_path / "nope.pem")})
    assert r.returncode == 2 and "cannot read" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    mismatched = Cert(certs.host.cert, certs.client.key)
    r = subprocess.run([sys.executable, "-m", "server.controller", *server_flags(mismatched, certs.ca)],
                       env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "is not the private key" in r.stderr.splitlines()[-1], r.stderr
    r = run_pwctl("island", "list", env={**env, "PWCTL_TLS_CA": str(certs.ca.cert), "PWCTL_TLS_CERT":
                                         str(certs.client.cert), "PWCTL_TLS_KEY": str(certs.host.key)})
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "PWCTL_TLS_KEY" in r.stderr and "is not the private key of PWCTL_TLS_CERT" in r.stderr, r.stderr


def test_a_plaintext_start_removes_the_tls_files_clients_would_use(certs: Certs, pw_home: Path) -> None:
    config = tls.server_config(str(certs.host.cert), str(certs.host.key), str(certs.ca.cert), "pathways.cluster",
                               require_client_cert=True)
    tlsfiles.publish(config, tlsfiles.client_pair(config, str(certs.client.cert), str(certs.client.key)))
    names = {"tls-ca.pem", "tls-client.pem", "tls-client.key", "tls-server-name"}
    assert names <= {p.name for p in pw_home.iterdir()}
    from pwctl import settings

    found = settings.resolve_tls()
    assert found is not None and found.has_cert and found.server_name == "pathways.cluster"
    tlsfiles.publish(None)
    assert not names & {p.name for p in pw_home.iterdir()}
    assert settings.resolve_tls() is None



HOSTS_PROGRAM = PROGRAM.replace('island="a"', 'island="h1"').replace('island="b"', 'island="h2"')


@pytest.mark.timeout(240)
def test_workers_on_two_hosts_over_tls(hosts: Any, certs: Certs, tmp_path: Path) -> None:  # noqa: F811
    hs = hosts(3)
    mine = [make_cert(certs.ca, tmp_path / "certs", f"h{i}", [h.ip]) for i, h in enumerate(hs)]  # IP SANs
    address, token = start_controller(hs[0], 3.0, 0, *server_flags(mine[0], certs.ca))

    def start_worker(i: int) -> None:
        h = hs[i]
        r = h.pwctl("worker", "start", "--island", f"h{i}", "--devices", "1", "--name", f"w{i}",
                    "--listen", f"{h.ip}:0", "--server", address, *server_flags(mine[i], certs.ca),
                    PWCTL_TOKEN=token)
        assert r.returncode == 0, f"worker start on {h.hostname}: {r.stdout}{r.stderr}"

    together(lambda: start_worker(1), lambda: start_worker(2), at_once=2)
    prog = tmp_path / "prog.py"
    prog.write_text(HOSTS_PROGRAM)
    # host 0's client finds the CA where `pwctl server start` left it (its data directory)
    r = hs[0].run([sys.executable, str(prog)], timeout=120, PWCTL_SERVER=address, PWCTL_TOKEN=token,
                  PYTHONPATH=str(REPO))  # this checkout, not an installed one
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1]) == {"exact": True}, r.stdout + r.stderr
    sender = (hs[1].home / "logs" / "worker-w1.log").read_text(errors="replace")
    assert re.search(rf"first transfer to {re.escape(hs[2].ip)}:\d+ by TCP link", sender), sender[-3000:]
    assert "(TLS)" in sender  # it served TLS only
    # from host 2, a plaintext client of the controller is told it needs the CA
    r = hs[2].pwctl("island", "list", PWCTL_SERVER=address, PWCTL_TOKEN=token)
    one_line_error(r, "requires TLS")


@pytest.mark.timeout(60)
def test_the_proxy_bridge_forwards_bytes_both_ways_over_tls(certs: Certs) -> None:
    """pwctl/tlsbridge.py against a real TLS server (Python's ssl, the host certificate): 8 MiB go
    through unchanged both ways, the server's end reaches the client as its end of stream, and the
    handshake check turns another CA or a plaintext server into one line."""
    import contextlib
    import socket
    import ssl
    import threading

    from pwctl import tlsbridge
    from pwctl.errors import ConnectionFailed

    payload = bytes(range(256)) * (8 * 4096)  # 8 MiB
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs.host.cert, certs.host.key)
    ctx.set_alpn_protocols(["h2"])
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[str] = []

    def serve() -> None:  # reads the payload, answers it reversed, closes
        conn, _ = listener.accept()
        with ctx.wrap_socket(conn, server_side=True) as tls_conn:
            got.append(str(tls_conn.selected_alpn_protocol()))
            buf = bytearray()
            while len(buf) < len(payload):
                chunk = tls_conn.recv(1 << 20)
                if not chunk:
                    break
                buf += chunk
            tls_conn.sendall(bytes(reversed(buf)))

    threading.Thread(target=serve, daemon=True).start()
    port = listener.getsockname()[1]
    config = tls.TlsConfig(ca=str(certs.ca.cert))
    b = tlsbridge.Bridge("127.0.0.1", port, config)
    try:
        with tlsbridge.connect_local(b.address, timeout=30) as s:
            s.sendall(payload)
            back = bytearray()
            while chunk := s.recv(1 << 20):
                back += chunk
        assert bytes(back) == payload[::-1]
        assert got == ["h2"]
    finally:
        b.close()
        listener.close()

    other = tls.TlsConfig(ca=str(certs.other.cert))
    with socket.create_server(("127.0.0.1", 0)) as again:
        def refused_handshake() -> None:  # the client refuses this certificate: the server's handshake fails
            with contextlib.suppress(OSError):
                ctx.wrap_socket(again.accept()[0], server_side=True)

        threading.Thread(target=refused_handshake, daemon=True).start()
        with pytest.raises(ConnectionFailed, match="does not sign"):
            tlsbridge.bridge("127.0.0.1", again.getsockname()[1], other)
    with socket.create_server(("127.0.0.1", 0)) as plain:
        def answer_plaintext() -> None:
            conn, _ = plain.accept()
            conn.recv(4096)
            conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00" + bytes(18))  # an HTTP/2 SETTINGS frame
            conn.close()

        threading.Thread(target=answer_plaintext, daemon=True).start()
        with pytest.raises(ConnectionFailed, match="does not speak TLS"):
            tlsbridge.bridge("127.0.0.1", plain.getsockname()[1], config)


@pytest.mark.timeout(60)
def test_one_cluster_name_for_every_certificate(certs: Certs) -> None:
    """A server whose certificate names only `pathways.cluster` (no IP): dialled by IP, the client
    says the certificate does not name the address and how to fix it; with the server-name
    override it connects. The server's port is made by `tls.add_port`, the client's channel by
    `pwctl.transport`, as everywhere."""
    from concurrent import futures

    from grpc_health.v1 import health

    from pwctl.errors import Unavailable
    from pwctl.transport import NO_RETRY, Transport

    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    config = tls.server_config(str(certs.named.cert), str(certs.named.key), str(certs.ca.cert))
    port = tls.add_port(server, "127.0.0.1:0", config)
    assert port > 0
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        ask = health_pb2.HealthCheckRequest()
        for name, ok in (("", False), ("pathways.cluster", True)):
            config = tls.TlsConfig(ca=str(certs.ca.cert), server_name=name)
            t = Transport(address, timeout=5, retry=NO_RETRY, tls=config)
            try:
                call = health_pb2_grpc.HealthStub(t.channel).Check
                if ok:
                    assert t.unary(call, ask).status == health_pb2.HealthCheckResponse.SERVING
                else:
                    with pytest.raises(Unavailable, match=r"does not name 127\.0\.0\.1.*PWCTL_TLS_SERVER_NAME"):
                        t.unary(call, ask)
            finally:
                t.close()
    finally:
        server.stop(None)
