"""The shared test vectors (tests/vectors/cases.json) in every client: the Python, Node.js,
Rust and C++ runners each run every case against one real server hosting tiny_llama_dir,
and each client's results must equal the recorded ``expect`` (token ids, handle lengths,
error codes and reasons), naming the client and the case where they do not.  FULL
float32 logits are compared by digest with the Python client's on the same server in
the same run: their last bits follow the CPU's kernels (AVX2, AVX-512), so a digest
recorded on one machine is no expectation on another.

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
    "speculative": "SpeculativeDecode", "export": "ExportSequence", "import": "ImportSequence",
    "ticket": "CreateImportTicket", "push": "PushSequence",
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


def test_the_speculative_round_keeps_greedys_drafts_up_to_the_wrong_one():
    """The recorded round kept exactly the drafts equal to greedy's continuation (the
    greedy case's ids, checked against the oracle above) before the first that is not,
    and its next token and the decode after it are greedy's next two."""
    greedy = next(c for c in DOC["cases"] if c["name"] == "greedy_decode")
    case = next(c for c in DOC["cases"] if c["name"] == "speculative_partly_accepted")
    assert case["steps"][0]["tokens"] == greedy["steps"][0]["tokens"]
    continuation = greedy["expect"][1]["ids"]  # what follows the prefill's token
    draft = case["steps"][1]["draft"]
    wrong = next(i for i, (d, g) in enumerate(zip(draft, continuation)) if d != g)
    assert 0 < wrong < len(draft) - 1, "the draft is wrong in the middle"
    round_, after = case["expect"][1], case["expect"][2]
    assert round_["accepted"] == draft[:wrong]
    assert [round_["next"], *after["ids"]] == continuation[wrong:wrong + 2]
    assert round_["ids"] == [round_["next"]] and round_["length"] == len(case["steps"][0]["tokens"]) + 1 + wrong


# -- the clients -----------------------------------------------------------------------------
def _results(stdout: str) -> dict:
    return {(r := json.loads(line))["case"]: digested(r["steps"]) for line in stdout.splitlines()}


def _digests(value) -> list:
    """Every logits digest in ``value``, in order."""
    if isinstance(value, dict):
        return [value["blake2b128"]] if "blake2b128" in value else [d for v in value.values() for d in _digests(v)]
    if isinstance(value, list):
        return [d for v in value for d in _digests(v)]
    return []


def _blind(value):
    """``value`` with its logits digests left out (compared on their own, see the docstring)."""
    if isinstance(value, dict):
        return {k: "<digest>" if k == "blake2b128" else _blind(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_blind(v) for v in value]
    return value


def compare(client: str, stdout: str, reference: dict | None = None) -> None:
    """Each case's result line from ``client`` against ``expect``, its logits digests
    against ``reference`` (the Python client's results on the same server; None: the
    recorded ones); one assertion naming every differing case and step."""
    got = _results(stdout)
    wrong = []
    for case in DOC["cases"]:
        name = case["name"]
        if name not in got:
            wrong.append(f"{client}: case {name}: no result")
            continue
        digests = case["expect"] if reference is None else reference.get(name, [])
        for i, (want, have) in enumerate(zip(case["expect"], got[name])):
            if _blind(want) != _blind(have) or _digests(have) != _digests(digests[i] if i < len(digests) else None):
                wrong.append(f"{client}: case {name} step {i} ({case['steps'][i]['call']}): "
                             f"expected {json.dumps(want)}, got {json.dumps(have)}")
        if len(got[name]) != len(case["expect"]):
            wrong.append(f"{client}: case {name}: {len(got[name])} step results for {len(case['expect'])} steps")
    assert not wrong, "\n".join(wrong)


def _run(client: str, cmd: list[str], target: str, cwd: Path = ROOT) -> str:
    done = subprocess.run([*cmd, "--addr", target, "--cases", str(CASES_FILE)], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{client} runner failed:\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def reference(server) -> dict:
    """The Python client's results on this server: the logits digests every client must give."""
    return _results(_run("python", PYTHON_RUNNER, server.target))


PYTHON_RUNNER = [sys.executable, "-m", "tests.vectors.runner"]


def run_runner(client: str, cmd: list[str], target: str, reference: dict, cwd: Path = ROOT) -> None:
    compare(client, _run(client, cmd, target, cwd), reference)
    with ExecutorClient(target, timeout=30) as c:  # every case released what it made
        assert c.status().active_sequences == 0, f"{client} left sequences on the server"


def test_python(server, reference):
    run_runner("python", PYTHON_RUNNER, server.target, reference)


def test_node(server, reference):
    node_dir = node_packages()
    run_runner("node", ["node", "vectors.js"], server.target, reference, cwd=node_dir)


def test_rust(server, rust_bin, reference):  # noqa: F811
    run_runner("rust", [str(rust_bin / "ferrum-rust-vectors")], server.target, reference)


def test_cpp(server, cpp_bin, reference):  # noqa: F811
    run_runner("cpp", [str(cpp_bin / "ferrum-cpp-vectors")], server.target, reference)


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


def test_a_logits_digest_other_than_the_references_fails():
    """Logits are compared with the live reference's digests: one differing digest is reported."""
    case = next(c for c in DOC["cases"] if _digests(c["expect"]))
    lines = "\n".join(json.dumps({"case": c["name"], "steps": c["expect"]}) for c in DOC["cases"])
    reference = {c["name"]: c["expect"] for c in DOC["cases"]}
    compare("recorded", lines, reference)
    reference[case["name"]] = json.loads(json.dumps(case["expect"]).replace(_digests(case["expect"])[0], "0" * 32))
    with pytest.raises(AssertionError, match=f"somewhere: case {case['name']} step"):
        compare("somewhere", lines, reference)
