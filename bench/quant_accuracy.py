"""Greedy top-1 agreement of each ``--quantize`` mode with float32 on the real
default model: a fixed English text (tests/data/english.txt), teacher-forced,
the next-token argmax at every one of its first N positions (1,000 by
default), computed in process by the executor the server runs.  Optionally
llama.cpp's own agreement with our float32 on the same positions (its logits
for every position of the same token ids, from its cached environment).

    python -m bench.quant_accuracy [--modes int8 int4 w8a8 w4a8] [--positions 1000] [--llama-cpp]
    python -m bench.quant_accuracy --modes none+kv=bfloat16 w4a8+kv=bfloat16   # a bfloat16 KV pool
    python -m bench.quant_accuracy --grids

``--grids`` asks where the 8-bit activations' loss comes from and what would
remove it: the int8 weights (w8a8's, lossless against the GGUF) with the
activations rounded to other grids in torch (``F.linear`` over the
dequantized weights; the kernels give the same codes, their sums differ in
order only): int8 per block of 32, of 16 and of 8, the LM head on two digits,
w8a8's ``rotate16`` (the order-16 Hadamard whose rotated Q4_1 weights stay
8-bit codes, ``qact.RotatedQ8Linear``), int8 per block after a 32-point
Hadamard rotation of activations and weights (QuaRot-style, the weights then
either kept in float or requantized to int8 per block), bfloat16, float16,
and two int8 digits per block (the code and the code of its residual); each
with its mean KL divergence from float32, which, unlike the agreement, does
not jump with a few near ties.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench import llama_cpp
from bench.common import kv_variant, log
from ferrum_rpc.client.generate import load_tokenizer
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.kernels import qact
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.prepare import find_gguf, prepare_default_model
from ferrum_rpc.types import LogitsPolicy

ROOT = Path(__file__).resolve().parent.parent


def english_ids(model_dir: Path, positions: int) -> list[int]:
    ids = load_tokenizer(model_dir)((ROOT / "tests" / "data" / "english.txt").read_text())["input_ids"]
    if len(ids) < positions + 1:
        raise SystemExit(f"english.txt has {len(ids)} tokens, fewer than {positions + 1}")
    return ids[:positions + 1]


def argmaxes(model_dir: Path, mode: str, ids: list[int]) -> np.ndarray:
    """Next-token argmax at each of ``ids``' positions, one chunked prefill; ``mode``: a
    ``--quantize`` value, the KV pool's dtype after it where it names one (``common.kv_variant``)."""
    quantize, kv_dtype = kv_variant(mode)
    ex = TorchExecutor.from_path("acc", model_dir, ExecutorConfig(quantize=quantize, kv_dtype=kv_dtype,
                                                                 kv_tokens=4096))
    out = ex.prefill(ids, None, LogitsPolicy.argmax(all_positions=True))
    return np.asarray(out.logits.argmax())


def _blocks_q8(x: torch.Tensor, block: int) -> torch.Tensor:
    """x rounded to int8 codes per ``block`` along the last dimension (amax / 127), in float."""
    b = x.unflatten(-1, (-1, block))
    d = b.abs().amax(dim=-1, keepdim=True) / 127
    return ((b * torch.where(d > 0, 1 / d, 0.0)).round() * d).flatten(-2)


def _hadamard(n: int = 32) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def _prefill_logits(ex: TorchExecutor, ids: list[int], positions: int) -> torch.Tensor:
    got = ex.prefill(ids, None, LogitsPolicy.full(all_positions=True))
    ex.release_cache(got.kv_cache.cache_id)
    return torch.from_numpy(np.asarray(got.logits.values))[:positions].float()


def grid_agreements(model_dir: Path, ids: list[int], positions: int) -> dict[str, tuple[float, float]]:
    """(greedy agreement with float32, mean KL divergence from float32's next-token
    distribution) for each activation grid (see the module docstring).  The KL moves
    smoothly with the error where the agreement, set by a few near ties, jumps by
    half a point between grids of equal error."""
    base = dict(kv_tokens=4096, linear_kernel="aten", prefix_caching=False)
    reference = _prefill_logits(TorchExecutor.from_path("f32", model_dir, ExecutorConfig(**base)), ids, positions)
    ref_logp = reference.log_softmax(-1)
    ex = TorchExecutor.from_path("grids", model_dir, ExecutorConfig(quantize="w8a8", **base))
    h = _hadamard()

    def rotate(t: torch.Tensor, m: torch.Tensor = h) -> torch.Tensor:  # each block of 32 times H (orthonormal)
        return (t.unflatten(-1, (-1, 32)) @ m).flatten(-2)

    two = lambda x: qact.fake_quantize_blocks(x, 2)  # noqa: E731  (two int8 digits per block of 32)
    r16 = qact.rotate16
    weights: dict[int, torch.Tensor] = {}
    # name -> (the projections' activations and weights, the LM head's activations)
    grids = {
        "int8 / 32": (lambda x, w: (_blocks_q8(x, 32), w), lambda x: _blocks_q8(x, 32)),
        "int8 / 16 (w8a8 until rotate16)": (lambda x, w: (_blocks_q8(x, 16), w), lambda x: _blocks_q8(x, 16)),
        "int8 / 8": (lambda x, w: (_blocks_q8(x, 8), w), lambda x: _blocks_q8(x, 8)),
        "int8 / 16, head two digits": (lambda x, w: (_blocks_q8(x, 16), w), two),
        "rotate16 int8 / 16": (lambda x, w: (_blocks_q8(r16(x), 16), r16(w)), lambda x: _blocks_q8(x, 16)),
        "rotate16 int8 / 16, head two digits (w8a8)": (lambda x, w: (_blocks_q8(r16(x), 16), r16(w)), two),
        "rotate16 int8 / 8, head two digits": (lambda x, w: (_blocks_q8(r16(x), 8), r16(w)), two),
        "Hadamard-32 int8 / 32, float W": (lambda x, w: (_blocks_q8(rotate(x), 32), rotate(w)),
                                           lambda x: rotate(_blocks_q8(rotate(x), 32), h.T)),
        "Hadamard-32 int8 / 32, int8 W": (lambda x, w: (_blocks_q8(rotate(x), 32), _blocks_q8(rotate(w), 32)),
                                          lambda x: rotate(_blocks_q8(rotate(x), 32), h.T)),
        "bfloat16": (lambda x, w: (x.bfloat16().float(), w), lambda x: x.bfloat16().float()),
        "float16": (lambda x, w: (x.half().float(), w), lambda x: x.half().float()),
        "two int8 digits / 32": (lambda x, w: (two(x), w), two),
    }
    out, forward = {}, qact.BlockQ8Linear.forward
    try:
        for name, (grid, head) in grids.items():
            def linear(self, x, grid=grid, head=head):
                key = id(self)
                if key not in weights:
                    weights[key] = self.dequantized().float()
                if self.out_features == ex.model_config.vocab_size:  # the LM head
                    xq, w = head(x.float()), weights[key]
                else:
                    xq, w = grid(x.float(), weights[key])
                y = F.linear(xq, w).to(x.dtype)
                return y if self.bias is None else y + self.bias.to(y.dtype)
            qact.BlockQ8Linear.forward = linear
            got = _prefill_logits(ex, ids, positions)
            agree = float((got.argmax(-1) == reference.argmax(-1)).float().mean())
            kl = float((ref_logp.exp() * (ref_logp - got.log_softmax(-1))).sum(-1).mean())
            out[name] = (agree, kl)
            log.info("grid %s: %.2f%%, KL %.2e", name, 100 * agree, kl)
    finally:
        qact.BlockQ8Linear.forward = forward
    return out


def llama_cpp_argmaxes(ids: list[int]) -> np.ndarray:
    """llama.cpp's argmax at every position (exits with one line when its anchor is
    missing or its run fails: ``--llama-cpp`` asked for that row)."""
    cmd = [str(llama_cpp.require()), "-m", "bench.llama_cpp", "--argmax", "--gguf", str(find_gguf()),
           "--ids", json.dumps(ids)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return np.asarray(json.loads(llama_cpp.anchor_output(done, "--argmax").strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["int8", "int4", "w8a8", "w4a8"])
    parser.add_argument("--positions", type=int, default=1000)
    parser.add_argument("--llama-cpp", action="store_true")
    parser.add_argument("--grids", action="store_true", help="the activation-grid study instead of --modes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.llama_cpp:
        llama_cpp.require()  # before the long part: a missing anchor stops the run at once
    model_dir = prepare_default_model()
    ids = english_ids(model_dir, args.positions)
    if args.grids:
        print(f"activation grids, {args.positions} positions of tests/data/english.txt: greedy top-1 agreement "
              f"with float32, mean KL divergence from float32")
        for name, (agree, kl) in grid_agreements(model_dir, ids, args.positions).items():
            print(f"  {name:44} {agree:.2%}  {kl:.2e}")
        return
    reference = argmaxes(model_dir, "none", ids)[:args.positions]
    results = {}
    for mode in args.modes:
        results[mode] = float((argmaxes(model_dir, mode, ids)[:args.positions] == reference).mean())
    if args.llama_cpp:
        results["llama.cpp Q4_1"] = float((llama_cpp_argmaxes(ids)[:args.positions] == reference).mean())
    print(f"greedy top-1 agreement with float32 over {args.positions} positions of tests/data/english.txt:")
    for mode, agreement in results.items():
        print(f"  {mode:28} {agreement:.2%}")


if __name__ == "__main__":
    main()
