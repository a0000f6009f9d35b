"""Tenants, API keys and limits: the file, the Redis scripts, and two gateways sharing one Redis."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from cotserve.common.sampling import SlaClass
from cotserve.gateway.tenants import (
    PermissionDenied, Tenant, TenantRegistry, Unauthenticated, add_key, hash_key, load_tenants,
)
from cotserve.sdk import Client
from cotserve.sdk import PermissionDenied as SdkPermissionDenied
from cotserve.sdk import ResourceExhausted as SdkResourceExhausted
from cotserve.sdk import Unauthenticated as SdkUnauthenticated
from tests.conftest import start_gateway, stop_process


def test_add_key_stores_only_the_hash_and_the_key_authenticates(tmp_path):
    path = tmp_path / "tenants.toml"
    key = add_key(path, "acme", requests_per_min=60, max_concurrent=4)
    text = path.read_text()
    assert key not in text and hashlib.sha256(key.encode()).hexdigest() in text
    second = add_key(path, "acme")  # a second key for the same tenant keeps its limits
    reg = TenantRegistry.from_file(path)
    for k in (key, second):
        t = reg.authenticate({"authorization": f"Bearer {k}"})
        assert (t.name, t.requests_per_min, t.max_concurrent, t.tokens_per_min) == ("acme", 60, 4, None)
    with pytest.raises(Unauthenticated, match="authorization: unknown API key"):
        reg.authenticate({"authorization": "Bearer nope"})
    with pytest.raises(Unauthenticated, match="authorization: missing API key"):
        reg.authenticate({})


@pytest.mark.parametrize("name", ["acme.eu", "a.b.c", "1", "-", "_x-y.z", "." * 64])
def test_every_allowed_name_round_trips_with_its_keys_and_limits(tmp_path, name):
    """Dots are allowed in names; the file is written by a TOML writer, so `acme.eu` stays one tenant."""
    path = tmp_path / "tenants.toml"
    other = add_key(path, "acme", max_concurrent=2)
    first = add_key(path, name, requests_per_min=60)
    second = add_key(path, name)  # keeps the first key and the limits
    tenants = load_tenants(path)
    assert set(tenants) == {"acme", name}
    assert (tenants[name].requests_per_min, tenants["acme"].max_concurrent) == (60, 2)
    reg = TenantRegistry.from_file(path)
    for key, owner in ((first, name), (second, name), (other, "acme")):
        assert reg.authenticate({"authorization": f"Bearer {key}"}).name == owner


def test_the_cli_prints_the_key_once(tmp_path):
    path = tmp_path / "t.toml"
    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "tenants", "add-key", "team-b", "--file", str(path),
                          "--tokens-per-min", "1000"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    key = out.stdout.strip()
    assert key.startswith("cs-") and key not in path.read_text()
    assert load_tenants(path)["team-b"].tokens_per_min == 1000


def test_class_not_allowed_is_permission_denied():
    t = Tenant("small", sla_classes=frozenset({SlaClass.BATCH}))
    TenantRegistry.authorize(t, SlaClass.BATCH)
    with pytest.raises(PermissionDenied, match="sla_class: tenant 'small' may not use REALTIME \\(allowed: BATCH\\)"):
        TenantRegistry.authorize(t, SlaClass.REALTIME)


@pytest.mark.parametrize("text,message", [
    ("[tenants.a]\nkey_sha256 = ['xyz']\n", "key_sha256 must be a list of 64-hex-digit SHA-256 hashes"),
    ("[tenants.a]\nsla_classes = ['gold']\n", "sla_classes must list realtime, interactive and/or batch"),
    ("[tenants.a]\nrequests_per_min = 0\n", "requests_per_min must be an integer >= 1"),
    ("[tenants.a]\nmax_concurrent = true\n", "max_concurrent must be an integer >= 1"),  # a boolean is no count
    ("[tenants.a]\nsla_classes = 5\n", "sla_classes must list realtime, interactive and/or batch"),
    ("tenants = 5\n", "`tenants` must be a table of"),
    ("[tenants]\n", "defines no [tenants.NAME] table"),
    ("not toml = = =", "is not valid TOML"),
])
def test_bad_tenants_files_are_rejected_with_the_field(tmp_path, text, message):
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message.replace("[", "\\[").replace("]", "\\]")):
        load_tenants(path)


def test_two_gateways_sharing_redis_enforce_one_limit_and_auth(tmp_path, redis_url, demo_worker):
    path = tmp_path / "tenants.toml"
    limited, batch_only = "cs-limited-key", "cs-batch-only-key"
    path.write_text(f"""
[tenants.limited]
key_sha256 = ["{hash_key(limited)}"]
requests_per_min = 6

[tenants.batchonly]
key_sha256 = ["{hash_key(batch_only)}"]
sla_classes = ["batch"]
""")
    extra = ("--tenants-file", str(path), "--redis-url", redis_url)
    gateways = [start_gateway(demo_worker, extra=extra) for _ in range(2)]
    try:
        clients = [Client(address, timeout_s=60) for _, address in gateways]
        ok = refused = 0
        for i in range(16):
            try:
                clients[i % 2].generate("1+1=", max_new_tokens=8, api_key=limited)
                ok += 1
            except SdkResourceExhausted as err:
                refused += 1
                assert err.retry_after_ms is not None and err.retry_after_ms > 0
        assert (ok, refused) == (6, 10)  # one limit across both gateways
        with pytest.raises(SdkUnauthenticated):
            clients[0].generate("1+1=")
        with pytest.raises(SdkUnauthenticated, match="unknown API key"):
            clients[1].generate("1+1=", api_key="cs-wrong")
        with pytest.raises(SdkPermissionDenied, match="may not use INTERACTIVE"):
            clients[0].generate("1+1=", api_key=batch_only)
        assert clients[1].generate("1+1=", api_key=batch_only, sla="batch", max_new_tokens=16).text.endswith(" 2")
        for c in clients:
            c.close()
    finally:
        for proc, _ in gateways:
            stop_process(proc)


def test_limits_without_redis_refuse_to_start(tmp_path, demo_worker):
    path = tmp_path / "tenants.toml"
    add_key(path, "limited", requests_per_min=6)
    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "serve", "gateway", "--worker", demo_worker, "--port", "0",
                          "--tenants-file", str(path)], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in __import__("os").environ.items() if k != "COTSERVE_REDIS_URL"})
    assert out.returncode == 2 and "redis_url: tenants limited have limits" in out.stderr
