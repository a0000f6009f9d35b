"""The suite's rooms: services import one another only through `common`, `kernels` and the generated `v1` stubs
(issue 19). A service that needs another's internals is a sign that something belongs in `common`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES_DIR = ROOT / "services"
KERNELS_DIR = ROOT / "kernels"  # imported as cotserve.kernels
# what every service may import besides itself
SHARED = {"common", "kernels"}
# the serving services and what they share; `bench`, `demo`, `kveval`, `up.py` and the top-level `cli.py` are tools
# that drive them, and the SDK is the client (it may read any service's stubs, as every client does)
SERVICES = {"gateway", "worker", "router", "slo", "sandbox", "telemetry", "sdk", "common", "kernels"}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `cotserve.*` import in a file, lazy ones inside functions included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "cotserve":  # from cotserve import x
            out += [(node.lineno, f"cotserve.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("cotserve."):
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("cotserve.")]
    return out


def violations(root: Path = SERVICES_DIR, kernels: Path = KERNELS_DIR) -> list[str]:
    """Every import in a service (or in `common`, or the kernels) that crosses the rule, as `path:line: who imports
    what`."""
    found = []
    for service in sorted(SERVICES):
        folder = kernels if service == "kernels" and not (root / service).exists() else root / service
        for path in sorted(folder.rglob("*.py")):
            if "v1" in path.relative_to(folder).parts:
                continue  # generated stubs import each other's messages
            for line, module in _imports(path):
                parts = module.split(".")
                target = parts[1] if len(parts) > 1 else ""
                stub = len(parts) > 2 and parts[2] == "v1"
                # `common` is the floor: it may read only its own messages, never a service's (stubs or code)
                allowed = target == service or (service != "common" and (target in SHARED or stub))
                if not allowed:
                    found.append(f"{path.relative_to(folder.parent)}:{line}: {service} imports {module}")
    return found


def test_services_import_each_other_only_through_common_kernels_and_stubs():
    assert violations() == []


def test_the_rule_catches_an_import_of_another_service(tmp_path):
    """The check itself: a worker module that reaches into the gateway, lazily, is reported with its line; stubs
    and `common` are fine; `common` may read neither a service's stubs nor its code."""
    for service in SERVICES:
        (tmp_path / service).mkdir()
    (tmp_path / "worker" / "bad.py").write_text("import os\n\ndef f():\n    from cotserve.gateway.admission import Admission\n")
    (tmp_path / "worker" / "fine.py").write_text("from cotserve.common.stats import percentile\nfrom cotserve.gateway.v1 import gateway_pb2\n")
    (tmp_path / "common" / "bad.py").write_text("from cotserve import worker\nfrom cotserve.slo.v1 import slo_pb2\n")
    (tmp_path / "common" / "fine.py").write_text("from cotserve.common.v1 import common_pb2\n")
    assert violations(tmp_path) == ["common/bad.py:1: common imports cotserve.worker",
                                    "common/bad.py:2: common imports cotserve.slo.v1",
                                    "worker/bad.py:4: worker imports cotserve.gateway.admission"]


MAX_FUNCTION_LINES = 60
TRAINING_SCRIPTS = {"demo/train.py", "demo/train_longctx.py"}  # a training run reads best as one script


def long_functions(root: Path = SERVICES_DIR, limit: int = MAX_FUNCTION_LINES,
                   kinds: tuple[type, ...] = (ast.FunctionDef, ast.AsyncFunctionDef), extra: tuple[Path, ...] = ()) -> list[str]:
    """Every hand-written function (or other `kinds` of definition; generated v1 stubs and training scripts aside)
    longer than `limit` lines, under `root` and the `extra` folders, as `path:line: name (N lines)`."""
    found = []
    for path in sorted([*root.rglob("*.py"), *(p for folder in extra for p in folder.rglob("*.py"))]):
        rel = path.relative_to(root) if root in path.parents else path.relative_to(path.parents[1])
        if "v1" in rel.parts or rel.as_posix() in TRAINING_SCRIPTS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, kinds):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{rel}:{node.lineno}: {node.name} ({lines} lines)")
    return found


def test_no_hand_written_function_is_over_sixty_lines():
    assert long_functions() == []


def test_the_function_length_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "svc").mkdir()
    (tmp_path / "svc" / "mod.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path) == ["svc/mod.py:5: long (62 lines)"]


MAX_CLASS_LINES = 300


def test_no_hand_written_function_is_over_sixty_lines_in_the_kernels_either():
    assert long_functions(KERNELS_DIR, extra=()) == []


def test_no_class_is_over_three_hundred_lines():
    """One concept per class: a class that grows past this is doing more than one job (STYLE.md)."""
    assert long_functions(limit=MAX_CLASS_LINES, kinds=(ast.ClassDef,), extra=(KERNELS_DIR,)) == []


def test_the_class_length_check_finds_a_long_class(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    (tmp_path / "svc").mkdir()
    (tmp_path / "svc" / "mod.py").write_text(f"class Big:\n{body}\n")
    assert long_functions(tmp_path, limit=MAX_CLASS_LINES, kinds=(ast.ClassDef,)) == [f"svc/mod.py:1: Big ({MAX_CLASS_LINES + 1} lines)"]
