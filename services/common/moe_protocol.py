"""The MoE control plane's Redis protocol: every key and channel name, and policy (de)serialization.

- `cotserve:moe:{model}:policy`          latest ExpertPolicy (protobuf bytes); new versions are also
                                         published on the channel of the same name
- `cotserve:moe:{model}:applied:{worker}` the version a worker applied (a decimal string)
- `cotserve:moe:{model}:load`            stream of expert-load windows (bounded length)

Pub/sub drops messages while a subscriber is away, so a worker reads the key at start-up and
after every reconnect, and ignores versions not newer than its own.
"""

from __future__ import annotations

import math

from cotserve.common.v1 import common_pb2
from cotserve.common.moe_policy import LayerRouting, RoutingPolicy

PREFIX = "cotserve:moe"
LOAD_STREAM_MAXLEN = 10_000


def policy_key(model: str) -> str:
    return f"{PREFIX}:{model}:policy"


def policy_channel(model: str) -> str:
    return policy_key(model)


def applied_key(model: str, worker: str) -> str:
    return f"{PREFIX}:{model}:applied:{worker}"


def load_stream(model: str) -> str:
    return f"{PREFIX}:{model}:load"


def shape_key(model: str) -> str:
    """JSON {num_experts, top_k, moe_layers} that workers of the model register (the router validates with it)."""
    return f"{PREFIX}:{model}:shape"


def load_bucket_key(model: str, second: int) -> str:
    """Per-second sums of load windows, hash field `layer:expert` -> tokens (expiring)."""
    return f"{PREFIX}:{model}:loadsec:{second}"


LOAD_GROUP = "router"
LOAD_BUCKET_TTL_S = 3600

# Compare-and-set publish. KEYS[1] = policy key (also the channel), KEYS[2] = version key;
# ARGV[1] = the version the caller expects to be current, ARGV[2] = the policy encoded with
# version ARGV[1] + 1. Returns {1, new_version}, or {0, current_version} when another writer won.
CAS_SCRIPT = """
local cur = redis.call('GET', KEYS[2])
local current = tonumber(cur or '0')
if current ~= tonumber(ARGV[1]) then
  return {0, current}
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], tostring(current + 1))
redis.call('PUBLISH', KEYS[1], ARGV[2])
return {1, current + 1}
"""


def version_key(model: str) -> str:
    return f"{PREFIX}:{model}:version"


class PolicyError(ValueError):
    """A policy that does not fit the model; the message names the problem."""


def validate(policy: common_pb2.ExpertPolicy, *, num_experts: int, top_k: int, moe_layers: set[int]) -> None:
    for layer in policy.layers:
        if layer.layer not in moe_layers:
            raise PolicyError(f"layers[{layer.layer}]: not an MoE layer of this model (MoE layers: "
                              f"{min(moe_layers)}..{max(moe_layers)})" if moe_layers else "model has no MoE layers")
        if layer.expert_bias and len(layer.expert_bias) != num_experts:
            raise PolicyError(f"layers[{layer.layer}].expert_bias: {len(layer.expert_bias)} values, the model has "
                              f"{num_experts} experts")
        bad_bias = next(((e, b) for e, b in enumerate(layer.expert_bias) if not math.isfinite(b)), None)
        if bad_bias is not None:  # NaN would poison routing and the balancing loop for good
            raise PolicyError(f"layers[{layer.layer}].expert_bias[{bad_bias[0]}]: {bad_bias[1]} is not a finite number")
        bad = [e for e in layer.disabled_experts if e >= num_experts]
        if bad:
            raise PolicyError(f"layers[{layer.layer}].disabled_experts: expert {bad[0]} is out of range (0..{num_experts - 1})")
        k = policy.top_k or top_k
        if num_experts - len(set(layer.disabled_experts)) < k:
            raise PolicyError(f"layers[{layer.layer}].disabled_experts: {len(set(layer.disabled_experts))} disabled leaves "
                              f"fewer than top_k ({k}) experts")
    if policy.top_k > num_experts:
        raise PolicyError(f"top_k: {policy.top_k} is out of range (0..{num_experts})")


def to_routing(policy: common_pb2.ExpertPolicy) -> RoutingPolicy:
    return RoutingPolicy(
        version=policy.version,
        layers={l.layer: LayerRouting(tuple(l.expert_bias), frozenset(l.disabled_experts)) for l in policy.layers},
        top_k=policy.top_k,
    )


def parse(data: bytes, *, model: str, num_experts: int, top_k: int, moe_layers: set[int]) -> common_pb2.ExpertPolicy:
    """Bytes from Redis to a validated policy for `model`; raises PolicyError on anything else."""
    policy = common_pb2.ExpertPolicy()
    try:
        policy.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError and friends
        raise PolicyError(f"not an ExpertPolicy message ({type(exc).__name__})") from None
    if policy.model != model:
        raise PolicyError(f"model: policy is for {policy.model!r}, this worker serves {model!r}")
    validate(policy, num_experts=num_experts, top_k=top_k, moe_layers=moe_layers)
    return policy
