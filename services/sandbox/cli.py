"""The sandbox's commands: `cotserve serve sandbox` (generated from `SandboxConfig`) and `cotserve sandbox register |
delete | list | run` (manage and run WASI modules)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from cotserve.common.clitools import rpc_error_exit
from cotserve.common.config import serve_service
from cotserve.sandbox.config import SandboxConfig


sandbox_app = typer.Typer(help="The WASI sandbox: register, list and run modules.", no_args_is_help=True)


def _sandbox_stub(address: str):
    from cotserve.common.tls import client_channel
    from cotserve.sandbox.v1 import sandbox_pb2_grpc

    return client_channel(address), sandbox_pb2_grpc.SandboxServiceStub


def _admin_metadata(token: Optional[str], token_file: Optional[Path]) -> tuple[tuple[str, str], ...]:
    """The admin token: given, else read from the file the local sandbox keeps it in."""
    if not token:
        from cotserve.common.paths import cache_dir

        path = token_file or cache_dir("sandbox") / "admin-token"
        try:
            token = path.read_text().strip()
        except OSError as exc:
            typer.echo(f"error: no admin token: give --admin-token (or COTSERVE_SANDBOX_ADMIN_TOKEN) or --admin-token-file "
                       f"({path}: {exc.strerror})", err=True)
            raise typer.Exit(2) from None
    return (("authorization", f"Bearer {token}"),)


_TOKEN_HELP = "The sandbox's admin token (default: read from --admin-token-file)."
_TOKEN_FILE_HELP = "File holding the admin token (default: the one a sandbox on this machine keeps in its store, ~/.cache/cotserve/sandbox/admin-token)."


@sandbox_app.command("register")
def sandbox_register(
    name: str = typer.Argument(..., help="Module name."),
    file: Path = typer.Argument(..., help="A .wasm or .wat file."),
    address: str = typer.Option("127.0.0.1:50071", envvar="COTSERVE_SANDBOX_ADDRESS", help="Sandbox address."),
    replace: bool = typer.Option(False, "--replace", help="Replace a module already registered under this name (logged in the sandbox's audit log)."),
    admin_token: Optional[str] = typer.Option(None, envvar="COTSERVE_SANDBOX_ADMIN_TOKEN", help=_TOKEN_HELP),
    admin_token_file: Optional[Path] = typer.Option(None, help=_TOKEN_FILE_HELP),
) -> None:
    """Register (compile and validate) a module; needs the sandbox's admin token."""
    import grpc

    from cotserve.sandbox.v1 import sandbox_pb2

    metadata = _admin_metadata(admin_token, admin_token_file)
    data = file.read_bytes()
    req = sandbox_pb2.RegisterModuleRequest(name=name, replace=replace)
    if file.suffix == ".wat":
        req.wat = data.decode()
    else:
        req.wasm = data
    channel, stub = _sandbox_stub(address)
    with channel:
        try:
            m = stub(channel).RegisterModule(req, metadata=metadata, timeout=60).module
        except grpc.RpcError as err:
            rpc_error_exit(err)
    typer.echo(f"{m.name} {m.sha256} {m.size_bytes} bytes")


@sandbox_app.command("delete")
def sandbox_delete(
    name: str = typer.Argument(..., help="Module name."),
    address: str = typer.Option("127.0.0.1:50071", envvar="COTSERVE_SANDBOX_ADDRESS", help="Sandbox address."),
    admin_token: Optional[str] = typer.Option(None, envvar="COTSERVE_SANDBOX_ADMIN_TOKEN", help=_TOKEN_HELP),
    admin_token_file: Optional[Path] = typer.Option(None, help=_TOKEN_FILE_HELP),
) -> None:
    """Delete a module and its files (shipped modules cannot be deleted); needs the sandbox's admin token."""
    import grpc

    from cotserve.sandbox.v1 import sandbox_pb2

    metadata = _admin_metadata(admin_token, admin_token_file)
    channel, stub = _sandbox_stub(address)
    with channel:
        try:
            stub(channel).DeleteModule(sandbox_pb2.DeleteModuleRequest(name=name), metadata=metadata, timeout=30)
        except grpc.RpcError as err:
            rpc_error_exit(err)
    typer.echo(f"deleted {name}")


@sandbox_app.command("list")
def sandbox_list(address: str = typer.Option("127.0.0.1:50071", envvar="COTSERVE_SANDBOX_ADDRESS", help="Sandbox address.")) -> None:
    """List registered modules."""
    import grpc

    from cotserve.sandbox.v1 import sandbox_pb2

    channel, stub = _sandbox_stub(address)
    with channel:
        try:
            modules = stub(channel).ListModules(sandbox_pb2.ListModulesRequest(), timeout=30).modules
        except grpc.RpcError as err:
            rpc_error_exit(err)
    for m in modules:
        typer.echo(f"{m.name}\t{m.sha256[:16]}\t{m.size_bytes} bytes{chr(9) + 'shipped' if m.shipped else ''}")


@sandbox_app.command("run")
def sandbox_run(
    name: str = typer.Argument(..., help="Module name."),
    input_file: Optional[Path] = typer.Option(None, "--input", help="File to pass on stdin (default: this command's stdin)."),
    arg: list[str] = typer.Option([], "--arg", help="Argument for the module (repeatable)."),
    timeout_ms: int = typer.Option(0, help="Wall-time limit (0: the module's default)."),
    address: str = typer.Option("127.0.0.1:50071", envvar="COTSERVE_SANDBOX_ADDRESS", help="Sandbox address."),
) -> None:
    """Run a module on stdin (or --input) and print its output; the outcome goes to stderr."""
    import grpc

    from cotserve.sandbox.v1 import sandbox_pb2

    data = input_file.read_bytes() if input_file else sys.stdin.buffer.read()
    channel, stub = _sandbox_stub(address)
    with channel:
        try:
            r = stub(channel).Run(sandbox_pb2.RunRequest(name=name, input=data, args=arg,
                                                         limits=sandbox_pb2.RunLimits(timeout_ms=timeout_ms)), timeout=60)
        except grpc.RpcError as err:
            rpc_error_exit(err)
    sys.stdout.buffer.write(r.output)
    sys.stdout.flush()
    typer.echo(f"[{sandbox_pb2.RunOutcome.Name(r.outcome)} exit {r.exit_code} | fuel {r.fuel_used} | {r.wall_ms:.2f} ms]", err=True)
    if r.outcome != sandbox_pb2.RUN_OUTCOME_OK:
        raise typer.Exit(1)


def mount(root: typer.Typer, serve: typer.Typer) -> None:
    """The sandbox's commands on the `cotserve` command line."""
    serve_service(serve, "sandbox", SandboxConfig, "Start the WASI sandbox service.")
    root.add_typer(sandbox_app, name="sandbox")
