"""A service's settings, defined once: its config dataclass, from which `cotserve serve <service>` is generated.

Each field is a setting. Its name, type and default are the field's; its help is the docstring written under it;
its flag is `--field-name` (`--x/--no-x` for a bool); its environment variable is `COTSERVE_<SERVICE>_<FIELD>`,
with the names earlier releases read kept as aliases (read after the canonical one). What a field's type does not
say (an alias, a flag kept from an earlier release) is in the class's `CLI` table: `{field: Cli(...)}`. Every generated
command also takes `--config FILE`, a TOML table of the same field names; precedence is flag > environment > file >
default (the file fills click's `default_map`, which click consults after the command line and the environment).

A field whose type is itself a settings dataclass (a part of the service with settings of its own, e.g. the
gateway's SLO rules) is a group: its fields are settings named `<prefix><field>` on the command line, in the
environment and in the file (the prefix is the group field's name and an underscore unless its `Cli` entry says
otherwise), and the command builds the group's object from them. So a part's settings are defined once, in its own
dataclass, with their defaults, and the service's config holds that object.

Typer stays (every other command is typer): this adapter only writes a signature for typer to read, about a
hundred lines instead of another CLI library beside it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import tomllib
import types
import typing
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import typer



@dataclass(frozen=True, slots=True)
class Cli:
    """How a field appears on the command line where its type alone does not say."""

    flag: str | None = None  # the flag's declaration, e.g. "--prefix-caching/--no-prefix-caching"
    env: tuple[str, ...] = ()  # environment variables earlier releases read, after the canonical one
    none_flag: str | None = None  # a flag that sets the field to None, e.g. "--no-state"
    none_help: str = ""
    prefix: str | None = None  # a group field: what its settings' names begin with (default: the field's name and "_")
    name: str | None = None  # a group's field: its setting's whole name, when not the group's prefix and its own


def legacy_env(*fields: str) -> dict[str, Cli]:
    """`CLI` entries for fields whose environment variable was `COTSERVE_<FIELD>` before it took the service's name."""
    return {f: Cli(env=(f"COTSERVE_{f.upper()}",)) for f in fields}


def env_name(service: str, name: str) -> str:
    return f"COTSERVE_{service.upper()}_{name.upper()}"


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (and of its dataclass bases), whitespace collapsed."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


@dataclass(frozen=True, slots=True)
class Setting:
    """One field as the command line sees it."""

    name: str
    kind: str  # "plain", "bool", "ints" (a comma-separated list), "many" (a repeatable flag)
    annotation: Any  # what typer parses
    default: Any  # the field's default, as typer shows it
    flag: str
    envvars: tuple[str, ...]
    help: str
    cli: Cli
    container: type = tuple  # a "many" field's collection: tuple, list or frozenset
    path: tuple[str, ...] = ()  # the field's place in the config: ("slo", "shed_over") for a group's field

    def to_field(self, value: Any) -> Any:
        """The command line's value as the field's."""
        if self.kind == "ints":
            try:
                return tuple(int(x) for x in str(value).split(",") if x.strip())
            except ValueError:
                raise ValueError(f"{self.name}: {value!r}, give comma-separated integers, e.g. 0,1") from None
        if self.kind == "many":
            return self.container(value)
        return value


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return hint, False


def is_group(hint: Any) -> bool:
    """Whether a field of this type is a group of settings (a dataclass of its own)."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def settings(cls: type, service: str, prefix: str = "", path: tuple[str, ...] = ()) -> dict[str, Setting]:
    """Every field of `cls` as a command-line setting, a group's fields flattened in (fields without a docstring are
    an error: each needs help)."""
    hints, docs, out = typing.get_type_hints(cls), field_docs(cls), {}
    own = cls.__dict__.get("__annotations__", {})  # the class's own settings first, inherited ones (TLS) after
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):
        meta: Cli = getattr(cls, "CLI", {}).get(f.name, Cli())
        if is_group(hints[f.name]):
            group_prefix = meta.prefix if meta.prefix is not None else f"{f.name}_"
            out.update(settings(hints[f.name], service, prefix + group_prefix, (*path, f.name)))
            continue
        if f.name not in docs:
            raise TypeError(f"{cls.__name__}.{f.name}: no docstring under the field (it is the setting's help)")
        name = meta.name or prefix + f.name
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        base, optional = _unwrap_optional(hints[f.name])
        dash, container = name.replace("_", "-"), tuple
        if base is bool:
            kind, annotation, flag = "bool", bool, meta.flag or f"--{dash}/--no-{dash}"
        elif typing.get_origin(base) in (tuple, frozenset, list):
            item = typing.get_args(base)[0]
            if item is int:
                kind, annotation, default = "ints", str, ",".join(str(x) for x in default)
            else:
                kind, annotation, default, container = "many", list[item], list(default), typing.get_origin(base)
            flag = meta.flag or f"--{dash}"
        else:
            kind, annotation, flag = "plain", Optional[base] if optional else base, meta.flag or f"--{dash}"
        out[name] = Setting(name, kind, annotation, default, flag, (env_name(service, name), *meta.env),
                            docs[f.name], meta, container, (*path, f.name))
    return out


def build_config(cls: type, values: dict[str, Any]) -> Any:
    """`cls` (groups included) from values keyed by each field's path (`Setting.path`)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if is_group(hints[f.name]):
            inner = {path[1:]: v for path, v in values.items() if path[0] == f.name}
            kwargs[f.name] = build_config(hints[f.name], inner)
        elif (f.name,) in values:
            kwargs[f.name] = values[(f.name,)]
    return cls(**kwargs)


def _config_file_callback(known: dict[str, Setting], service: str) -> Callable:
    def load(ctx: typer.Context, param: typer.CallbackParam, value: Optional[Path]) -> Optional[Path]:
        if value is None:
            return None
        try:
            data = tomllib.loads(value.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise typer.BadParameter(f"cannot read {value}: {exc}", param_hint="--config") from None
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise typer.BadParameter(f"{value}: unknown setting(s) {', '.join(unknown)}; {service} takes: "
                                     f"{', '.join(known)}", param_hint="--config")
        defaults = {k: ",".join(str(x) for x in v) if known[k].kind == "ints" and isinstance(v, list) else v
                    for k, v in data.items()}
        ctx.default_map = {**(ctx.default_map or {}), **defaults}
        return value

    return load


def serve_command(app: typer.Typer, cls: type, service: str, run: Callable[[Any], None], help: str,
                  defaults: dict[str, Any] | None = None) -> None:
    """Add `serve <service>` to `app`: one option per field of `cls` and `--config FILE`; the command builds `cls`
    from them and calls `run(config)`. `defaults` replace field defaults on the command line only (a CLI-side
    default a library caller does not get)."""
    from cotserve.common.clitools import fail

    known = settings(cls, service)
    params = [inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path], default=typer.Option(
        None, "--config", envvar=env_name(service, "config"), is_eager=True,
        callback=_config_file_callback(known, service),
        help="TOML file of settings by field name (flag > environment > file > default)."))]
    for s in known.values():
        default = (defaults or {}).get(s.name, s.default)
        params.append(inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, annotation=s.annotation, default=typer.Option(
            default, *s.flag.split(" "), envvar=list(s.envvars), help=s.help)))
        if s.cli.none_flag:
            params.append(inspect.Parameter(f"_none_{s.name}", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                                            default=typer.Option(False, s.cli.none_flag, help=s.cli.none_help)))

    def command(**values: Any) -> None:
        values.pop("config", None)
        by_path = {}
        try:
            for s in known.values():
                none = values.pop(f"_none_{s.name}", False)
                by_path[s.path] = None if none else s.to_field(values[s.name])
            config = build_config(cls, by_path)
        except ValueError as exc:
            fail(service, exc)
        run(config)

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = help
    command.__name__ = f"serve_{service}"
    app.command(service)(command)


def serve_service(app: typer.Typer, service: str, cls: type, help: str) -> None:
    """Add the generated `serve <service>` to `app`: logging set up, then `cotserve.<service>.server.serve(config)`
    (the service's server module imported only when the command runs, so `cotserve --help` stays light)."""
    import importlib

    from cotserve.common.clitools import run_service, setup_logging

    def run(cfg: Any) -> None:
        setup_logging()
        run_service(service, importlib.import_module(f"cotserve.{service}.server").serve(cfg))

    serve_command(app, cls, service, run, help)
