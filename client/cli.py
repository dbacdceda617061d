"""``ferrum-rpc generate``: the caller side of the CLI.  It never imports server
code (a client-only install has no torch); the tokenizer needs the ``text`` extra."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger("ferrum_rpc.cli")
DEFAULT_TARGET = "127.0.0.1:50051"


def targets_of(args: argparse.Namespace) -> str | list[str]:
    """``--target`` as the client takes it: one address, or the list of replicas."""
    targets = args.target or [DEFAULT_TARGET]
    return targets[0] if len(targets) == 1 else targets


def cmd_generate(args: argparse.Namespace) -> int:
    from . import connect
    from .generate import encode_prompt, generate_ids, load_tokenizer, stream_text
    from .sampling import SamplingParams
    from ferrum_rpc.paths import default_model_dir

    for module in ("tokenizers", "jinja2"):  # the text extra's, named before any call
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"No module named '{module}'", name=module)
    params = SamplingParams(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    tls = None
    if args.tls_ca or args.tls_cert or args.tls_server_name:
        from . import ClientTls

        tls = ClientTls(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, server_name=args.tls_server_name)
    token = os.environ.get("FERRUM_RPC_TOKEN") or None
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
    with connect(targets_of(args), model=args.model, timeout=args.timeout, tls=tls, token=token) as client:
        # the server first: a refused or unreachable one is reported before the
        # tokenizer's seconds of loading
        info = client.info()
        tokenizer = load_tokenizer(args.tokenizer or default_model_dir())
        prompt_ids = encode_prompt(tokenizer, args.prompt, chat=not args.raw)
        stop = set(info.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        if args.speculative:
            return _speculative(args, client, tokenizer, prompt_ids, stop)
        start = time.perf_counter()
        count = 0

        def counted():
            nonlocal count
            server_side = False if getattr(args, "caller_side", False) else None
            for token in generate_ids(client, prompt_ids, args.max_tokens, params, stop, server_side):
                count += 1
                yield token

        for delta in stream_text(tokenizer, counted(), stop):
            sys.stdout.write(delta)
            sys.stdout.flush()
        elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    sys.stdout.flush()
    log.info("%d prompt tokens, %d generated in %.2fs (%.1f tokens/s)", len(prompt_ids), count,
             elapsed, count / elapsed if elapsed else 0.0)
    return 0


def _speculative(args, client, tokenizer, prompt_ids: list[int], stop: set[int]) -> int:
    """Greedy speculative generation, then plain greedy for comparison: same tokens, fewer forwards."""
    from . import connect
    from .generate import generate_ids
    from .sampling import SamplingParams
    from .speculative import ModelDrafter, NgramDrafter, speculative_generate

    draft_client = connect(targets_of(args), model=args.draft_model, timeout=args.timeout) if args.draft_model else None
    drafter = ModelDrafter(draft_client) if draft_client else NgramDrafter()
    result = speculative_generate(client, prompt_ids, args.max_tokens, k=args.speculative,
                                  drafter=drafter, stop_ids=frozenset(stop),
                                  token_choice=False if getattr(args, "caller_side", False) else None)
    if draft_client:
        draft_client.close()
    text = tokenizer.decode([t for t in result.tokens if t not in stop], skip_special_tokens=True)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    start = time.perf_counter()
    plain = list(generate_ids(client, prompt_ids, args.max_tokens, SamplingParams(greedy=True), stop,
                              False if getattr(args, "caller_side", False) else None))
    plain_s = time.perf_counter() - start
    log.info("speculative (k=%d, %s drafts): %d tokens in %.2fs, %d target forwards, acceptance %.0f%% "
             "(%d/%d); plain greedy %.2fs: speed-up %.2fx; outputs %s",
             args.speculative, args.draft_model or "n-gram", len(result.tokens), result.seconds,
             result.target_forwards, 100 * result.acceptance_rate, result.accepted, result.drafted,
             plain_s, plain_s / result.seconds, "identical" if plain == result.tokens else "DIFFER")
    return 0 if plain == result.tokens else 1
