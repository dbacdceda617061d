"""The shared test vectors (tests/vectors/cases.json) in every client: the Python, Node.js,
Rust and C++ runners each run every case against one real server hosting tiny_llama_dir,
and each client's results must equal the recorded ``expect`` (token ids, handle lengths,
error codes and reasons, FULL float32 logits by digest), naming the client and the case
where they do not.

Every RPC of the service must appear in a case or in the file's ``skipped`` list with a
reason, so a new RPC fails here until a case exists; a case then fails in every client
whose runner does not know its call. Expectations are re-recorded with ``make vectors``
(by the Python client); their greedy ids are checked against transformers' own model.

The C++ and Rust runners are built as tests/contract/test_cpp_client.py and
test_rust_client.py build those clients (their fixtures): without the toolchain they
skip, saying so, unless FERRUM_REQUIRE_CPP=1 / FERRUM_REQUIRE_RUST=1 (then they fail).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import oracle_rows, running_server
from tests.contract.test_cpp_client import cpp_bin  # noqa: F401 (fixture)
from tests.contract.test_rust_client import rust_bin  # noqa: F401 (fixture)
from tests.node_env import node_packages
from tests.vectors.record import digested, service_rpcs, weights_digest

from ferrum_rpc.client import ExecutorClient

pytestmark = pytest.mark.timeout(2400)  # the first Rust test may wait for a cold build

ROOT = Path(__file__).resolve().parents[2]
CASES_FILE = ROOT / "tests" / "vectors" / "cases.json"
DOC = json.loads(CASES_FILE.read_text())
CALL_RPCS = {  # each step's call and the RPC it makes
    "info": "GetModelInfo", "status": "GetStatus", "prefill": "Prefill", "batch_prefill": "BatchPrefill",
    "decode": "Decode", "batch_decode": "BatchDecode", "session": "DecodeSession", "verify": "ForwardVerify",
    "truncate": "TruncateKv", "release": "ReleaseCache", "fork": "ForkCache", "forward": "Forward",
}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(tiny_llama_dir) as srv:
        yield srv


# -- the file itself -------------------------------------------------------------------------
def test_every_rpc_has_a_case_or_a_reasoned_skip():
    rpcs = service_rpcs()
    assert DOC["rpcs"] == rpcs, "the service's RPCs changed: add a case (or a reasoned skip), then `make vectors`"
    covered = {rpc for case in DOC["cases"] for rpc in case["rpcs"]}
    skipped = DOC["skipped"]
    assert not covered & set(skipped), f"both covered and skipped: {sorted(covered & set(skipped))}"
    missing = [rpc for rpc in rpcs if rpc not in covered and rpc not in skipped]
    assert not missing, f"RPCs with no vector case and no reasoned skip: {missing}"
    assert not set(skipped) - set(rpcs), f"skips of RPCs the service lacks: {sorted(set(skipped) - set(rpcs))}"
    assert all(len(reason.split()) >= 4 for reason in skipped.values()), "every skip says why"


def test_each_case_is_tagged_with_the_rpcs_its_steps_make():
    names = [case["name"] for case in DOC["cases"]]
    assert len(names) == len(set(names)), "case names repeat"
    for case in DOC["cases"]:
        made = {CALL_RPCS[step["call"]] for step in case["steps"]}
        assert set(case["rpcs"]) == made, f"{case['name']}: tagged {sorted(case['rpcs'])}, makes {sorted(made)}"
        assert len(case.get("expect", [])) == len(case["steps"]), f"{case['name']}: no expectation (`make vectors`)"


def test_the_fixtures_model_is_the_recorded_one(tiny_llama_dir):
    assert weights_digest(tiny_llama_dir) == DOC["model"]["weights_digest"], \
        "tiny_llama_dir's weights changed (transformers' initialization?): every expectation is stale"


def test_the_recorded_greedy_ids_are_the_oracles(hf_tiny_llama):
    """The recording is the Python client's; its greedy ids are also transformers' own
    model's on the same weights (an oracle that shares no code with the server)."""
    case = next(c for c in DOC["cases"] if c["name"] == "greedy_decode")
    recorded = case["expect"][0]["ids"] + case["expect"][1]["ids"]
    ids = list(case["steps"][0]["tokens"])
    for _ in recorded:
        ids.append(int(oracle_rows(hf_tiny_llama, ids)[-1].argmax()))
    assert ids[len(case["steps"][0]["tokens"]):] == recorded


# -- the clients -----------------------------------------------------------------------------
def compare(client: str, stdout: str) -> None:
    """Each case's result line from ``client`` against ``expect``; one assertion naming
    every differing case and step."""
    got = {}
    for line in stdout.splitlines():
        result = json.loads(line)
        got[result["case"]] = digested(result["steps"])
    wrong = []
    for case in DOC["cases"]:
        name = case["name"]
        if name not in got:
            wrong.append(f"{client}: case {name}: no result")
            continue
        for i, (want, have) in enumerate(zip(case["expect"], got[name])):
            if want != have:
                wrong.append(f"{client}: case {name} step {i} ({case['steps'][i]['call']}): "
                             f"expected {json.dumps(want)}, got {json.dumps(have)}")
        if len(got[name]) != len(case["expect"]):
            wrong.append(f"{client}: case {name}: {len(got[name])} step results for {len(case['expect'])} steps")
    assert not wrong, "\n".join(wrong)


def run_runner(client: str, cmd: list[str], target: str, cwd: Path = ROOT) -> None:
    done = subprocess.run([*cmd, "--addr", target, "--cases", str(CASES_FILE)], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{client} runner failed:\n{done.stderr[-4000:]}"
    compare(client, done.stdout)
    with ExecutorClient(target, timeout=30) as c:  # every case released what it made
        assert c.status().active_sequences == 0, f"{client} left sequences on the server"


def test_python(server):
    run_runner("python", [sys.executable, "-m", "tests.vectors.runner"], server.target)


def test_node(server):
    node_dir = node_packages()
    run_runner("node", ["node", "vectors.js"], server.target, cwd=node_dir)


def test_rust(server, rust_bin):  # noqa: F811
    run_runner("rust", [str(rust_bin / "ferrum-rust-vectors")], server.target)


def test_cpp(server, cpp_bin):  # noqa: F811
    run_runner("cpp", [str(cpp_bin / "ferrum-cpp-vectors")], server.target)


def test_a_changed_expectation_fails_naming_the_client_and_case():
    """The comparison can fail: one recorded id off by one is reported by client and case."""
    case = next(c for c in DOC["cases"] if c["name"] == "greedy_decode")
    lines = [json.dumps({"case": c["name"], "steps": c["expect"]}) for c in DOC["cases"]]
    compare("recorded", "\n".join(lines))  # the expectations compare equal to themselves
    wrong = dict(case["expect"][1], ids=[case["expect"][1]["ids"][0] + 1, *case["expect"][1]["ids"][1:]])
    lines[DOC["cases"].index(case)] = json.dumps({"case": "greedy_decode", "steps": [case["expect"][0], wrong,
                                                                                     case["expect"][2]]})
    with pytest.raises(AssertionError, match=r"somewhere: case greedy_decode step 1 \(decode\)"):
        compare("somewhere", "\n".join(lines))
