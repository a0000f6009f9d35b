"""Prometheus exposition text read as a test reads it: samples by name and labels."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of an exposition, keyed by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """A service's /metrics on the loopback port, as Prometheus scrapes it."""
    return parse_metrics(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())


def value(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]
