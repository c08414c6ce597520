"""UpdatePolicy takes each key's own type only (reliability issue, bug 5):
`set={"queue_limit": "true"}` was coerced to a global queue of 1. Every key
of the policy is tried with the JSON values of the wrong types, over real
gRPC and through `burstgate admin policy set`; each is refused
INVALID_ARGUMENT naming `set[<key>]` and the expected type, and nothing is
stored or audited."""

from __future__ import annotations

import json
from functools import partial
from typing import Any, Literal, get_origin

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.domain.policy import Policy
from tests.integration.admin.conftest import Env, code_of
from tests.support import TEST_POOLS, error_details

# Wrong-typed JSON values per key type: none may be stored.
WRONG: dict[str, list[str]] = {
    "int": ["true", "false", '"5"', "1.5", "null", "[1]", '"true"'],
    "float": ["true", '"0.5"', "null", "[0.5]", "NaN", "Infinity"],
    "bool": ["1", "0", '"true"', "null", "yes"],
    "enum": ["0", "true", '"nope"', "nope", "null"],
    "list": ['"a"', "[1]", '{"a": 1}', "true"],
    "dict": ['{"premium": true}', '{"premium": 1.5}', '{"premium": "1"}', "[]", "1"],
}
EXPECTED = {
    "int": "expected an integer",
    "float": "expected a finite number",
    "bool": "expected a boolean",
    "enum": "expected one of",
    "list": "expected a list of strings",
    "dict": "expected an object of integers",
}


def kind(key: str) -> str:
    annotation = Policy.model_fields[key].annotation
    origin = get_origin(annotation)
    if origin is Literal:
        return "enum"
    if origin is list:
        return "list"
    if origin is dict:
        return "dict"
    names: dict[Any, str] = {int: "int", float: "float", bool: "bool"}
    return names[annotation]


CASES = [(key, value) for key in sorted(Policy.model_fields) for value in WRONG[kind(key)]]


def overrides(env: Env) -> dict[str, Any]:
    view = env.admin.call("GetPolicy", apb.GetPolicyRequest())
    return {s.key: json.loads(s.value_json) for s in view.settings if s.overridden}


def test_every_key_is_tried() -> None:
    # a new key of a type without a rule fails here rather than pass untyped
    assert {kind(key) for key in Policy.model_fields} <= set(WRONG)
    assert len({key for key, _ in CASES}) == len(Policy.model_fields)


def test_wrong_types_are_refused_naming_the_key_and_nothing_is_stored(env: Env) -> None:
    events = len(env.audit())
    for key, value in CASES:
        code, details = code_of(
            partial(env.admin.call, "UpdatePolicy", apb.UpdatePolicyRequest(set={key: value}))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (key, value, details)
        assert details.startswith(f"set[{key}]: {EXPECTED[kind(key)]}"), (key, value, details)
    assert overrides(env) == {}
    assert len(env.audit()) == events  # nothing audited: nothing changed
    policy = env.srv.on_loop(lambda: env.srv.plane.service.policy)
    # the live policy is the default still (with the test pools declared:
    # tests/support.TEST_POOLS)
    assert policy == Policy(known_pools=list(TEST_POOLS))


def test_the_issue_case_sets_no_queue_of_one(env: Env) -> None:
    with pytest.raises(grpc.RpcError) as err:
        env.admin.call("UpdatePolicy", apb.UpdatePolicyRequest(set={"queue_limit": "true"}))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "set[queue_limit]: expected an integer, got true"
    details = error_details(err.value)
    assert details.info.metadata["field"] == "set[queue_limit]"
    assert env.srv.on_loop(lambda: env.srv.plane.service.policy.queue_limit) == 10_000
    # the right type is taken, as JSON (5.0 is the integer 5)
    for text, stored in (("7", 7), ("7.0", 7)):
        env.admin.call("UpdatePolicy", apb.UpdatePolicyRequest(set={"queue_limit": text}))
        assert overrides(env)["queue_limit"] == stored
    env.admin.call(
        "UpdatePolicy",
        apb.UpdatePolicyRequest(
            set={"bp_retry_cap_s": "5", "shadow_mode": "false", "stale_policy": "fail_closed"}
        ),
    )
    got = overrides(env)
    assert got["bp_retry_cap_s"] == 5.0 and got["shadow_mode"] is False
    assert got["stale_policy"] == "fail_closed"


def test_values_beyond_what_the_fast_path_takes_are_refused(env: Env) -> None:
    """An integer too large for the fast path was stored, then failed every
    config apply (global_inflight_tokens = 2^70: the config never reloaded
    again). Every integer key has an upper bound now."""
    int_keys = [k for k in sorted(Policy.model_fields) if kind(k) == "int"]
    for key in int_keys:
        code, details = code_of(
            partial(env.admin.call, "UpdatePolicy", apb.UpdatePolicyRequest(set={key: str(2**70)}))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (key, details)
        assert details.startswith(f"set[{key}]: Input should be less than or equal to"), details
    code, details = code_of(
        partial(
            env.admin.call,
            "UpdatePolicy",
            apb.UpdatePolicyRequest(set={"lane_ttft_slo_ms": json.dumps({"premium": 2**40})}),
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "lane_ttft_slo_ms" in details
    assert overrides(env) == {}
    # the config still applies: a later change is live at once
    env.admin.call("UpdatePolicy", apb.UpdatePolicyRequest(set={"global_inflight_tokens": "500"}))
    limit = env.srv.on_loop(lambda: env.srv.plane.service.policy.global_inflight_tokens)
    assert limit == 500


def test_unknown_and_unparsable_keys_name_the_map_entry(env: Env) -> None:
    for request, field in (
        (apb.UpdatePolicyRequest(set={"no_such_key": "1"}), "set[no_such_key]"),
        (apb.UpdatePolicyRequest(reset=["no_such_key"]), "reset[no_such_key]"),
        (apb.UpdatePolicyRequest(set={"queue_limit": "{oops"}), "set[queue_limit]"),
        (apb.UpdatePolicyRequest(set={"known_pools": "[" * 5000 + "]" * 5000}), "set[known_pools]"),
    ):
        code, details = code_of(partial(env.admin.call, "UpdatePolicy", request))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith(field + ": "), details
        assert len(details) < 200, details



@pytest.mark.usefixtures("server_logs_elsewhere")
def test_the_cli_refuses_the_same_way(env: Env) -> None:
    variables = {"BURSTGATE_ADMIN_TARGET": env.target, "BURSTGATE_API_KEY": env.keys.admin}
    runner = CliRunner()
    for assignment, message in (
        ("queue_limit=true", "set[queue_limit]: expected an integer, got true"),
        ("shadow_mode=1", "set[shadow_mode]: expected a boolean (true or false), got 1"),
        ("bp_hard_threshold=true", "set[bp_hard_threshold]: expected a finite number, got true"),
        ("stale_policy=open", "set[stale_policy]: expected one of"),
    ):
        result = runner.invoke(app, ["admin", "policy", "set", assignment], env=variables)
        assert result.exit_code == 2, (assignment, result.stdout, result.stderr)
        assert f"INVALID_ARGUMENT: {message}" in result.stderr, result.stderr
    assert overrides(env) == {}
    ok = runner.invoke(app, ["admin", "policy", "set", "queue_limit=3", "--json"], env=variables)
    assert ok.exit_code == 0, ok.stderr
    assert json.loads(ok.stdout)["queue_limit"] == 3
