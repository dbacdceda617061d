"""What a failover costs: the time from SIGKILL of a sequence's replica to its next
token, against the length of the history the client replays on the survivor.
("Process gone" is when the killed server was reaped: Linux frees a process's
memory before it closes its sockets, so the connection reset, the client's first
sign, comes no sooner.)

Two ``ferrum-rpc serve`` processes; a replica-set client prefills an L-token
prompt (a fresh random one each run, so the survivor's prefix cache holds none of
it) and decodes a few tokens; then the owner is killed and one more Decode is
timed from the kill: the client sees UNAVAILABLE, marks the replica, places the
sequence on the survivor, prefills the whole history there and decodes.  The
killed replica is restarted on its port before the next run.  Beside it, the same
sequence's ordinary decode step and a plain prefill of the history on the
survivor, so the added latency splits into detection + replay prefill + the step.

Drain: the owner gets SIGTERM instead (it serves with --export-grace) and
the next Decode is timed from the signal, once with the replica set migrating the
sequence (the owner pushes its KV to the survivor: nothing recomputed) and once
replaying it (``ReplicaPolicy(migrate=False)``), with the bytes the push moved.
Histories run to 4,096 tokens by default in the drain modes (SmolLM2-135M's
8,192 positions and each server's 16,384-token pool hold them); the table gives
the bytes moved per token and, where both drain modes ran, what migration adds
as a fraction of what replay adds (the target: at most 0.1 at 1,024 tokens).

    python -m bench.failover [--history 16 128 512 1024] [--runs 3] [--model DIR] [--dtype float32]
                             [--modes kill drain-migrate drain-replay]
"""

from __future__ import annotations

import argparse
import logging
import random
import re
import signal
import statistics
import time

from bench.common import bench_server, log, write_results
from ferrum_rpc.client import ExecutorClient, LogitsPolicy, connect
from ferrum_rpc.client.replicas import ReplicaPolicy
from ferrum_rpc.harness import ServerProcess

GREEDY = LogitsPolicy.argmax()
WARM_STEPS = 4


PUSHED = re.compile(r"pushed \w+ \((\d+) tokens, (\d+) bytes\)")
MODES = ("kill", "drain-migrate", "drain-replay")
KILL_HISTORY = [16, 128, 512, 1024]
DRAIN_HISTORY = [16, 128, 512, 1024, 2048, 4096]
TARGET_HISTORY, TARGET_RATIO = 1024, 0.1  # issue 23: migration adds at most a tenth of what replay adds


def one_run(ex: ExecutorClient, servers: dict[str, ServerProcess], history: int, seed: int, vocab: int,
            mode: str = "kill") -> dict:
    """Prefill + a few decodes, kill (or drain) the owner, time the next decode; plus references."""
    rng = random.Random(seed)
    prompt = [rng.randrange(10, vocab) for _ in range(history - WARM_STEPS)]
    out = ex.prefill(prompt, logits=GREEDY)
    handle, token = out.kv_cache, out.logits.argmax()[0]
    steps = []
    for _ in range(WARM_STEPS):
        t0 = time.perf_counter()
        step = ex.decode(token, handle, logits=GREEDY)
        steps.append(time.perf_counter() - t0)
        handle, token = step.kv_cache, step.logits.argmax()[0]
    owner = servers[ex.replica_of(handle)]
    survivor = next(s for s in servers.values() if s is not owner)
    t0 = time.perf_counter()
    if mode == "kill":
        owner.kill()
        reaped = time.perf_counter() - t0  # the kernel closes its sockets after freeing its memory
    else:
        owner.proc.send_signal(signal.SIGTERM)
        reaped = 0.0
    step = ex.decode(token, handle, logits=GREEDY)
    failover = time.perf_counter() - t0
    assert ex.replica_of(step.kv_cache) == survivor.target
    ex.release_cache(step.kv_cache)
    moved = 0
    if mode == "drain-migrate":
        owner.proc.wait(60)  # it exits once the sequence has left
        pushed = [PUSHED.search(line) for line in owner.lines]
        match = next((m for m in pushed if m), None)
        assert match is not None, "the drained owner pushed nothing: the sequence was replayed"
        moved = int(match.group(2))
    # The replay on its own: a plain prefill of a history as long (another random one).
    with ExecutorClient(survivor.target, timeout=600) as one:
        other = [rng.randrange(10, vocab) for _ in range(history)]
        t0 = time.perf_counter()
        replay = one.prefill(other, logits=GREEDY)
        prefill = time.perf_counter() - t0
        one.release_cache(replay.kv_cache)
    owner.restart(300)  # back on its port for the next run
    return {"mode": mode, "history": history, "seed": seed, "failover_s": failover, "reaped_s": reaped,
            "decode_s": statistics.median(steps), "prefill_s": prefill, "bytes_moved": moved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history", type=int, nargs="+", default=None,
                        help=f"history lengths (default: {KILL_HISTORY} for kill only, else {DRAIN_HISTORY})")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--modes", nargs="+", default=["kill"], choices=MODES)
    args = parser.parse_args()
    if args.history is None:
        args.history = KILL_HISTORY if args.modes == ["kill"] else DRAIN_HISTORY
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ferrum_rpc.client.replicas").setLevel(logging.ERROR)  # one failover per run, by design
    if args.model is None:
        from ferrum_rpc.server.prepare import prepare_default_model

        args.model = str(prepare_default_model())
    # --no-warmup: the crossover measurement is no part of this run (the first decode warms up)
    servers = [bench_server(args.model, args.dtype, 16384, "--export-grace", "60", "--no-warmup") for _ in range(2)]
    records = []
    name = "failover" if args.modes == ["kill"] else "failover_migration"
    try:
        for s in servers:
            s.wait_serving(300)
        by_target = {s.target: s for s in servers}
        for mode in args.modes:
            # long histories on a busy 2-core host: a 4,096-token prefill may take a minute or more
            policy = ReplicaPolicy(down_cooldown_s=0.5, failover_timeout_s=600, migrate=mode != "drain-replay")
            with connect(list(by_target), timeout=600, replica_policy=policy) as ex:
                vocab = ex.info().vocab_size
                ex.decode(0, ex.prefill([1, 2, 3], logits=GREEDY).kv_cache, logits=GREEDY)  # connect, warm
                for history in args.history:
                    for run in range(args.runs):
                        record = one_run(ex, by_target, history, seed=1000 * history + run, vocab=vocab, mode=mode)
                        records.append(record)
                        write_results(name, records)  # what ran so far survives a later failure
                        log.info("%s, history %d run %d: signal -> next token %.1f ms (process gone after "
                                 "%.1f ms; step %.1f ms, prefill %.1f ms; %d bytes moved)", mode, history, run + 1,
                                 1e3 * record["failover_s"], 1e3 * record["reaped_s"], 1e3 * record["decode_s"],
                                 1e3 * record["prefill_s"], record["bytes_moved"])
    finally:
        for s in servers:
            s.close()
    print_table(records)


def added_ms(records: list[dict], mode: str, history: int) -> float | None:
    """Median over the runs of signal -> next token less the ordinary step, ms (None: not run)."""
    rows = [r for r in records if r.get("mode", "kill") == mode and r["history"] == history]
    if not rows:
        return None
    return 1e3 * (statistics.median(r["failover_s"] for r in rows) - statistics.median(r["decode_s"] for r in rows))


def print_table(records: list[dict]) -> None:
    for mode in dict.fromkeys(r.get("mode", "kill") for r in records):
        print(f"\n{mode}:")
        print_mode([r for r in records if r.get("mode", "kill") == mode])
    histories = sorted({r["history"] for r in records if r.get("mode") == "drain-migrate"})
    if not histories:
        return
    print("\n| history tokens | bytes moved per token | migration added ms | replay added ms | migration / replay |"
          "\n| --- | --- | --- | --- | --- |")
    for history in histories:
        moved = statistics.median(r["bytes_moved"] for r in records
                                  if r.get("mode") == "drain-migrate" and r["history"] == history)
        migrate, replay = added_ms(records, "drain-migrate", history), added_ms(records, "drain-replay", history)
        ratio = f"{migrate / replay:.3f}" if replay else "-"
        print(f"| {history} | {moved / history:.0f} | {migrate:.1f} | "
              f"{'-' if replay is None else f'{replay:.1f}'} | {ratio} |")
    migrate = added_ms(records, "drain-migrate", TARGET_HISTORY)
    replay = added_ms(records, "drain-replay", TARGET_HISTORY)
    if migrate is not None and replay:
        ratio = migrate / replay
        print(f"\ntarget at {TARGET_HISTORY} tokens: migration adds {ratio:.3f} of what replay adds "
              f"(at most {TARGET_RATIO}): {'met' if ratio <= TARGET_RATIO else 'NOT met'}")


def print_mode(records: list[dict]) -> None:
    print("\n| history tokens | decode step ms | prefill of the history ms | signal -> process gone ms "
          "| signal -> next token ms | added ms | added per 1k tokens of history ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    points = []
    for history in sorted({r["history"] for r in records}):
        rows = [r for r in records if r["history"] == history]  # medians over the runs
        med = {k: 1e3 * statistics.median(r[k] for r in rows)
               for k in ("decode_s", "prefill_s", "reaped_s", "failover_s")}
        added = med["failover_s"] - med["decode_s"]
        print(f"| {history} | {med['decode_s']:.1f} | {med['prefill_s']:.1f} | {med['reaped_s']:.1f} "
              f"| {med['failover_s']:.1f} "
              f"| {added:.1f} | {1e3 * added / history:.1f} |")
        points.append((history, added))
    if len(points) >= 2:  # added = fixed + per_token * history, least squares over the medians
        n = len(points)
        mx, my = sum(h for h, _ in points) / n, sum(a for _, a in points) / n
        slope = sum((h - mx) * (a - my) for h, a in points) / sum((h - mx) ** 2 for h, _ in points)
        print(f"\nfit: added ms = {my - slope * mx:.1f} + {slope:.3f} x history tokens "
              f"({1e3 * slope:.0f} us per token of history replayed)")


if __name__ == "__main__":
    main()
