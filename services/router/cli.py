"""The MoE router's commands: `cotserve serve router` (generated from `RouterConfig`) and `cotserve moe policy | load`
(a model's routing policy and expert load, from the router)."""

from __future__ import annotations

import typer

from cotserve.common.clitools import rpc_error_exit
from cotserve.common.config import serve_service
from cotserve.common.tls import client_channel
from cotserve.router.config import RouterConfig


moe_app = typer.Typer(help="Mixture-of-experts routing: policy and expert load.", no_args_is_help=True)


@moe_app.command("policy")
def moe_policy(
    model: str = typer.Argument(..., help="Model name."),
    address: str = typer.Option("127.0.0.1:50081", envvar="COTSERVE_ROUTER_ADDRESS", help="Router address."),
) -> None:
    """Print a model's current routing policy."""
    import grpc

    from cotserve.router.v1 import router_pb2, router_pb2_grpc

    with client_channel(address) as ch:
        try:
            p = router_pb2_grpc.RouterServiceStub(ch).GetPolicy(router_pb2.GetPolicyRequest(model=model), timeout=10).policy
        except grpc.RpcError as err:
            rpc_error_exit(err)
    typer.echo(f"{p.model} v{p.version} top_k={p.top_k or 'checkpoint'}")
    for layer in p.layers:
        bias = " ".join(f"{b:+.3f}" for b in layer.expert_bias) or "none"
        typer.echo(f"  layer {layer.layer}: bias [{bias}] disabled {list(layer.disabled_experts)}")


@moe_app.command("load")
def moe_load(
    model: str = typer.Argument(..., help="Model name."),
    window_s: float = typer.Option(10.0, help="Window to sum over."),
    address: str = typer.Option("127.0.0.1:50081", envvar="COTSERVE_ROUTER_ADDRESS", help="Router address."),
) -> None:
    """Print tokens per expert per layer and each layer's balancedness (mean / max)."""
    import grpc

    from cotserve.router.v1 import router_pb2, router_pb2_grpc

    with client_channel(address) as ch:
        try:
            resp = router_pb2_grpc.RouterServiceStub(ch).GetExpertLoad(
                router_pb2.GetExpertLoadRequest(model=model, window_ms=int(window_s * 1000)), timeout=10)
        except grpc.RpcError as err:
            rpc_error_exit(err)
    for layer in resp.layers:
        typer.echo(f"layer {layer.layer}: {list(layer.tokens_per_expert)} balancedness {layer.balancedness:.3f}")


def mount(root: typer.Typer, serve: typer.Typer) -> None:
    """The router's commands on the `cotserve` command line."""
    serve_service(serve, "router", RouterConfig, "Start the MoE router (policy over Redis, expert load, balancing).")
    root.add_typer(moe_app, name="moe")
