"""Where a benchmark's --out puts its JSON: a name under bench/results, or a path ending in .json as it is."""

from __future__ import annotations

import json

from bench import common


def test_a_name_goes_under_results_and_a_json_path_is_used_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    named = common.write_results("ahead", [{"a": 1}])
    assert named == tmp_path / "results" / "ahead.json"
    path = common.write_results(str(tmp_path / "elsewhere" / "run.json"), [{"b": 2}], {"note": "x"})
    assert path == tmp_path / "elsewhere" / "run.json"
    saved = json.loads(path.read_text())
    assert saved["records"] == [{"b": 2}] and saved["meta"]["note"] == "x"
