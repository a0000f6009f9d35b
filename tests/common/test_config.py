"""Settings defined once in a config dataclass: the generated command, its environment variables, its config file
and their precedence (flag > environment > file > default)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import typer
from typer.testing import CliRunner

from cotserve.common.config import Cli, serve_command, settings


@dataclass(slots=True)
class ToyConfig:
    port: int = 100
    """Port to bind."""
    name: str | None = None
    """A name (none: the default one)."""
    fast: bool = True
    """Go fast."""
    layers: tuple[int, ...] = ()
    """Layers, comma-separated."""
    tags: tuple[str, ...] = ()
    """Tags (repeatable)."""
    state: Path | None = Path("/var/toy")
    """Where state is kept."""
    ratio: float = 0.5
    """A share (0..1)."""

    CLI: ClassVar[dict[str, Cli]] = {"port": Cli(env=("TOY_OLD_PORT",)), "fast": Cli(flag="--fast/--slow"),
                                     "state": Cli(none_flag="--no-state", none_help="Keep nothing.")}

    def __post_init__(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"ratio: {self.ratio}, allowed 0..1")


def run(args: list[str], env: dict[str, str] | None = None):
    app, seen = typer.Typer(), []
    serve_command(app, ToyConfig, "toy", seen.append, "Start the toy.")
    result = CliRunner().invoke(app, args, env=env or {})
    return result, (seen[0] if seen else None)


def test_every_field_is_a_flag_with_help_and_an_environment_variable():
    s = settings(ToyConfig, "toy")
    assert s["port"].envvars == ("COTSERVE_TOY_PORT", "TOY_OLD_PORT") and s["port"].help == "Port to bind."
    assert s["fast"].flag == "--fast/--slow" and s["layers"].flag == "--layers"
    result, _ = run(["--help"])
    for flag in ("--port", "--name", "--fast", "--slow", "--layers", "--tags", "--state", "--no-state", "--ratio", "--config"):
        assert flag in result.output
    assert "COTSERVE_TOY_RATIO" in result.output and "A share (0..1)." in result.output


def test_values_are_converted_to_the_field_types():
    result, cfg = run(["--port", "7", "--slow", "--layers", "0,2", "--tags", "a", "--tags", "b", "--no-state"])
    assert result.exit_code == 0, result.output
    assert cfg == ToyConfig(port=7, fast=False, layers=(0, 2), tags=("a", "b"), state=None)
    _, plain = run([])
    assert plain == ToyConfig()


def test_precedence_flag_then_environment_then_file_then_default(tmp_path):
    conf = tmp_path / "toy.toml"
    conf.write_text('port = 3\nname = "from-file"\nlayers = [1, 2]\nratio = 0.25\n')
    _, cfg = run(["--config", str(conf)])
    assert (cfg.port, cfg.name, cfg.layers, cfg.ratio, cfg.fast) == (3, "from-file", (1, 2), 0.25, True)  # file > default
    _, cfg = run(["--config", str(conf)], env={"COTSERVE_TOY_PORT": "4", "COTSERVE_TOY_NAME": "from-env"})
    assert (cfg.port, cfg.name, cfg.ratio) == (4, "from-env", 0.25)  # environment > file
    _, cfg = run(["--config", str(conf), "--port", "5"], env={"COTSERVE_TOY_PORT": "4"})
    assert cfg.port == 5  # flag > environment
    _, cfg = run([], env={"TOY_OLD_PORT": "6"})
    assert cfg.port == 6  # an earlier release's name still works
    _, cfg = run([], env={"TOY_OLD_PORT": "6", "COTSERVE_TOY_PORT": "8"})
    assert cfg.port == 8  # the canonical name first


def test_bad_values_and_unknown_file_settings_name_the_setting(tmp_path):
    result, cfg = run(["--ratio", "2"])
    assert cfg is None and result.exit_code == 2 and "cotserve toy: ratio: 2.0, allowed 0..1" in result.output
    result, _ = run(["--layers", "0,x"])
    assert result.exit_code == 2 and "layers: '0,x', give comma-separated integers" in result.output
    conf = tmp_path / "toy.toml"
    conf.write_text("prot = 3\n")
    result, _ = run(["--config", str(conf)])
    assert result.exit_code == 2 and "unknown setting(s) prot" in result.output and "toy takes: port, name" in result.output


def test_a_field_without_help_is_refused():
    @dataclass
    class Undocumented:
        port: int = 1

    with pytest.raises(TypeError, match="Undocumented.port: no docstring under the field"):
        settings(Undocumented, "x")


def _config_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


@pytest.mark.parametrize("service, config", [("worker", "cotserve.worker.config.WorkerConfig"),
                                             ("router", "cotserve.router.config.RouterConfig"),
                                             ("telemetry", "cotserve.telemetry.config.TelemetryConfig"),
                                             ("slo", "cotserve.slo.config.SloConfig"),
                                             ("sandbox", "cotserve.sandbox.config.SandboxConfig"),
                                             ("gateway", "cotserve.gateway.config.GatewayConfig")])
def test_each_generated_serve_command_has_every_setting_with_help_and_a_variable(service, config):
    """`cotserve serve <service> --help`: one flag per config field, each with its docstring as help and its
    environment variable COTSERVE_<SERVICE>_<FIELD>; and `--config`."""
    from cotserve.cli import app

    known = settings(_config_class(config), service)  # raises when a field has no docstring
    result = CliRunner().invoke(app, ["serve", service, "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "--config" in result.output
    for s in known.values():
        for name in s.flag.replace("/", " ").split():  # every name a flag answers to (an earlier one too)
            assert name in result.output, (s.name, name)
        assert s.envvars[0] == f"COTSERVE_{service.upper()}_{s.name.upper()}" and s.envvars[0] in result.output, s.name
        assert s.help


def test_earlier_names_and_flags_are_kept():
    from cotserve.slo.config import SloConfig
    from cotserve.worker.config import WorkerConfig

    worker = settings(WorkerConfig, "worker")
    assert worker["model"].envvars == ("COTSERVE_WORKER_MODEL", "COTSERVE_MODEL")
    assert worker["enable_prefix_caching"].flag == "--prefix-caching/--no-prefix-caching"
    assert worker["engine_process"].flag == "--engine-process/--engine-thread"
    # the SLO predictor and the gateway read the same SLA targets from one variable
    assert settings(SloConfig, "slo")["sla_target"].envvars == ("COTSERVE_SLO_SLA_TARGET", "COTSERVE_SLA_TARGETS")
    assert SloConfig(sla_target=("interactive=500/80",)).targets[1].ttft_ms == 500
    with pytest.raises(ValueError, match="sla_target: 'gold=1/2' is not CLASS=TTFT_MS/ITL_P95_MS"):
        SloConfig(sla_target=("gold=1/2",)).validate()


def test_the_gateway_keeps_its_earlier_flags_and_variables():
    """The gateway's settings are fields, its admission's and SLO rules' in groups of their own (AdmissionConfig,
    SloSettings) under the flat names they always had; the flags and variables of earlier releases still work, and the
    same variable sets both services' targets."""
    from cotserve.common.sampling import SlaClass
    from cotserve.gateway.admission import AdmissionConfig
    from cotserve.gateway.config import GatewayConfig
    from cotserve.gateway.slo_settings import SloSettings

    gw = settings(GatewayConfig, "gateway")
    assert gw["workers"].flag == "--worker" and gw["workers"].envvars == ("COTSERVE_GATEWAY_WORKERS", "COTSERVE_WORKERS")
    assert gw["sandbox_address"].flag.split() == ["--sandbox-address", "--sandbox"]
    assert gw["slo_address"].envvars[1:] == ("COTSERVE_SLO_ADDRESS",)
    assert gw["slo_predict_budget_ms"].envvars[1:] == ("COTSERVE_SLO_BUDGET_MS",)
    assert gw["sla_target"].envvars[1:] == settings(__import__("cotserve.slo.config", fromlist=["x"]).SloConfig, "slo")["sla_target"].envvars[1:]
    assert gw["admission"].flag == "--admission/--no-admission" and gw["fail_open_modules"].flag == "--fail-open"
    assert gw["batch_limit"].envvars == ("COTSERVE_GATEWAY_BATCH_LIMIT", "COTSERVE_BATCH_LIMIT")
    assert gw["slo_shed_over"].flag == "--slo-shed-over" and gw["slo_shed_over"].path == ("slo", "shed_over")
    assert gw["admission"].path == ("admission", "enabled") and gw["admission_window_s"].path == ("admission", "window_s")
    cfg = GatewayConfig(sla_target=("interactive=500/80",),
                        admission=AdmissionConfig(enabled=False, batch_limit=7, batch_restart_limit=2, max_queue_batch=3))
    adm = cfg.admission
    assert (adm.enabled, adm.batch_limit, adm.batch_restart_limit, adm.max_queue(SlaClass.BATCH),
            cfg.targets[SlaClass.INTERACTIVE].ttft_ms) == (False, 7, 2, 3, 500)
    for bad, message in ((dict(admission=AdmissionConfig(max_queue_batch=-1)), "max_queue_batch: -1, must be >= 0"),
                         (dict(admission=AdmissionConfig(batch_restart_limit=-1)), "batch_restart_limit: -1, must be >= 0"),
                         (dict(slo=SloSettings(throttle_from=0.0)), r"slo_throttle_from: 0.0, allowed \(0, 1\]"),
                         (dict(sla_target=("gold=1/2",)), "sla_target: 'gold=1/2'"),
                         (dict(prefix_cache_scope="all"), "prefix_cache_scope: 'all', allowed: tenant, global")):
        with pytest.raises(ValueError, match=message):
            GatewayConfig(workers=["127.0.0.1:1"], **bad).validate()


def test_the_gateway_command_builds_its_config_from_flags_environment_and_file(tmp_path, monkeypatch):
    """`serve gateway` through the real CLI: flags, an earlier variable name and a config file reach the config
    the service starts with (its `serve` replaced by one that records it)."""
    import cotserve.gateway.server as server
    from cotserve.cli import app

    seen = []

    async def record(cfg):
        seen.append(cfg)

    monkeypatch.setattr(server, "serve", record)
    path = tmp_path / "gw.toml"
    path.write_text('batch_limit = 9\nsla_target = ["batch=20000/900"]\n')
    result = CliRunner().invoke(app, ["serve", "gateway", "--config", str(path), "--worker", "127.0.0.1:1",
                                      "--worker", "127.0.0.1:2", "--no-admission", "--slo", "127.0.0.1:3"],
                                env={"COTSERVE_MAX_QUEUE_BATCH": "5", "COTSERVE_GATEWAY_BATCH_LIMIT": "11"})
    assert result.exit_code == 0, result.output
    cfg = seen[0]
    assert cfg.workers == ["127.0.0.1:1", "127.0.0.1:2"] and cfg.admission.enabled is False
    assert cfg.slo.address == "127.0.0.1:3" and cfg.slo.shed_over == 0.8  # a group's field keeps its default
    assert cfg.admission.batch_limit == 11 and cfg.admission.max_queue_batch == 5 and cfg.sla_target == ("batch=20000/900",)


def test_a_repeatable_setting_keeps_its_field_collection():
    from cotserve.router.config import RouterConfig

    assert settings(RouterConfig, "router")["models"].to_field(["a", "b"]) == ["a", "b"]  # a list field gets a list
    assert settings(ToyConfig, "toy")["tags"].to_field(["a"]) == ("a",)
