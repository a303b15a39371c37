"""The decode matmuls alone: cuda_kernels.py's GEMVs against PyTorch's (cuBLAS bf16, Inductor-fused
int8 dequantize + matmul), on the weight shapes of a preset, timed as CUDA graph
replays over enough weight copies that nothing is served from L2. Checks each result against a
float32 reference first. With --tune, tries a grid of launch configurations and prints the best.

    python benchmarks/gemv.py --model llama-2-7b [--rows 1,8] [--tune] [--json PATH]
"""
import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cuda_kernels  # noqa: E402
from bench import PRESETS, copy_bandwidth  # noqa: E402

L2_MULTIPLE_BYTES = 1 << 30  # each timed graph reads at least this much weight


def shapes(args):
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return {"wqkv": (q + 2 * kv, args.dim), "wo": (args.dim, q), "w13": (2 * args.intermediate_size, args.dim),
            "w2": (args.dim, args.intermediate_size), "output": (args.vocab_size, args.dim)}


def time_calls(calls, reps=10) -> float:
    """Seconds per call: all `calls` captured into one graph, replayed `reps` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps / len(calls)


def fastest(time_launch, grid, best, error=None, limit=float("inf")):
    """(seconds, launch) of the fastest launch in `grid` by time_launch(launch, reps) at 3 replays,
    or `best` (seconds, launch) if none beats it; the winner re-timed at 10. A launch that fails
    (e.g. out of shared memory or registers) is skipped with a note, and so, untimed, is one whose
    error(launch) against the reference is above `limit` (a launch that computes something else)."""
    for launch in dict.fromkeys(grid):
        try:
            if error is not None and (e := error(launch)) > limit:
                print(f"    {launch}: error {e:.1e} above {limit:.1e}", flush=True)
                continue
            t = time_launch(launch, 3)
        except Exception as e:
            print(f"    {launch}: {type(e).__name__}", flush=True)
            continue
        print(f"    {launch}: {t * 1e6:.1f} us", flush=True)
        if t < best[0]:
            best = (t, launch)
    return time_launch(best[1], 10), best[1]


def make_weights(kind, N, K, device):
    """(weight tensors for cuda_kernels.gemv, for the PyTorch baseline, float reference, bytes read)."""
    w = torch.randn(N, K, device=device, dtype=torch.bfloat16) / math.sqrt(K)
    if kind == "bf16":
        return (w, None), ("cublas", w), w.float(), N * K * 2
    scales = w.abs().amax(1).float() / 127
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    scales = scales.to(torch.bfloat16)
    return (q, scales), ("inductor", q, scales), q.float() * scales.float()[:, None], N * K + N * 2


_inductor_int8 = torch.compile(lambda x, q, s: F.linear(x, q.to(x.dtype)) * s)


def baseline(x, spec):
    if spec[0] == "cublas":
        return F.linear(x, spec[1])
    return _inductor_int8(x, spec[1], spec[2])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-2-7b")
    p.add_argument("--kinds", default="bf16,int8")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--fused", action="store_true",
                   help="one row with what decode fuses into each GEMV: RMSNorm before wqkv, w13 and the head, "
                        "SwiGLU in w13, the residual add after wo and w2 (no split of K then)")
    p.add_argument("--layers", help="comma-separated subset of wqkv,wo,w13,w2,output (default: all)")
    p.add_argument("--int8-float32", action="store_true", help="one-row int8 in float32 arithmetic (cuda_kernels.INT8_HALF off)")
    p.add_argument("--half-everywhere", action="store_true",
                   help="one-row int8 in float16 pairs also where cuda_kernels.use_half does not choose them")
    p.add_argument("--grid", help="one-row tuning: BLOCK_N:BLOCK_K pairs, comma-separated (default: a built-in grid)")
    p.add_argument("--warps", default="4,8", help="one-row tuning: num_warps values")
    p.add_argument("--stages", default="2,4", help="one-row tuning: num_stages values")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    cuda_kernels.INT8_HALF = not a.int8_float32
    cuda_kernels.HALF_EVERYWHERE = a.half_everywhere
    dev = torch.device("cuda")
    ceiling = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy ceiling {ceiling:.0f} GB/s", flush=True)
    records = []
    for kind, (name, (N, K)), M in itertools.product(a.kinds.split(","), shapes(PRESETS[a.model]).items(),
                                                      [int(r) for r in a.rows.split(",")]):
        if a.layers and name not in a.layers.split(","):
            continue
        ours, theirs, ref, nbytes = make_weights(kind, N, K, dev)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        expect = plain = x.float() @ ref.T
        fused = {}
        if a.fused and (M == 1 or (kind == "bf16" and M <= 16)):  # (several rows: bf16 weights, <= 16)
            if name in ("wo", "w2"):
                fused = dict(residual=torch.randn(M, N, device=dev, dtype=torch.bfloat16))
                expect = expect + fused["residual"].float()
            else:
                g = torch.ones(K, device=dev, dtype=torch.bfloat16)
                fused = dict(norm_weight=g, eps=1e-5)
                expect = plain * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)  # norm with g = 1
                if name == "w13":
                    fused["swiglu"] = True
                    gate, up = expect.chunk(2, dim=-1)
                    expect = torch.nn.functional.silu(gate) * up
        if fused:  # gemv's arguments after the weight and scales
            ours = (*ours, fused.get("norm_weight"), fused.get("eps", 0.0), fused.get("residual"),
                    fused.get("swiglu", False))
        scale = expect.abs().max().item()
        err = (cuda_kernels.gemv(x, *ours).float() - expect).abs().max().item() / scale
        err_base = (baseline(x, theirs).float() - plain).abs().max().item() / plain.abs().max().item()
        copies = max(2, -(-L2_MULTIPLE_BYTES // nbytes))
        ours_c = [ours] + [tuple(t.clone() if torch.is_tensor(t) else t for t in ours) for _ in range(copies - 1)]
        theirs_c = [theirs] + [tuple(t.clone() if torch.is_tensor(t) else t for t in theirs) for _ in range(copies - 1)]
        t_base = time_calls([lambda w=w: baseline(x, w) for w in theirs_c])
        default = cuda_kernels.config(kind, M, N, K, bool(fused.get("swiglu")),
                                 cuda_kernels.use_half(x, ours[1], M, fused.get("norm_weight")))
        t_ours = time_calls([lambda w=w: cuda_kernels.gemv(x, *w) for w in ours_c])
        best = (t_ours, default)
        if a.tune:
            if M == 1:
                pairs = ([tuple(int(v) for v in pair.split(":")) for pair in a.grid.split(",")] if a.grid else
                         ((4, 1024), (8, 512), (8, 1024), (16, 256), (16, 512), (32, 128), (32, 256), (4, 2048),
                          (2, 2048), (2, 1024), (16, 1024), (8, 2048)))
                grid = [(bn, bk, s, w, st) for bn, bk in pairs for s in ((1,) if fused else (1, 2, 4, 8))
                        for w in (int(v) for v in a.warps.split(",")) for st in (int(v) for v in a.stages.split(","))]
            elif kind == "bf16":  # several rows: cuda_kernels._rows_kernel, which takes all of K (no split)
                grid = [(bn, bk, 1, w, st) for bn, bk in ((16, 256), (16, 512), (32, 128), (32, 256), (64, 128),
                                                         (64, 256), (128, 64), (128, 128))
                        for w in (4, 8) for st in (3, 4, 6)]
            else:
                grid = [(bn, bk, s, w, st) for bn, bk in ((16, 64), (16, 128), (16, 256), (32, 64), (32, 128),
                                                         (64, 64), (64, 128))
                        for s in (1, 2, 4, 8) for w in (4, 8) for st in (2, 4)]
            error = lambda launch: (cuda_kernels.gemv(x, *ours, launch=launch).float() - expect).abs().max().item() / scale  # noqa: E731
            best = fastest(lambda launch, reps: time_calls([lambda w=w: cuda_kernels.gemv(x, *w, launch=launch)
                                                            for w in ours_c], reps),
                           [c for c in grid if K // c[1] >= c[2]], best, error, max(2 * err, 1e-2))
        rec = {"kind": kind, "layer": name, "fused": bool(fused), "N": N, "K": K, "rows": M, "bytes": nbytes,
               "base_us": t_base * 1e6, "base_gb_s": nbytes / t_base / 1e9, "ours_us": t_ours * 1e6,
               "ours_gb_s": nbytes / t_ours / 1e9, "default": default, "best_us": best[0] * 1e6,
               "best_gb_s": nbytes / best[0] / 1e9, "best": best[1], "err": err, "err_base": err_base,
               "ceiling_gb_s": ceiling, "int8_half": cuda_kernels.INT8_HALF, "half_everywhere": cuda_kernels.HALF_EVERYWHERE}
        records.append(rec)
        print(f"{kind:9s} {name:6s} {N:6d}x{K:<6d} M={M:<2d} base {t_base*1e6:7.1f} us {rec['base_gb_s']:5.0f} GB/s | "
              f"ours {t_ours*1e6:7.1f} us {rec['ours_gb_s']:5.0f} GB/s {default} | best {best[0]*1e6:7.1f} us "
              f"{rec['best_gb_s']:5.0f} GB/s {best[1]} | err {err:.1e} base {err_base:.1e}", flush=True)
        if a.json:
            a.json.write_text(json.dumps(records, indent=1))
        ours_c = theirs_c = None  # (the copies freed before the next layer)


if __name__ == "__main__":
    main()
