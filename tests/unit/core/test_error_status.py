"""google.rpc.Status is the one shape of an error, in trailers and in streams."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import status_pb2

from ferrum_rpc.errors import (
    ERROR_CLASSES,
    ExecutorError,
    KvCapacityExhausted,
    Reason,
    from_status_proto,
    to_status_proto,
)


@pytest.mark.parametrize("reason", list(Reason))
def test_every_reason_round_trips_through_a_status_message(reason):
    err = ERROR_CLASSES[reason]("some detail")
    back = from_status_proto(status_pb2.Status.FromString(to_status_proto(err).SerializeToString()))
    assert type(back) is type(err) and back.code == err.code and back.message == "some detail"


@pytest.mark.parametrize("code", [99, -1, 17])
def test_a_status_code_grpc_does_not_define_is_unknown_not_a_crash(code):
    """error_from_detail once raised a bare StopIteration here."""
    err = from_status_proto(status_pb2.Status(code=code, message="from a newer server"))
    assert type(err) is ExecutorError and err.code == grpc.StatusCode.UNKNOWN
    assert err.message == "from a newer server"


def test_an_unknown_reason_keeps_the_code():
    status = to_status_proto(KvCapacityExhausted("full"))
    status.details[0].value = status.details[0].value.replace(b"KV_CAPACITY_EXHAUSTED", b"SOMETHING_NEWER______")
    err = from_status_proto(status)
    assert type(err) is ExecutorError and err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
