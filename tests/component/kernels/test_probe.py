"""The shared probe (server/kernels/probe.py) and the build's cache key (build.py):
a probe never raises and answers once per process; any edit under csrc/ builds afresh."""

from __future__ import annotations

import shutil

import pytest
import torch

from ferrum_rpc.server.kernels import build
from ferrum_rpc.server.kernels.probe import Disagrees, as_probe, check, relative_error, within


def test_relative_error_is_over_the_reference_magnitude_at_least_one():
    want = torch.tensor([4.0, -8.0])
    assert relative_error(torch.tensor([4.0, -7.0]), want) == 1 / 8
    assert relative_error(torch.tensor([0.25]), torch.tensor([0.5])) == 0.25  # small values: absolute
    assert relative_error(torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([2.0])) == 0.5  # in float32


def test_within_and_check_raise_disagrees_with_the_error_in_the_message():
    within(1e-5, 1e-4, "unused")
    with pytest.raises(Disagrees, match=r"^op disagrees \(relative error 2\.00e-03\)$"):
        within(2e-3, 1e-4, "op disagrees")
    with pytest.raises(Disagrees, match="nan"):  # NaN is never within a tolerance
        check(torch.tensor([float("nan")]), torch.tensor([1.0]), 1.0, "op")


def test_a_probe_answers_once_per_argument_and_never_raises():
    calls = []

    @as_probe(failed="thing failed: ", limit=5)
    def probe_thing(kind: str):
        calls.append(kind)
        if kind == "raises":
            raise RuntimeError("0123456789")
        if kind == "disagrees":
            check(torch.tensor([2.0]), torch.tensor([1.0]), 1e-4, "thing disagrees")
        return True, "OK"

    assert probe_thing("fine") == (True, "OK")
    assert probe_thing("raises") == (False, "thing failed: RuntimeError: 01234")
    assert probe_thing("disagrees") == (False, "thing disagrees (relative error 1.00e+00)")
    for kind in ("fine", "raises", "disagrees"):
        probe_thing(kind)
    assert calls == ["fine", "raises", "disagrees"]
    assert probe_thing.cache_info().currsize == 3


def test_the_build_compiles_every_cpp_and_keys_on_every_file_in_csrc(tmp_path, monkeypatch):
    assert [p.name for p in build.sources()] == sorted(p.name for p in build.CSRC.glob("*.cpp"))
    assert {"rms_norm.cpp", "silu_mul.cpp", "attention.cpp", "linear_rows.cpp", "decode_stack.cpp", "woq.cpp",
            "qact.cpp"} <= {p.name for p in build.sources()}
    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC, copy)
    monkeypatch.setattr(build, "CSRC", copy)
    key = build._key()
    assert build._key() == key
    (copy / "common.h").write_text((copy / "common.h").read_text() + "\n")  # a header alone
    assert build._key() != key
