"""Where services keep state on this machine by default."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """`$XDG_CACHE_HOME/cotserve/...` (default `~/.cache/cotserve/...`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "cotserve", *parts)
