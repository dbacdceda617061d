"""Kernel paths are probed, never assumed, and every path serves the same model.

oneDNN's own ``ONEDNN_MAX_CPU_ISA=AVX2`` makes this machine's oneDNN behave as
on an AVX2-only CPU (the AMD EPYC where bfloat16 packing raised at load), so
that CPU's path is exercised here whatever CPU runs the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.server.kernels.select import ATEN, ONEDNN_PACKED, choose_linear, cpu_capability, probe_onednn_packed
from tests.conftest import running_server

pytestmark = pytest.mark.cpu_only  # the CPU kernels' paths and guarantees

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_probe_never_raises_and_agrees_with_torchs_own_guard(dtype):
    ok, why = probe_onednn_packed(dtype)
    assert why
    if dtype == torch.float16:
        assert not ok  # no packed path is offered for a dtype we do not serve
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert not ok and "bfloat16" in why


def test_forcing_the_fallback_always_works_and_says_so():
    choice = choose_linear("aten", torch.bfloat16, CPU)
    assert choice.linear == ATEN and "forced" in choice.reason
    assert choice.cpu_capability == cpu_capability()


def test_auto_takes_the_packed_path_exactly_where_the_probe_allows():
    for dtype in (torch.float32, torch.bfloat16):
        ok, _ = probe_onednn_packed(dtype)
        assert choose_linear("auto", dtype, CPU).linear == (ONEDNN_PACKED if ok else ATEN)


def test_unknown_kernel_name_is_refused():
    with pytest.raises(ValueError):
        choose_linear("fastest", torch.float32, CPU)


def test_capabilities_report_the_kernel_path(tiny_llama_dir):
    with running_server(tiny_llama_dir, linear_kernel="aten", step_ops="eager") as server, \
            ExecutorClient(server.target) as ex:
        caps = ex.capabilities()
    assert caps.kernel_path == "linear=aten (forced by configuration); step=eager (forced by configuration)"
    assert caps.cpu_capability == cpu_capability()


_AVX2_ONLY_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from ferrum_rpc.client import ExecutorClient, LogitsPolicy
    from ferrum_rpc.server.kernels.select import choose_linear
    from tests.conftest import running_server

    model_dir, kernel = sys.argv[1], sys.argv[2]
    report = {"bf16_supported": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}
    try:
        choose_linear("onednn-packed", torch.bfloat16, torch.device("cpu"))
        report["forced_packed"] = "loaded"
    except ValueError as exc:
        report["forced_packed"] = str(exc)
    with running_server(model_dir, dtype="bfloat16", linear_kernel=kernel) as server, \\
            ExecutorClient(server.target, timeout=60) as ex:
        caps = ex.capabilities()
        out = ex.prefill([5, 17, 101, 3, 250, 42, 7, 9], logits=LogitsPolicy.full(all_positions=True))
        step = ex.decode(11, out.kv_cache)
    report.update(kernel_path=caps.kernel_path, cpu=caps.cpu_capability,
                  prefill=out.logits.values.tolist(), decode=step.logits.values.tolist())
    print(json.dumps(report))
""")


@pytest.mark.parametrize("kernel", ["auto", "aten"])
def test_bfloat16_on_an_avx2_only_cpu_falls_back_and_matches_transformers(kernel, tiny_llama_dir, hf_tiny_llama):
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2", FERRUM_RPC_MAX_ISA="avx2")
    proc = subprocess.run([sys.executable, "-c", _AVX2_ONLY_SCRIPT, str(tiny_llama_dir), kernel], env=env,
                          capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["bf16_supported"] is False  # the emulation took: oneDNN sees no AVX-512
    assert report["cpu"] == "AVX2"
    # auto: batch-invariant on the panel GEMM (its AVX2 multiply-add path); aten: oneDNN's
    # packed bfloat16 linear cannot run, so the fallback
    assert report["kernel_path"].startswith("linear=panel_gemm (batch-invariant" if kernel == "auto" else "linear=aten")
    assert "step=fused (built and probed OK (avx2 inner loops))" in report["kernel_path"] or \
        "step=eager (fallback" in report["kernel_path"]
    assert "cannot run here" in report["forced_packed"]
    with torch.no_grad():
        ref = hf_tiny_llama(torch.tensor([[5, 17, 101, 3, 250, 42, 7, 9, 11]])).logits[0].numpy()
    scale = np.abs(ref).max()
    np.testing.assert_allclose(np.array(report["prefill"]), ref[:-1], atol=0.03 * scale, rtol=0)
    np.testing.assert_allclose(np.array(report["decode"])[0], ref[-1], atol=0.03 * scale, rtol=0)


def test_the_float32_one_row_choice_is_timed_once_per_host(tmp_path, monkeypatch):
    """Servers of one configuration on one host must compute the same bits (a moved
    sequence decodes bit-identically); two servers timing at once once chose
    differently, so the first timing is kept on disk and every later load reads it."""
    from ferrum_rpc.server.kernels import select as kernels

    if not probe_onednn_packed(torch.float32)[0]:
        pytest.skip("no oneDNN packed float32 linear here")
    monkeypatch.setenv("FERRUM_RPC_HOME", str(tmp_path))
    kernels.packed_float32_wins_at_one_row.cache_clear()
    try:
        wins, why = kernels.packed_float32_wins_at_one_row()
        (saved,) = (tmp_path / "kernels").glob("float32-one-row-*.json")
        assert json.loads(saved.read_text())["wins"] == wins and why.startswith("one row: oneDNN packed")
        # another process reads the same answer, even one the timing would contradict
        saved.write_text(json.dumps({"wins": not wins, "timing": "forged"}))
        code = ("from ferrum_rpc.server.kernels import select as kernels; "
                "print(kernels.packed_float32_wins_at_one_row())")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "FERRUM_RPC_HOME": str(tmp_path)}).stdout
        assert out.strip() == repr((not wins, f"forged (timed once on this host: {saved.name})"))
    finally:
        kernels.packed_float32_wins_at_one_row.cache_clear()
