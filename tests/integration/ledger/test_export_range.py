"""Period bounds of `burstgate export` / `burstgate margin` and of the
LedgerService range RPCs (reliability issue, bug 9): `burstgate export
--from 2026-01-01 --to 2300-01-01` failed with a raw SQL error (a bound
beyond the ledger's 64-bit nanosecond columns). An out-of-range or inverted
period is a usage error naming the option (exit code 2) on the CLI, and
INVALID_ARGUMENT naming the field over gRPC. SQLite and PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import ledger_pb2 as lpb
from typer.testing import CliRunner

from controlplane.cli import app
from tests.integration.ledger.conftest import Served

RANGE = "between 1970-01-01 and 2262-04-11T23:47:16Z"


def usage_error(*args: str) -> str:
    """Run the CLI; expect a usage error; its message on one line."""
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 2, (args, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return " ".join(result.output.replace("│", " ").split())


@pytest.mark.parametrize(
    ("options", "option", "message"),
    [
        (("--from", "2026-01-01", "--to", "2300-01-01"), "--to", RANGE),  # the issue's
        (("--from", "1900-01-01", "--to", "2026-01-01"), "--from", RANGE),
        (("--from", "0", "--to", "99999999999"), "--to", RANGE),  # Unix seconds: year 5138
        (("--from", "2026-02-01", "--to", "2026-01-01"), "--to", "must be after --from"),
        (("--from", "2026-01-01", "--to", "2026-01-01"), "--to", "must be after --from"),
        (("--from", "yesterday"), "--from", "not an ISO 8601 time or Unix seconds"),
    ],
)
def test_bad_periods_are_usage_errors_naming_the_option(
    migrated_url: str, options: tuple[str, ...], option: str, message: str
) -> None:
    for command in ("export", "margin"):
        text = usage_error(command, *options, "--database-url", migrated_url)
        assert f"Invalid value for '{option}'" in text and message in text, text
        assert "sqlalchemy" not in text.lower() and "Traceback" not in text, text


def test_the_widest_period_works(migrated_url: str, tmp_path: Path) -> None:
    out = tmp_path / "all.csv"
    result = CliRunner().invoke(
        app,
        ["export", "--from", "1970-01-01", "--to", "2262-04-11", "--out", str(out),
         "--database-url", migrated_url],
    )  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)
    assert '"rows": 0' in (tmp_path / "all.csv.manifest.json").read_text()


def test_the_issue_command_in_a_real_process(migrated_url: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "controlplane", "export", "--from", "2026-01-01", "--to",
         "2300-01-01", "--database-url", migrated_url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "Invalid value for '--to'" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert run.stdout == ""


def test_the_range_rpcs_name_the_bad_bound(served: Served) -> None:
    stub = served.ledger()
    metadata = (("authorization", f"Bearer {served.key}"),)
    cases = [
        (lpb.ExportLedgerRequest(start_unix_ns=-1), "start_unix_ns"),
        (lpb.ExportLedgerRequest(start_unix_ns=10, end_unix_ns=5), "end_unix_ns"),
        (lpb.GetUsageRequest(start_unix_ns=-(2**63)), "start_unix_ns"),
        (lpb.GetMarginReportRequest(start_unix_ns=5, end_unix_ns=-5), "end_unix_ns"),
        (lpb.ListMarginWarningsRequest(start_unix_ns=-1), "start_unix_ns"),
        (lpb.ListPricingWindowsRequest(start_unix_ns=-1), "start_unix_ns"),
    ]
    for request, field in cases:
        with pytest.raises(grpc.RpcError) as err:
            if isinstance(request, lpb.ExportLedgerRequest):
                list(stub.ExportLedger(request, timeout=10, metadata=metadata))
            elif isinstance(request, lpb.GetUsageRequest):
                stub.GetUsage(request, timeout=10, metadata=metadata)
            elif isinstance(request, lpb.GetMarginReportRequest):
                stub.GetMarginReport(request, timeout=10, metadata=metadata)
            elif isinstance(request, lpb.ListMarginWarningsRequest):
                stub.ListMarginWarnings(request, timeout=10, metadata=metadata)
            else:
                stub.ListPricingWindows(request, timeout=10, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
        assert err.value.details().startswith(f"{field}: "), err.value.details()
    # the widest period the wire allows is answered
    chunks = list(
        stub.ExportLedger(
            lpb.ExportLedgerRequest(start_unix_ns=0, end_unix_ns=2**63 - 1),
            timeout=30,
            metadata=metadata,
        )
    )
    assert '"rows": 0' in chunks[-1].manifest_json
