"""pyproject lists every package, so a non-editable install ships all of them."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT


def test_every_package_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {"cotserve." + ".".join(p.parent.relative_to(ROOT / "services").parts) if p.parent != ROOT / "services" else "cotserve"
             for p in (ROOT / "services").rglob("__init__.py")}
    assert found - listed == set()


@pytest.mark.parametrize("name", ["cotserve-demo", "testbed"])
def test_demo_models_are_package_data_and_small(name):
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert f"demo/{name}/*" in cfg["package-data"]["cotserve.worker"]
    folder = ROOT / "services" / "worker" / "demo" / name
    total = sum(f.stat().st_size for f in folder.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.name for f in folder.iterdir()}
    assert total <= 8 * 1024 * 1024, f"demo/{name} is {total} bytes, over 8 MB"


def test_the_editable_install_is_a_tree_of_links_editors_can_follow():
    """`make install` uses setuptools' strict editable mode; when this checkout is installed that way, the link tree
    holds every module of services/ (a module added since the install needs `make install` again)."""
    makefile = (ROOT / "Makefile").read_text()
    assert "EDITABLE := --config-settings editable_mode=strict" in makefile
    assert "install -q -e . $(EDITABLE)" in makefile and 'install -q -e ".[dev]" $(EDITABLE)' in makefile
    import cotserve

    tree = Path(cotserve.__file__).parent
    if not (tree / "__init__.py").is_symlink():
        pytest.skip("not installed in strict editable mode here")
    for f in (ROOT / "services").rglob("*.py"):
        if "__pycache__" in f.parts:
            continue
        link = tree / f.relative_to(ROOT / "services")
        assert link.resolve() == f.resolve(), f"{link} is missing from the editable install: run `make install`"


def test_no_package_folder_at_the_root_shadows_an_installed_package():
    """The repository root is on sys.path whenever Python runs from it (`python -m pytest`, `python -m cotserve.cli`):
    a package folder there is imported instead of an installed package of the same name. The kernels used to live
    in `kernels/`, which shadowed Hugging Face's `kernels` (transformers imports it): only `services/` (installed as
    `cotserve`) and `tests/` may be one."""
    folders = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert folders <= {"services", "tests"}, f"package folders at the repository root: {sorted(folders - {'services', 'tests'})}"


def test_the_declared_license_ships_and_the_python_floor_is_true():
    """pyproject says Apache-2.0: LICENSE holds that license's text. It says Python 3.11 or newer, which the code
    needs (tomllib is imported by the gateway's and the services' config loading)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert cfg["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert cfg["requires-python"] == ">=3.11"
    uses_tomllib = [p for p in (ROOT / "services").rglob("*.py") if "import tomllib" in p.read_text()]
    assert uses_tomllib  # (if this ever fails, the floor may go back down)


FLOORS = ("protobuf", "grpcio", "grpcio-health-checking", "grpcio-reflection")


def _floor(requirement: str) -> tuple[str, str] | None:
    name, _, version = requirement.partition(">=")
    return (name.strip(), version.split(",")[0].strip()) if name.strip() in FLOORS and version else None


def test_the_generated_code_imports_on_the_declared_floors(tmp_path):
    """protobuf's and grpcio's generated code refuses a runtime older than its generator: install the floors
    pyproject declares (nothing newer) and import every service's API and server with them."""
    import subprocess
    import sys

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = dict(f for f in map(_floor, deps) if f is not None)
    assert set(floors) == set(FLOORS), floors
    target = tmp_path / "floors"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    *(f"{name}=={version}" for name, version in floors.items())], check=True, timeout=300)
    modules = sorted(f"cotserve.{p.parent.parent.name}.v1.{p.stem}" for p in (ROOT / "services").glob("*/v1/*_pb2*.py"))
    servers = [f"cotserve.{name}.server" for name in ("gateway", "worker", "router", "sandbox", "slo", "telemetry")]
    script = ("import importlib, google.protobuf, grpc, sys\n"
              "for m in sys.argv[1:]: importlib.import_module(m)\n"
              "print(google.protobuf.__version__, grpc.__version__)")
    out = subprocess.run([sys.executable, "-c", script, *modules, *servers], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(target)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [floors["protobuf"], floors["grpcio"]]
