"""pyproject lists every package, so a non-editable install ships all of them."""

from __future__ import annotations

import tomllib

import pytest

from tests.conftest import ROOT


def test_every_package_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {"cotserve." + ".".join(p.parent.relative_to(ROOT / "services").parts) if p.parent != ROOT / "services" else "cotserve"
             for p in (ROOT / "services").rglob("__init__.py")}
    found |= {"cotserve.kernels." + ".".join(p.parent.relative_to(ROOT / "kernels").parts) if p.parent != ROOT / "kernels" else "cotserve.kernels"
              for p in (ROOT / "kernels").rglob("__init__.py")}
    assert found - listed == set()


@pytest.mark.parametrize("name", ["model", "testbed"])
def test_demo_models_are_package_data_and_small(name):
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert f"demo/{name}/*" in cfg["package-data"]["cotserve.worker"]
    folder = ROOT / "services" / "worker" / "demo" / name
    total = sum(f.stat().st_size for f in folder.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.name for f in folder.iterdir()}
    assert total <= 8 * 1024 * 1024, f"demo/{name} is {total} bytes, over 8 MB"
