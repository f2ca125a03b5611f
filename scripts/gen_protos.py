"""Generate the Python stubs for the wire contract.

The one way stubs are made: `python scripts/gen_protos.py`. It compiles every
`schemas/pathways/v1/*.proto` into `*_pb2.py`, `*_pb2_grpc.py` and typed `.pyi`
files beside them. `--check` regenerates into a temporary folder and exits 1 when
the committed stubs differ (tests/test_protos.py runs it).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "schemas" / "pathways" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi", "_pb2_grpc.pyi")


def generate(out_root: Path) -> None:
    from grpc_tools import protoc  # imported here: only needed to regenerate

    protos = sorted(str(p.relative_to(ROOT)) for p in PROTO_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    bindir = Path(sys.executable).parent
    args = [
        "protoc",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def generated_files(root: Path) -> list[Path]:
    folder = root / "schemas" / "pathways" / "v1"
    return sorted(p for p in folder.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    ns = parser.parse_args()
    if not ns.check:
        generate(ROOT)
        print(f"generated {len(generated_files(ROOT))} files in {PROTO_DIR.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "schemas" / "pathways" / "v1").mkdir(parents=True)
        generate(out)
        fresh = {p.name: p for p in generated_files(out)}
        have = {p.name: p for p in generated_files(ROOT)}
        stale = sorted(set(fresh) ^ set(have))
        stale += [n for n in sorted(set(fresh) & set(have)) if not filecmp.cmp(fresh[n], have[n], shallow=False)]
        if stale:
            print("stale generated stubs: " + ", ".join(stale) + "; run python scripts/gen_protos.py")
            return 1
        print("stubs are up to date")
        return 0


if __name__ == "__main__":
    sys.exit(main())
