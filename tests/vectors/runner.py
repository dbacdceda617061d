"""The Python client's runner of the shared test vectors (tests/vectors/cases.json).

    python -m tests.vectors.runner --addr 127.0.0.1:50051 [--cases tests/vectors/cases.json]

Runs every case's steps through ``ferrum_rpc.client.ExecutorClient`` and prints one JSON
line per case, ``{"case": NAME, "steps": [RESULT, ...]}``, in the format every client's
runner prints (tests/vectors/README.md). tests/contract/test_vectors.py compares the
lines with the cases' ``expect``; tests/vectors/record.py writes ``expect`` from them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import numpy as np

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.errors import ExecutorError, from_rpc_error
from ferrum_rpc.types import DecodeInput, TokenChoice
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc

CASES = Path(__file__).resolve().parent / "cases.json"
POLICIES = {
    "argmax": LogitsPolicy.argmax(), "argmax_all": LogitsPolicy.argmax(all_positions=True),
    "full": LogitsPolicy.full(), "full_all": LogitsPolicy.full(all_positions=True),
}


class Case:
    """One case's state: the client, and per handle name its handle and its next token
    (the argmax of the last row or the chosen token of the last call on it)."""

    def __init__(self, client: ExecutorClient, addr: str):
        self.client, self.addr = client, addr
        self.handles: dict[str, Any] = {}
        self.next: dict[str, int] = {}
        self.exports: dict[str, bytes] = {}  # an export's bytes by name, relayed to import untouched
        self.tickets: dict[str, str] = {}  # an import ticket's secret by name

    def token(self, name: str, token: int | str) -> int:
        return self.next[name] if token == "next" else int(token)

    def kept(self, name: str, out) -> dict:
        """Stores ``out``'s handle under ``name``; the result of an output-producing call."""
        self.handles[name] = out.kv_cache
        ids = output_ids(out)
        if ids:
            self.next[name] = ids[-1]
        result = {"length": out.kv_cache.sequence_length}
        if out.logits is not None and out.logits.token_ids is None:  # FULL float32 rows
            rows = np.ascontiguousarray(out.logits.values, dtype="<f4")
            result["logits"] = {"shape": list(rows.shape), "f32_hex": rows.tobytes().hex()}
        else:
            result["ids"] = ids
        return result

    def speculated(self, name: str, out) -> dict:
        """Stores a SpeculativeDecode round's handle under ``name`` with the round's
        ``next_token_id`` as its next token; the result: the handle's length, the drafts
        kept, the next token and the argmax of the logits row after the kept drafts."""
        self.handles[name], self.next[name] = out.kv_cache, out.next_token_id
        return {"length": out.kv_cache.sequence_length, "accepted": list(out.accepted_token_ids),
                "next": out.next_token_id, "ids": [int(row[0]) for row in np.asarray(out.logits.token_ids)]}


def output_ids(out) -> list[int]:
    """The ids a call's output names: one per ARGMAX row, or the chosen token."""
    if getattr(out, "chosen", None) is not None:
        return [out.chosen.token_id]
    if out.logits is not None and out.logits.token_ids is not None:
        return [int(row[0]) for row in np.asarray(out.logits.token_ids)]
    return []


def asked(step: dict) -> dict:
    """The step's logits policy or token choice, as the client's keyword arguments."""
    if "choice" in step:
        return {"token_choice": TokenChoice(**step["choice"])}
    return {"logits": POLICIES[step["logits"]]}


def repeated(step: dict, once: Callable[[], dict]) -> dict:
    """Runs ``once`` ``repeat`` times; ids (or each item's) concatenated, the last length."""
    results = [once() for _ in range(step.get("repeat", 1))]
    last = dict(results[-1])
    if "ids" in last:
        last["ids"] = [i for r in results for i in r["ids"]]
    if "items" in last:
        last["items"] = [{"ids": [i for r in results for i in r["items"][k]["ids"]], "length": item["length"]}
                         for k, item in enumerate(last["items"])]
    return last


def batch_items(case: Case, step: dict) -> list[DecodeInput]:
    return [DecodeInput(case.token(name, token), case.handles[name])
            for name, token in zip(step["handles"], step["tokens"])]


def kept_all(case: Case, names: list[str], outs) -> dict:
    return {"items": [case.kept(name, out) for name, out in zip(names, outs)]}


def ticket_result(ticket: str, model: str, ttl_s: float) -> dict:
    """What of an import ticket is the same on every run: the secret's length (it is
    random), the model and the seconds it stays valid rounded up (they run down)."""
    return {"ticket_chars": len(ticket), "model": model, "ttl_s": math.ceil(ttl_s)}


def run_step(case: Case, step: dict) -> dict:
    c, call = case.client, step["call"]
    if call == "info":
        info = c.info()
        return {"vocab_size": info.vocab_size, "num_layers": info.num_layers,
                "max_sequence_length": info.max_sequence_length}
    if call == "status":
        return {"active_sequences": c.status().active_sequences}
    if call == "prefill":
        on = ExecutorClient(case.addr, model=step["model"], timeout=30) if "model" in step else c
        try:
            return case.kept(step["as"], on.prefill(step["tokens"], **asked(step)))
        finally:
            if on is not c:
                on.close()
    if call == "batch_prefill":
        return kept_all(case, step["as"], c.batch_prefill(step["prompts"], **asked(step)))
    if call == "decode":
        name = step["handle"]

        def once() -> dict:
            out = c.decode(case.token(name, step["token"]), case.handles[name], **asked(step))
            return case.kept(step.get("as", name), out)
        return repeated(step, once)
    if call == "batch_decode":
        return repeated(step, lambda: kept_all(case, step["handles"], c.batch_decode(batch_items(case, step),
                                                                                      **asked(step))))
    if call == "session":
        with c.decode_session() as session:
            return repeated(step, lambda: kept_all(case, step["handles"], session.step(batch_items(case, step),
                                                                                        **asked(step))))
    if call == "verify":
        return case.kept(step["handle"], c.forward_verify(step["tokens"], case.handles[step["handle"]], **asked(step)))
    if call == "truncate":
        handle = c.truncate_kv(case.handles[step["handle"]], step["length"])
        case.handles[step["handle"]] = handle
        return {"length": handle.sequence_length}
    if call == "release":
        c.release_cache(case.handles[step["handle"]])
        return {}
    if call == "fork":
        parent = step["handle"]
        children = c.fork_cache(case.handles[parent], len(step["as"]))
        for name, handle in zip(step["as"], children):
            case.handles[name], case.next[name] = handle, case.next[parent]
        return {"lengths": [h.sequence_length for h in children]}
    if call == "speculative":
        name = step["handle"]
        out = c.speculative_decode(case.token(name, step["token"]), step["draft"], case.handles[name],
                                   logits=POLICIES[step["logits"]])
        return case.speculated(name, out)
    if call == "export":
        case.exports[step["as"]] = c.export_sequence(case.handles[step["handle"]])
        case.next[step["as"]] = case.next[step["handle"]]
        return {}
    if call == "import":
        name = step["as"]
        case.handles[name], case.next[name] = c.import_sequence(case.exports[step["from"]]), case.next[step["from"]]
        return {"length": case.handles[name].sequence_length}
    if call == "ticket":
        ticket = c.create_import_ticket(fingerprint=step.get("fingerprint", ""), ttl_s=step.get("ttl_s", 0.0))
        if "as" in step:
            case.tickets[step["as"]] = ticket.ticket
        return ticket_result(ticket.ticket, ticket.model, ticket.ttl_s)
    if call == "push":  # into the server the runner talks to, named by the runner's own address
        name = step["handle"]
        pushed = c.push_sequence(case.handles[name], case.addr, case.tickets[step["ticket"]], move=step["move"])
        case.handles[step["as"]], case.next[step["as"]] = pushed.kv_cache, case.next[name]
        return {"length": pushed.kv_cache.sequence_length, "released": pushed.released}
    if call == "forward":
        # The client has no forward() (UNIMPLEMENTED by contract): the generated stub's call.
        with grpc.insecure_channel(case.addr) as channel:
            try:
                executor_pb2_grpc.ModelExecutorStub(channel).Forward(pb.ForwardRequest(), timeout=30)
            except grpc.RpcError as exc:
                raise from_rpc_error(exc) from None
        return {}
    raise ValueError(f"unknown call {call!r}")


def run_case(client: ExecutorClient, addr: str, case: dict) -> dict:
    state, steps = Case(client, addr), []
    for step in case["steps"]:
        try:
            steps.append(run_step(state, step))
        except ExecutorError as e:
            steps.append({"error": {"code": e.code.name, "reason": e.reason.value if e.reason else None}})
    return {"case": case["name"], "steps": steps}


def run_all(addr: str, cases_file: Path = CASES) -> Iterator[dict]:
    """Each case's result, as it is run."""
    cases = json.loads(Path(cases_file).read_text())["cases"]
    with ExecutorClient(addr, timeout=30) as client:
        for case in cases:
            yield run_case(client, addr, case)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", required=True)
    parser.add_argument("--cases", default=str(CASES))
    args = parser.parse_args(argv)
    for result in run_all(args.addr, Path(args.cases)):
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
