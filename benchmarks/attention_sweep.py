"""attention.py's launch rule (splits_for, BLOCK_L, WARPS) against a grid of slices and positions a loop step, on one GPU:
Llama-2-7B's heads (32 KV heads) and Llama-3.1-8B's (8 KV heads of 4 queries), batch 1 to 64, a 1,024-position cache,
each row at a random position in 16-1,000 (the serving engine's case). Times are of 20 launches replayed in a graph.

    python benchmarks/attention_sweep.py --json benchmarks/records/attention.json
"""
import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gdkernels import attention  # noqa: E402

D, L = 128, 1024


def seconds(B, H, Hkv, pos, splits, block_l=attention.BLOCK_L, warps=attention.WARPS):
    """Mean seconds of one decode_attention launch with `splits` slices, block_l positions a loop step."""
    torch.manual_seed(0)
    k_cache = torch.randn(B, Hkv, L, D, device="cuda").bfloat16()
    v_cache, qkv = torch.randn_like(k_cache), torch.randn(B, 1, (H + 2 * Hkv) * D, device="cuda").bfloat16()
    table, counts = torch.randn(L, D, device="cuda").bfloat16(), torch.zeros(B * Hkv, dtype=torch.int32, device="cuda")
    kept = attention.BLOCK_L, attention.WARPS
    attention.BLOCK_L, attention.WARPS = block_l, warps
    try:
        call = lambda: attention.decode_attention(qkv, pos, table, table, k_cache, v_cache, counts, H, Hkv, splits)  # noqa: E731
        call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                call()
    finally:
        attention.BLOCK_L, attention.WARPS = kept
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / 100


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-heads", default="32,8", help="32: Llama-2-7B's heads; 8: Llama-3.1-8B's")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    records = []
    for Hkv, B in itertools.product(map(int, args.kv_heads.split(",")), (1, 8, 16, 64)):
        H = 32
        pos = torch.randint(16, 1000, (B, 1), generator=torch.Generator().manual_seed(B)).cuda()
        kv_bytes = 2 * (pos + 1).sum().item() * Hkv * D * 2
        rule = attention.splits_for(B, Hkv, L)
        r = {"H": H, "Hkv": Hkv, "batch": B, "rule": [rule, attention.BLOCK_L, attention.WARPS],
             "rule_us": seconds(B, H, Hkv, pos, rule) * 1e6}
        grid = {}
        for splits, block_l, warps in itertools.product((1, 2, 4, 8, 16), (32, 64), (4, 8)):
            grid[f"{splits} slices, {block_l} positions, {warps} warps"] = seconds(B, H, Hkv, pos, splits, block_l, warps) * 1e6
        best = min(grid, key=grid.get)
        r.update(best=best, best_us=grid[best], rule_gb_s=kv_bytes / r["rule_us"] / 1e3, grid_us=grid,
                 gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=str(datetime.date.today()),
                 command="python " + " ".join(sys.argv))
        print(json.dumps(r), flush=True)
        records.append(r)
        if args.json:  # (as it goes)
            args.json.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
