"""The committed gRPC stubs are what `scripts/gen_protos.py` generates from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh() -> None:
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_protos.py"), "--check"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"stale stubs: run `python scripts/gen_protos.py`\n{r.stdout}{r.stderr}"
