"""ferrum-rpc from Python: tokenize, prefill, decode greedily, then let the server sample.

Run it with `make serve` running in another terminal:

    .venv/bin/python examples/quickstart.py

The README's first Python block is this file's body; tests/system/test_doc_snippets.py
runs both against a live server.
"""

import numpy as np
from tokenizers import Tokenizer

from ferrum_rpc.client import ExecutorClient, LogitsPolicy, TokenChoice
from ferrum_rpc.paths import default_model_dir

tokenizer = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))  # the model `make serve` prepared
token_ids = tokenizer.encode("The capital of France is").ids

with ExecutorClient("127.0.0.1:50051") as ex:
    ex.wait_ready(60)                               # until the model serves (see below)
    info = ex.info()                                # vocab_size, eos_token_ids, ...

    # Greedy: the caller chooses each next token from the logits the server returns.
    out = ex.prefill(token_ids)                     # PrefillOutput(logits, kv_cache, timing)
    next_id = int(np.argmax(out.logits))            # full float32 logits, shape (1, vocab_size)
    greedy, handle = [next_id], out.kv_cache
    for _ in range(7):
        step = ex.decode(greedy[-1], handle, logits=LogitsPolicy.argmax())  # only the top token on the wire
        greedy.append(step.logits.argmax()[0])
        handle = step.kv_cache
    ex.release_cache(handle)
    print("greedy: ", tokenizer.decode(greedy))

    # Sampled: the server chooses (seeded, so the same text every run); no logits on the wire.
    choice = TokenChoice(temperature=0.8, top_k=40, top_p=0.9, seed=7)
    out = ex.prefill(token_ids, token_choice=choice)
    sampled, handle = [out.chosen.token_id], out.kv_cache
    while len(sampled) < 8 and sampled[-1] not in info.eos_token_ids:
        step = ex.decode(sampled[-1], handle, token_choice=choice)
        sampled.append(step.chosen.token_id)
        handle = step.kv_cache
    ex.release_cache(handle)
    print("sampled:", tokenizer.decode(sampled))

    # Two sequences in one forward.
    a, b = ex.prefill(token_ids), ex.prefill(tokenizer.encode("Once upon a time").ids)
    outs = ex.batch_decode([(greedy[0], a.kv_cache), (int(np.argmax(b.logits)), b.kv_cache)],
                           logits=LogitsPolicy.topk(20))
    print("batch:  ", [tokenizer.decode([o.logits.argmax()[0]]) for o in outs])
    for o in outs:
        ex.release_cache(o.kv_cache)
