"""bench.gpu_decode's table over the committed GPU run: the ratios docs/gpu.md quotes."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gpu_decode import print_table

RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results" / "gpu_decode_h200.json"


def test_the_table_gives_the_ratios_the_docs_quote(capsys):
    run = json.loads(RESULTS.read_text())
    assert run["meta"]["device"] == "NVIDIA H200" and "decode=cuda-graphs" in run["meta"]["kernel_path"]
    print_table(run["records"])
    rows = {tuple(line.split()[:2]): line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    # each row ends with ahead/transformers, grpc/transformers, grpc/in process, the wire's ms, ahead's step/floor
    assert rows[("bfloat16", "1")][-5:-1] == ["8.06", "6.19", "0.58", "1.748"]
    assert rows[("float32", "32")][-5:-2] == ["2.88", "3.68", "0.54"]
