"""pyproject lists every package, so a non-editable install ships all of them."""

from __future__ import annotations

import os
import subprocess
import sys
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
    holds every module of services/ and of kernels/ (a module added since the install needs `make install` again)."""
    makefile = (ROOT / "Makefile").read_text()
    assert "EDITABLE := --config-settings editable_mode=strict" in makefile
    assert 'install -q -e ".[all]" $(EDITABLE)' in makefile and 'install -q -e ".[all,dev]" $(EDITABLE)' in makefile
    import cotserve

    tree = Path(cotserve.__file__).parent
    if not (tree / "__init__.py").is_symlink():
        pytest.skip("not installed in strict editable mode here")
    for source, linked in ((ROOT / "services", tree), (ROOT / "kernels", tree / "kernels")):
        for f in source.rglob("*.py"):
            if "__pycache__" in f.parts:
                continue
            link = linked / f.relative_to(source)
            assert link.resolve() == f.resolve(), f"{link} is missing from the editable install: run `make install`"


def test_no_package_folder_at_the_root_shadows_an_installed_package():
    """The repository root is on sys.path whenever Python runs from it (`python -m pytest`, `python -m cotserve.cli`):
    a regular package folder there would be imported instead of an installed package of the same name. Only
    `services/` (installed as `cotserve`) and `tests/` are one; `kernels/` (installed as `cotserve.kernels`) has no
    `__init__.py`, and a folder without one yields to an installed package of its name."""
    folders = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert folders <= {"services", "tests"}, f"package folders at the repository root: {sorted(folders - {'services', 'tests'})}"
    assert not (ROOT / "kernels" / "__init__.py").exists()


def test_import_kernels_from_the_root_finds_the_installed_package_and_ours_is_cotserve_kernels():
    """Run from the repository root (the root first on sys.path): Hugging Face's `kernels` package, which
    transformers imports, is the one found, not our kernels/ folder; ours is `cotserve.kernels`."""
    import importlib.util

    if importlib.util.find_spec("kernels") is None:
        pytest.skip("no installed `kernels` package here to shadow")
    code = ("import kernels, cotserve.kernels.dispatch as d; from pathlib import Path; "
            "print(Path(kernels.__file__).resolve()); print(Path(d.__file__).resolve())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ""}).stdout.split()
    theirs, ours = map(Path, out)
    assert ROOT not in theirs.parents, f"`import kernels` found {theirs}, a folder of this repository"
    assert ours.parent.name == "kernels" and ours.name == "dispatch.py"  # cotserve.kernels: this project's kernels


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

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["serve"]
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


# ---- extras: each runs with only its own packages ----------------------------------------------------------------
ONLY_DISTS = ROOT / "tests" / "only_dists"  # sitecustomize.py: COTSERVE_ONLY_DISTS hides every other distribution


def extra_distributions(*extras: str) -> list[str]:
    """The distributions `pip install cotserve[EXTRAS]` asks for (the client's, and each extra's, self-references
    expanded; environment markers evaluated here)."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out, todo, seen = list(project["dependencies"]), list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in project["optional-dependencies"][extra]:
            req = Requirement(text)
            if req.name == "cotserve":
                todo.extend(req.extras)
            elif req.marker is None or req.marker.evaluate():
                out.append(text)
    return sorted({Requirement(t).name for t in out})


def only(*extras: str) -> dict[str, str]:
    """Environment for a process that sees only what `pip install cotserve[EXTRAS]` installs (and the standard
    library; cotserve's own code is always there)."""
    return {"PYTHONPATH": os.pathsep.join([str(ONLY_DISTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "COTSERVE_ONLY_DISTS": ",".join(extra_distributions(*extras))}


def run_cotserve(env: dict[str, str], *args: str, timeout: float = 120):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "cotserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})


def test_the_guard_hides_what_an_extra_does_not_install():
    """The check the tests below rely on: with only the client's packages, torch and xgboost cannot be imported
    (though installed here), grpc can."""
    import subprocess
    import sys

    script = ("import importlib\nfor m in ('grpc', 'google.protobuf', 'typer', 'torch', 'xgboost', 'aiohttp'):\n"
              "    try: importlib.import_module(m); print(m, 'ok')\n"
              "    except ModuleNotFoundError: print(m, 'missing')")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **only()})
    assert out.stdout.split("\n")[:6] == ["grpc ok", "google.protobuf ok", "typer ok", "torch missing",
                                          "xgboost missing", "aiohttp missing"], out.stderr
    assert "torch" not in extra_distributions() and "torch" in extra_distributions("worker")


def test_the_client_alone_runs_every_help_and_generate(demo_gateway):
    """`pip install cotserve`: the SDK and the client commands, without torch, xgboost, wasmtime or the servers'
    packages: every command's --help, and a real `cotserve generate` through a gateway."""
    env = only()
    for args in (["--help"], ["--version"], ["generate", "--help"], ["serve", "worker", "--help"], ["bench", "--help"],
                 ["serve", "gateway", "--help"], ["tls", "init", "--help"]):
        out = run_cotserve(env, *args)
        assert out.returncode == 0, (args, out.stderr[-2000:])
    out = run_cotserve(env, "generate", "--address", demo_gateway, "--max-new-tokens", "4", "37+48-12=")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip()
    sdk = "from cotserve.sdk import Client\nwith Client(ADDRESS) as c: print(len(c.generate('1+2=', max_new_tokens=3).token_ids))"
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", sdk.replace("ADDRESS", repr(demo_gateway))], capture_output=True,
                         text=True, timeout=60, env={**os.environ, **env})
    assert out.returncode == 0 and out.stdout.split() == ["3"], out.stderr[-2000:]


def test_a_service_without_its_extra_says_which_to_install():
    out = run_cotserve(only(), "serve", "sandbox", "--port", "0")
    assert out.returncode == 1
    assert "pip install 'cotserve[sandbox]'" in out.stderr and "wasmtime" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("service", ["worker", "gateway", "router", "slo", "sandbox", "telemetry"])
def test_each_service_serves_with_only_its_extra(service, demo_worker):
    """`pip install cotserve[SERVICE]` is enough for `cotserve serve SERVICE` (the worker's engine process
    included): it starts and reports SERVING with every other package hidden."""
    from tests.conftest import _start_service, stop_process

    args = {"gateway": ["--worker", demo_worker], "worker": ["--max-num-seqs", "4"]}.get(service, [])
    proc, _ = _start_service(service, args, 120, env=only(service))
    stop_process(proc)


def test_the_client_installs_alone_into_a_fresh_environment(tmp_path, demo_gateway):
    """`pip install cotserve` in a new virtual environment (nothing shared with this one): the client's packages and
    nothing of the services' (no torch, xgboost, wasmtime, aiohttp, OpenTelemetry SDK), and `cotserve generate` runs."""
    import subprocess
    import sys

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(ROOT)], capture_output=True,
                         text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-3000:]
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "freeze"],
                            capture_output=True, text=True, timeout=120).stdout
    names = {line.split("==")[0].lower().replace("_", "-") for line in listed.split()}
    assert {"cotserve", "grpcio", "protobuf", "typer"} <= names
    assert not names & {"torch", "triton", "xgboost", "xgboost-cpu", "wasmtime", "aiohttp", "opentelemetry-sdk",
                        "numpy", "redis", "matplotlib"}, names
    out = subprocess.run([str(venv / "bin" / "cotserve"), "generate", "--address", demo_gateway, "--max-new-tokens",
                          "4", "37+48-12="], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-2000:]


def test_the_missing_package_message_names_the_extra_to_install():
    from cotserve.cli import missing_extra_message

    err = ModuleNotFoundError("No module named 'torch'", name="torch")
    assert missing_extra_message(["cotserve", "serve", "worker", "--port", "1"], err) == (
        "cotserve serve worker: a package it needs is not installed (torch): pip install 'cotserve[worker]'")
    assert missing_extra_message(["cotserve", "bench", "baseline"], err) == (
        "cotserve bench: a package it needs is not installed (torch): pip install 'cotserve[all]'")
