"""The error table has one definition, the proto's ``ErrorReason`` and its value options;
every other copy is generated from it or checked here: Python's (read from the
descriptor), docs/contract.md's rows, the classes a reason becomes, and the one rule
both clients apply to statuses without a reason (the C++ client reads the same
descriptor: ``clients/cpp/src/errors.cpp``)."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from ferrum_rpc.errors import ERROR_CLASSES, OUTCOME_UNKNOWN, RETRYABLE, STATUS_FOR_REASON, ExecutorError, Reason
from ferrum_rpc.v1 import executor_pb2 as pb

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[3]
PROTO_VALUES = [v for v in pb.ErrorReason.DESCRIPTOR.values if v.number]


def _docs_rows() -> dict[str, set[str]]:
    """reason -> the gRPC code names docs/contract.md's error table gives it."""
    rows: dict[str, set[str]] = {}
    for line in (ROOT / "docs" / "contract.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"[A-Z_]+", cells[-1]) and re.fullmatch(r"[A-Z_]+", cells[-2]):
            rows.setdefault(cells[-1], set()).add(cells[-2])
    return rows


def test_python_reads_every_reason_of_the_proto():
    assert [r.value for r in Reason] == [v.name for v in PROTO_VALUES]
    for value in PROTO_VALUES:
        options = value.GetOptions().Extensions
        reason = Reason(value.name)
        assert STATUS_FOR_REASON[reason].value[0] == options[pb.status_code]
        assert (reason in RETRYABLE) == options[pb.retryable]
        assert (reason in OUTCOME_UNKNOWN) == options[pb.outcome_unknown]


def test_every_reason_has_its_class():
    assert set(ERROR_CLASSES) == set(Reason)


def test_the_docs_table_gives_every_reason_its_code_and_no_other():
    rows = _docs_rows()
    table = {r.value: {STATUS_FOR_REASON[r].name} for r in Reason}
    assert {reason: codes for reason, codes in rows.items() if reason in table} == table
    assert set(rows) - set(table) == set(), "a reason in the docs that the proto lacks"


def test_no_other_hand_written_table_of_reasons():
    """The C++ client reads the descriptor; the proto's file comment points to the enum."""
    cpp = (ROOT / "clients" / "cpp" / "src" / "errors.cpp").read_text()
    assert "ErrorReason_descriptor()" in cpp
    listed = [line for line in cpp.splitlines() if sum(f'"{r.value}"' in line for r in Reason) > 1]
    assert listed == []  # a line naming several reasons is a copy of the table
    header = (ROOT / "protos" / "ferrum_rpc" / "v1" / "executor.proto").read_text().split("syntax =")[0]
    assert not [r.value for r in Reason if r.value in header]


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_a_status_without_a_reason_follows_the_stated_rule(code):
    err = ExecutorError("x", code=code)
    unknown = {"CANCELLED", "DEADLINE_EXCEEDED", "UNAVAILABLE", "UNKNOWN", "INTERNAL"}
    assert err.outcome_unknown == (code.name in unknown)
    assert err.retryable == (code is grpc.StatusCode.UNAVAILABLE)
