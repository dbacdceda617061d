"""UpdateWeights on a tensor-parallel server: ``serve --tensor-parallel 2``, whose ranks
are real processes joined by torch.distributed (gloo), driven through real gRPC.  Each
rank builds its shard from its slices of the new tensors; afterwards the logits equal
those of a fresh degree-2 server started on the new weights, bit for bit, and a bad
update changes nothing on any rank (the logits depend on every rank's shard)."""

from __future__ import annotations

import grpc
import numpy as np
from safetensors.numpy import save

from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.harness import ServerProcess, all_serving
from ferrum_rpc.hashing import stream_hasher
from ferrum_rpc.v1 import executor_pb2 as pb
from tests.system.test_update_weights import FULL, PROMPT, logits, perturbed, raw_update  # noqa: F401 (a fixture)

FLAGS = ("--tensor-parallel", "2", "--kv-tokens", "1024", "--block-size", "4", "--no-warmup", "--metrics-port", "0",
         "--no-prefix-cache")  # the same prompt computes the same bits each time it runs
PROMPTS = [PROMPT, [9, 300, 11, 64, 2, 77, 5, 17, 101]]


def bad_update(target: str, tensors: dict) -> grpc.RpcError:
    """A well-formed stream whose last tensor holds a NaN."""
    name = "model.layers.1.self_attn.o_proj.weight"
    body = {**tensors, name: tensors[name].copy()}
    body[name][0, -1] = np.nan
    data = save(body)
    checksum = stream_hasher()
    checksum.update(data)
    return raw_update(target, [pb.WeightsChunk(header=pb.WeightsHeader(total_bytes=len(data))),
                               pb.WeightsChunk(data=data),
                               pb.WeightsChunk(trailer=pb.WeightsTrailer(checksum=checksum.digest()))])


def test_an_update_reaches_every_rank_and_equals_a_fresh_split_server(tiny_llama_dir, perturbed):  # noqa: F811
    tensors, folder = perturbed
    with all_serving(ServerProcess(f"tiny={folder}", *FLAGS), ServerProcess(f"tiny={tiny_llama_dir}", *FLAGS),
                     timeout=180) as (fresh, srv):
        with ExecutorClient(fresh.target, timeout=60) as f:
            want = [logits(f, p) for p in PROMPTS]
            fresh_step = f.decode(3, f.prefill(PROMPT, logits=FULL).kv_cache, FULL)
        with ExecutorClient(srv.target, timeout=60) as c:
            before = [logits(c, p) for p in PROMPTS]
            error = bad_update(srv.target, tensors)
            assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "NaN" in error.details()
            assert all(np.array_equal(logits(c, p), b) for p, b in zip(PROMPTS, before))
            assert c.status().weights_version == 0

            reply = c.update_weights(tensors)
            assert (reply.weights_version, reply.tensors) == (1, len(tensors)) and reply.paused_s >= reply.rebuild_s > 0
            after = [logits(c, p) for p in PROMPTS]
            assert all(np.array_equal(a, w) for a, w in zip(after, want))
            assert not np.array_equal(after[0], before[0])
            step = c.decode(3, c.prefill(PROMPT, logits=FULL).kv_cache, FULL)  # a decode runs on every rank too
            assert np.array_equal(np.asarray(step.logits.values), np.asarray(fresh_step.logits.values))
            assert c.capabilities().weights_version == 1 and step.kv_cache.weights_version == 1
