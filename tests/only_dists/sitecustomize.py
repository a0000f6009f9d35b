"""Put on PYTHONPATH with COTSERVE_ONLY_DISTS=dist,dist,...: in this interpreter (and every Python process it
starts, which inherits the environment) a module that belongs to an installed distribution outside those and
their requirements fails to import, as it would in an environment where only they were installed. The test of
each extra (tests/test_packaging.py) runs the extra's commands and services so."""

from __future__ import annotations

import importlib.metadata as md
import os
import sys


def _closure(names: list[str]) -> set[str]:
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(names)
    while todo:
        key = todo.pop().lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = md.requires(key) or []
        except md.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


class _Hidden:
    """Wraps one of `sys.meta_path`'s finders: it finds nothing of the hidden distributions' modules (so an import of
    one fails as an absent module's does, and `importlib.util.find_spec` answers None), everything else as before."""

    def __init__(self, inner, blocked: set[str]) -> None:
        self.inner, self.blocked = inner, blocked

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.blocked:
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(name, path, target) if find is not None else None

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


def _install() -> None:
    dists = os.environ.get("COTSERVE_ONLY_DISTS")
    if dists is None:
        return
    allowed = _closure([d for d in dists.split(",") if d])
    blocked = {module for module, owners in md.packages_distributions().items()
               if not any(o.lower().replace("_", "-") in allowed for o in owners)}
    blocked.discard("cotserve")
    sys.meta_path[:] = [_Hidden(finder, blocked) for finder in sys.meta_path]


_install()
