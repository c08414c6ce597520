"""Every change through an operator RPC is audited (reliability issue, bug
10: LedgerService.SetPrice wrote no audit row).

The write methods are read from the proto descriptors of every service an
admin key may call (every method but Get*/List*/Export*), so a new write
RPC fails :func:`test_every_write_method_is_covered` until it gets an audit
assertion here. Each write is made over real gRPC with an admin key and must
leave exactly one new audit record naming the key, the action and the
target, with the change's before and after. The CLI's database route for
prices is audited too (as ``local:<os user>``)."""

from __future__ import annotations

import getpass
import json
import pkgutil
from collections.abc import Callable, Iterator
from importlib import import_module
from typing import Any

import grpc
import pytest
from burstgate_client._proto.burstgate import v1 as proto_v1
from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
from burstgate_client._proto.burstgate.v1 import ledger_pb2 as lpb
from burstgate_client._proto.burstgate.v1 import ledger_pb2_grpc as lpb_grpc
from burstgate_client.admin import authenticated_channel
from google.protobuf.field_mask_pb2 import FieldMask
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.domain.keys import Role
from controlplane.rpc.auth import READ_PREFIXES, rule_for
from tests.integration.admin.conftest import Env


def operator_write_methods() -> set[str]:
    """``Service/Method`` of every write an admin key may call, from the
    descriptors of every burstgate.v1 proto module."""
    found: set[str] = set()
    for info in pkgutil.iter_modules(proto_v1.__path__):
        if not info.name.endswith("_pb2"):
            continue
        module: Any = import_module(f"{proto_v1.__name__}.{info.name}")
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                path = f"/{service.full_name}/{method.name}"
                if Role.ADMIN in rule_for(path).roles and not method.name.startswith(READ_PREFIXES):
                    found.add(f"{service.name}/{method.name}")
    return found


class Writes:
    """One real change per write method, in an order that makes each valid;
    each returns the (action, target) its audit record must carry."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.channel = authenticated_channel(env.target, env.keys.admin)
        self.ledger = lpb_grpc.LedgerServiceStub(self.channel)
        self.key_id = ""

    def admin(self, method: str, request: Any) -> Any:
        return self.env.admin.call(method, request)

    def steps(self) -> list[tuple[str, Callable[[], tuple[str, str]]]]:
        tenant = apb.Tenant(tenant_id="gamma", token_rate="5", burst_tokens=50)
        price = lpb.Price(tenant_id="acme", model="m1", input_per_mtok="2", output_per_mtok="8")
        return [
            ("AdminService/CreateTenant", lambda: (
                self.admin("CreateTenant", apb.CreateTenantRequest(tenant=tenant)),
                ("tenant.create", "tenant:gamma"))[1]),
            ("AdminService/UpdateTenant", lambda: (
                self.admin("UpdateTenant", apb.UpdateTenantRequest(
                    tenant=apb.Tenant(tenant_id="gamma", burst_tokens=60),
                    update_mask=FieldMask(paths=["burst_tokens"]))),
                ("tenant.update", "tenant:gamma"))[1]),
            ("AdminService/DisableTenant", lambda: (
                self.admin("DisableTenant", apb.DisableTenantRequest(tenant_id="gamma")),
                ("tenant.disable", "tenant:gamma"))[1]),
            ("AdminService/EnableTenant", lambda: (
                self.admin("EnableTenant", apb.EnableTenantRequest(tenant_id="gamma")),
                ("tenant.enable", "tenant:gamma"))[1]),
            ("AdminService/DeleteTenant", lambda: (
                self.admin("DeleteTenant", apb.DeleteTenantRequest(tenant_id="gamma")),
                ("tenant.delete", "tenant:gamma"))[1]),
            ("AdminService/UpdateLane", lambda: (
                self.admin("UpdateLane", apb.UpdateLaneRequest(
                    lane=apb.Lane(name="batch", wait_target_ms=6000),
                    update_mask=FieldMask(paths=["wait_target_ms"]))),
                ("lane.update", "lane:batch"))[1]),
            ("AdminService/UpdatePolicy", lambda: (
                self.admin("UpdatePolicy", apb.UpdatePolicyRequest(set={"queue_limit": "9"})),
                ("policy.update", "policy"))[1]),
            ("AdminService/CreateApiKey", self._create_key),
            ("AdminService/RevokeApiKey", lambda: (
                self.admin("RevokeApiKey", apb.RevokeApiKeyRequest(key_id=self.key_id)),
                ("key.revoke", f"key:{self.key_id}"))[1]),
            ("LedgerService/SetPrice", lambda: (
                self.ledger.SetPrice(lpb.SetPriceRequest(price=price), timeout=10),
                ("price.set", "price:acme/m1"))[1]),
            ("LedgerService/DeletePrice", lambda: (
                self.ledger.DeletePrice(
                    lpb.DeletePriceRequest(tenant_id="acme", model="m1"), timeout=10),
                ("price.delete", "price:acme/m1"))[1]),
        ]  # fmt: skip

    def _create_key(self) -> tuple[str, str]:
        made = self.admin("CreateApiKey", apb.CreateApiKeyRequest(name="audited", role="viewer"))
        self.key_id = made.key.key_id
        return "key.create", f"key:{self.key_id}"


@pytest.fixture
def writes(env: Env) -> Iterator[Writes]:
    made = Writes(env)
    yield made
    made.channel.close()


def test_every_write_method_is_covered(writes: Writes) -> None:
    covered = [name for name, _ in writes.steps()]
    assert len(covered) == len(set(covered))
    missing = operator_write_methods() - set(covered)
    assert not missing, f"write RPCs without an audit assertion here: {sorted(missing)}"
    assert set(covered) <= operator_write_methods()  # no stale entry


def test_every_write_leaves_its_audit_record(env: Env, writes: Writes) -> None:
    admin_actor = f"key:{env.keys.ids['admin']} (test-admin)"
    last = max((e.id for e in env.audit()), default=0)
    for name, write in writes.steps():
        action, target = write()
        new = [e for e in env.audit() if e.id > last]
        assert len(new) == 1, (name, [(e.action, e.target) for e in new])
        (event,) = new
        assert (event.action, event.target) == (action, target), name
        assert (event.actor, event.actor_role) == (admin_actor, "admin"), name
        assert event.request_id, name
        assert event.before_json or event.after_json, name
        last = event.id
    by_action = {e.action: e for e in env.audit(target="price:acme/m1")}
    created = by_action["price.set"]
    assert created.before_json == ""
    after = json.loads(created.after_json)
    assert (after["input_per_mtok"], after["output_per_mtok"], after["currency"]) == (
        "2", "8", "USD",
    )  # fmt: skip
    deleted = by_action["price.delete"]
    assert json.loads(deleted.before_json) == after and deleted.after_json == ""


def test_price_changes_record_before_and_after_and_refusals_nothing(
    env: Env, writes: Writes
) -> None:
    set_price = writes.ledger.SetPrice
    set_price(
        lpb.SetPriceRequest(price=lpb.Price(tenant_id="acme", input_per_mtok="1")), timeout=10
    )
    set_price(
        lpb.SetPriceRequest(price=lpb.Price(tenant_id="acme", input_per_mtok="3")), timeout=10
    )
    # the same values again change nothing: no record
    set_price(
        lpb.SetPriceRequest(price=lpb.Price(tenant_id="acme", input_per_mtok="3")), timeout=10
    )
    with pytest.raises(grpc.RpcError) as err:
        set_price(
            lpb.SetPriceRequest(price=lpb.Price(tenant_id="acme", input_per_mtok="-1")), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        writes.ledger.DeletePrice(lpb.DeletePriceRequest(tenant_id="nobody"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    events = env.audit(target="price:acme/*")
    assert [e.action for e in events] == ["price.set", "price.set"]
    update = events[0]
    assert json.loads(update.before_json)["input_per_mtok"] == "1"
    assert json.loads(update.after_json)["input_per_mtok"] == "3"
    assert not env.audit(target="price:nobody/*")


def test_the_clis_price_commands_are_audited_as_local(env: Env) -> None:
    runner = CliRunner()
    db = ["--database-url", env.url]
    done = runner.invoke(app, ["price", "set", "beta", "--model", "m2", "--output", "4", *db])
    assert done.exit_code == 0, done.output
    done = runner.invoke(app, ["price", "delete", "beta", "--model", "m2", *db])
    assert done.exit_code == 0, done.output
    events = env.audit(target="price:beta/m2")
    assert [e.action for e in events] == ["price.delete", "price.set"]
    assert all(e.actor == f"local:{getpass.getuser()}" and e.actor_role == "local" for e in events)
