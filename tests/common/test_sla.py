"""SLA targets: one definition and one syntax for the gateway, the SLO predictor and the benchmarks."""

from __future__ import annotations

import pytest

from cotserve.common.sampling import SlaClass
from cotserve.common.sla import DEFAULT_SLA_TARGETS, SlaTarget, parse_sla_target, sla_targets


def test_parse_sla_target():
    assert parse_sla_target("interactive=800/80") == (SlaClass.INTERACTIVE, SlaTarget(800.0, 80.0))
    assert parse_sla_target(" REALTIME=100/20") == (SlaClass.REALTIME, SlaTarget(100.0, 20.0))
    for bad in ("fast=1/2", "interactive=1", "batch=-5/3", "gold=1/2"):
        with pytest.raises(ValueError, match="sla_target"):
            parse_sla_target(bad)


def test_overrides_replace_one_class_and_keep_class_order_and_the_defaults_intact():
    targets = sla_targets(["batch=60000/2000", "interactive=500/80"])
    assert list(targets) == [SlaClass.REALTIME, SlaClass.INTERACTIVE, SlaClass.BATCH]
    assert targets[SlaClass.INTERACTIVE] == SlaTarget(500.0, 80.0) and targets[SlaClass.BATCH] == SlaTarget(60000.0, 2000.0)
    assert targets[SlaClass.REALTIME] == DEFAULT_SLA_TARGETS[SlaClass.REALTIME] == SlaTarget(250.0, 50.0)
    assert DEFAULT_SLA_TARGETS[SlaClass.INTERACTIVE] == SlaTarget(1000.0, 100.0)  # the defaults were not changed
    assert sla_targets() == DEFAULT_SLA_TARGETS and sla_targets() is not DEFAULT_SLA_TARGETS
