"""Worker process settings."""

from __future__ import annotations

from dataclasses import dataclass

from pwctl.tls import TlsConfig


@dataclass
class WorkerConfig:
    server: str
    island: str
    devices: str  # a count of virtual CPU devices, or "all" (every accelerator found)
    name: str
    listen: str = "127.0.0.1:0"
    token: str | None = None
    check_token: bool = True  # False (--no-token): callers need no token (credentials still checked)
    reconnect_max_s: float = 2.0
    unload_after_s: float = 60.0  # compiled programs not run this long are unloaded when idle (0: never)
    health_listen: str = ""  # HOST:PORT answering the health service alone, plaintext (server/health.py)
    tls: TlsConfig | None = None  # serve TLS only; reach the controller and peers over TLS (pwctl/tls.py)
