"""The decode attention kernel alone (cuda_kernels.decode_attention) over a grid of launches: cache
slices, positions per loop step (BLOCK_L) and warps, at batch 1 and 8, on a model's attention
shape, timed as CUDA graph replays of one launch per layer, each on its own cache (no L2 hits),
as decode runs them. Checks each launch against the PyTorch path first.

    python benchmarks/attention.py [--model llama-2-7b] [--batch-sizes 1,8] [--positions 108,200]
        [--splits 1,2,4] [--block-l 16,32,64] [--warps 4,8] [--json PATH]
"""
import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import cuda_kernels  # noqa: E402
from bench import PRESETS  # noqa: E402
from gemv import time_calls  # noqa: E402  (benchmarks/gemv.py)
from test_kernels import reference_attention  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-2-7b", choices=sorted(PRESETS))
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--positions", default="108,200")
    p.add_argument("--length", type=int, default=208, help="cache length (bench.py: prompt + new tokens)")
    p.add_argument("--splits", default="1,2,4", help="cache slices to try")
    p.add_argument("--block-l", default="16,32,64", help="positions per loop step to try")
    p.add_argument("--warps", default="4,8", help="warps to try")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    args = PRESETS[a.model]
    H, Hkv, D, layers, L = args.n_heads, args.n_kv_heads, args.head_dim, args.n_layers, a.length
    dev = torch.device("cuda")
    records = []
    for B in map(int, a.batch_sizes.split(",")):
        torch.manual_seed(0)
        caches = [(torch.randn(B, Hkv, L, D, device=dev).bfloat16(), torch.randn(B, Hkv, L, D, device=dev).bfloat16())
                  for _ in range(layers)]
        cos, sin = torch.randn(L, D, device=dev).bfloat16(), torch.randn(L, D, device=dev).bfloat16()
        qkv = torch.randn(B, 1, (H + 2 * Hkv) * D, device=dev).bfloat16()
        counts = torch.zeros(B * Hkv, dtype=torch.int32, device=dev)
        for p_ in map(int, a.positions.split(",")):
            pos = torch.tensor([p_], device=dev)
            ref = reference_attention(qkv, pos, cos[p_:p_ + 1], sin[p_:p_ + 1], caches[0][0].clone(),
                                      caches[0][1].clone(), H, Hkv).float()
            ints = lambda v: tuple(map(int, v.split(",")))  # noqa: E731
            default = (cuda_kernels.attention_splits(B, Hkv, L), None, None)
            grid = [default] + [c for c in itertools.product(ints(a.splits), ints(a.block_l), ints(a.warps))
                                if c != default]
            for splits, block_l, warps in grid:
                cuda_kernels.ATTENTION_BLOCK_L, cuda_kernels.ATTENTION_WARPS = block_l, warps
                y = cuda_kernels.decode_attention(qkv, pos, cos, sin, *caches[0], counts, H, Hkv, splits)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                calls = [lambda c=c: cuda_kernels.decode_attention(qkv, pos, cos, sin, *c, counts, H, Hkv, splits)
                         for c in caches]
                t = time_calls(calls)  # per launch
                kv = 2 * B * Hkv * p_ * D * 2
                rec = dict(model=a.model, batch=B, pos=p_, splits=splits, block_l=block_l, warps=warps,
                           us=t * 1e6, kv_gb_s=kv / t / 1e9, err=err, pdl=cuda_kernels.pdl(qkv))
                records.append(rec)
                print(f"B={B} pos={p_:4d} splits={splits} block_l={block_l or 'rule'} warps={warps or 'rule'}: "
                      f"{t * 1e6:6.2f} us  ({rec['kv_gb_s']:5.0f} GB/s of KV)  err {err:.1e}"
                      + ("  (default)" if (splits, block_l, warps) == default else ""), flush=True)
                if a.json:
                    a.json.write_text(json.dumps(records, indent=1) + "\n")
    cuda_kernels.ATTENTION_BLOCK_L, cuda_kernels.ATTENTION_WARPS = None, None


if __name__ == "__main__":
    main()
