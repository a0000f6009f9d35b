"""Generate the Python code for every `.proto` under protos/ into services/<service>/v1/.

    python -m cotserve.common.protogen            # what `make protos` runs
    python -m cotserve.common.protogen --check    # exit 1 when the committed code is stale

Needs the dev extra (grpcio-tools, mypy-protobuf). Output is deterministic, so the test suite
regenerates into a temporary folder and compares byte for byte.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "protos"
PACKAGE_ROOT = ROOT / "services"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("cotserve/*/v1/*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into `out_dir/cotserve/...`; return the generated files relative to `out_dir/cotserve`."""
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{PROTO_ROOT}", f"-I{include}",
        f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}", f"--mypy_grpc_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    subprocess.run(cmd, check=True, cwd=PROTO_ROOT)
    base = out_dir / "cotserve"
    return sorted(p.relative_to(base) for p in base.rglob("*") if p.name.endswith(GENERATED_SUFFIXES))


def committed() -> list[Path]:
    return sorted(
        p.relative_to(PACKAGE_ROOT)
        for p in PACKAGE_ROOT.glob("*/v1/*")
        if p.name.endswith(GENERATED_SUFFIXES)
    )


def stale_files() -> list[str]:
    """Generated files that differ from, or are missing in, or are extra in the package."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        problems = [f"missing: services/{p}" for p in fresh if not (PACKAGE_ROOT / p).exists()]
        problems += [f"extra: services/{p}" for p in committed() if p not in fresh]
        problems += [
            f"out of date: services/{p}"
            for p in fresh
            if (PACKAGE_ROOT / p).exists() and not filecmp.cmp(Path(tmp) / "cotserve" / p, PACKAGE_ROOT / p, shallow=False)
        ]
        return problems


def main() -> None:
    ap = argparse.ArgumentParser(description="Generate Python code from protos/.")
    ap.add_argument("--check", action="store_true", help="only report stale generated files; exit 1 if any")
    args = ap.parse_args()
    if args.check:
        problems = stale_files()
        for line in problems:
            print(line)
        sys.exit(1 if problems else 0)
    for p in committed():
        (PACKAGE_ROOT / p).unlink()
    with tempfile.TemporaryDirectory() as tmp:
        for rel in generate(Path(tmp)):
            dest = PACKAGE_ROOT / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            (dest.parent / "__init__.py").touch()
            shutil.copyfile(Path(tmp) / "cotserve" / rel, dest)
            print(f"wrote services/{rel}")


if __name__ == "__main__":
    main()
