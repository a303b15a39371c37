"""The one-row int4 GEMV: cuda_kernels.int4_gemv (float16 pairs, and --dp4a 1 in integers; with what decode
fuses into each GEMV: RMSNorm before wqkv and w13, SwiGLU in w13, the residual add after wo and w2) against PyTorch's
tinygemm (_weight_int4pack_mm, the matmul alone), on a preset's shapes, timed as CUDA graph replays
over >= 1 GiB of weight copies (benchmarks/gemv.py's time_calls). Each result is checked against a
float64 reference of the dequantized weights first. --tune tries a grid of launches, each checked
the same way before it is timed (one whose error exceeds twice the default's is skipped). The scales
and zeros lie on quantize.py's grid, as it writes them; --codes 1 also times the integer kernel
reading them as 8-bit codes (model.INT4_CODES), the bytes a call reads counted as it reads them.
--xq 16 (or 8, 32) times the integer kernel reading x in int8 per group of that many columns
(cuda_kernels.int4_quantize_x, as decode's wo reads the attention kernel's output: cuda_kernels.INT4_XQ).

    python benchmarks/gemv_int4.py --model llama-2-7b [--groupsizes 32,128] [--dp4a 0,1] [--codes 0,1]
        [--xq 0,16] [--tune] [--l2-hot] [--json PATH]
"""
import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cuda_kernels  # noqa: E402
import model as M  # noqa: E402
from bench import PRESETS, copy_bandwidth  # noqa: E402
from quantize import on_grid  # noqa: E402
from benchmarks.gemv import L2_MULTIPLE_BYTES, fastest, shapes, time_calls  # noqa: E402

FUSED = {"wqkv": "norm", "wo": "residual", "w13": "swiglu", "w2": "residual", "output": "norm"}


def file_weights(N, K, G, device):
    """Random int4 weights in model.py's file layout: q, packed bytes, scales, zeros [N, K/G] (on
    quantize.py's grid)."""
    q = torch.randint(0, 16, (N, K), device=device, dtype=torch.uint8)
    packed = q[:, ::2] | (q[:, 1::2] << 4)
    scales = (torch.rand(N, K // G, device=device) * 2e-3 + 5e-4).bfloat16()
    zeros = (torch.randn(N, K // G, device=device) * 1e-3).bfloat16()
    return packed, *on_grid(scales, zeros, M.int4_units(scales, zeros))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-2-7b")
    p.add_argument("--groupsizes", default="32,128")
    p.add_argument("--layers", default="wqkv,wo,w13,w2")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--grid", default="8:8,8:16,16:8,16:16,16:32,32:8,32:16,64:4,64:8",
                   help="BLOCK_N:columns/64 pairs: BLOCK_G = columns / groupsize")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="3")
    p.add_argument("--prefetch", default="0,1", help="comma-separated: 0 none, 1 each block one step ahead, "
                   "2 two blocks loaded before the PDL wait (cuda_kernels._int4_gemv_kernel EARLY, integers or pairs)")
    p.add_argument("--dp4a", default="0,1", help="comma-separated int4_gemv arithmetics: 0 float16 pairs, "
                   "1 integers (dp4a)")
    p.add_argument("--codes", default="0", help="comma-separated: 0 scales and zeros in float16, 1 also as "
                   "8-bit codes (with --dp4a 1 only)")
    p.add_argument("--xq", default="0", help="comma-separated: 0 x in bf16, or groups (8, 16, 32) of x in int8 "
                   "as decode's wo reads the attention output (with --dp4a 1 only)")
    p.add_argument("--l2-hot", action="store_true",
                   help="time every call of a graph on the same weights, read from L2 where they fit (wo: 9 MB of "
                        "the H200's 60), instead of copies cycled past L2: what a GEMV gains from weights in L2")
    p.add_argument("--split-k", type=int, default=1,
                   help="a probe of split K: each shape as S slices of K side by side (N S rows of K / S), the "
                        "products of a split-K launch without its merge of the slices (an upper bound only: w13 "
                        "14.5 us so, run 79, but 17.7 with the merge, run 81, against 15.8 unsplit)")
    p.add_argument("--json", type=Path, help="append each record to this JSON list as it is measured")
    a = p.parse_args()
    if not set(a.dp4a.split(",")) <= {"0", "1"} or not set(a.codes.split(",")) <= {"0", "1"}:
        p.error(f"--dp4a and --codes take 0 and 1 (got {a.dp4a}, {a.codes})")
    if not set(a.xq.split(",")) <= {"0", *map(str, cuda_kernels.X_GROUPS)}:
        p.error(f"--xq takes 0, 8, 16 and 32 (got {a.xq})")
    variants = [(dp4a, codes, xq) for dp4a in (v == "1" for v in a.dp4a.split(","))
                for codes in (v == "1" for v in a.codes.split(",")) for xq in (int(v) for v in a.xq.split(","))
                if dp4a or not (codes or xq)]
    dev = torch.device("cuda")
    ceiling = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy ceiling {ceiling:.0f} GB/s", flush=True)
    records = json.loads(a.json.read_text()) if a.json and a.json.exists() else []  # (appended to)
    for G, (name, (N, K)) in itertools.product([int(g) for g in a.groupsizes.split(",")], shapes(PRESETS[a.model]).items()):
        if name not in a.layers.split(","):
            continue
        if a.split_k > 1:
            if K % (a.split_k * G):
                p.error(f"--split-k {a.split_k}: {name}'s K={K} is not whole groups of {G} a slice")
            N, K = N * a.split_k, K // a.split_k
        torch.manual_seed(0)
        packed, scales, zeros = file_weights(N, K, G, dev)
        W = M.dequantize_int4(packed, scales.double(), zeros.double(), G)  # [N, K] float64
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        xd = x.double()
        fused, kw = FUSED[name], {}
        out_n = N // 2 if fused == "swiglu" else N
        if fused in ("norm", "swiglu"):
            g = (0.5 + torch.rand(K, device=dev)).bfloat16()
            kw = dict(norm_weight=g, eps=1e-5)
            expect = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double()) @ W.T
            if fused == "swiglu":
                kw["swiglu"] = True
                gate, up = expect.chunk(2, dim=-1)
                expect = gate * torch.sigmoid(gate) * up
        else:
            r = torch.randn(1, N, device=dev, dtype=torch.bfloat16)
            kw = dict(residual=r, ones=torch.ones(K, device=dev, dtype=torch.bfloat16))  # (as Int4Linear passes)
            expect = xd @ W.T + r.double()
        theirs = M.pack_int4(packed, scales, zeros, G)
        plain = xd @ W.T
        err_tg = ((M.int4_linear(x, *theirs, G).double() - plain).abs().max() / plain.abs().max()).item()
        nbytes = N * K // 2 + N * (K // G) * 4
        copies = max(2, -(-L2_MULTIPLE_BYTES // nbytes))  # calls a graph; --l2-hot: all on the same weights
        copy = (lambda t: t) if a.l2_hot else (lambda t: t.clone() if torch.is_tensor(t) else t)  # noqa: E731
        theirs_c = [theirs] + [tuple(map(copy, theirs)) for _ in range(copies - 1)]
        t_tg = time_calls([lambda w=w: M.int4_linear(x, *w, G) for w in theirs_c])
        del theirs_c
        for dp4a, codes, xq in variants:
            kw.pop("xq", None)
            if xq:  # x in int8 as its producer would write it (times the norm's g)
                kw["xq"] = cuda_kernels.int4_quantize_x(x, kw.get("norm_weight"), xq)
            ours = M.int4_gemv_layout(packed, scales, zeros, G, dp4a, codes)
            codes = ours[4] is not None  # (what was built: the grid holds)
            default = cuda_kernels.int4_config(out_n, K, G, fused == "swiglu", dp4a, codes, bool(xq))
            ours_bytes = sum(t.numel() * t.element_size() for t in (ours[0], ours[1], ours[4]) if t is not None)
            kw["dp4a"] = dp4a
            error = lambda y: ((y.double() - expect).abs().max() / expect.abs().max()).item()  # noqa: E731
            err = error(cuda_kernels.int4_gemv(x, *ours, **kw))
            ours_c = [ours] + [tuple(map(copy, ours)) for _ in range(copies - 1)]
            t_ours = time_calls([lambda w=w: cuda_kernels.int4_gemv(x, *w, **kw) for w in ours_c])
            best, errs = (t_ours, default), {default: err}
            if a.tune:
                def launch_error(launch):
                    errs[launch] = error(cuda_kernels.int4_gemv(x, *ours, **kw, launch=launch))
                    return errs[launch]

                grid = [(bn, max(1, cols * 64 // G), w, s, int(f)) for bn, cols in
                        (tuple(int(v) for v in pair.split(":")) for pair in a.grid.split(","))
                        for w in (int(v) for v in a.warps.split(",")) for s in (int(v) for v in a.stages.split(","))
                        for f in a.prefetch.split(",")]
                # (a launch off by more than twice the default's error, or INT4_TOLERANCE's 2.5e-2, is skipped)
                best = fastest(lambda launch, reps: time_calls([lambda w=w: cuda_kernels.int4_gemv(x, *w, **kw, launch=launch)
                                                                for w in ours_c], reps),
                               grid, best, launch_error, max(2 * err, 2.5e-2))
            rec = {"layer": name, "fused": fused, "G": G, "split_k": a.split_k, "N": N, "K": K, "dp4a": dp4a, "codes": codes, "xq": xq,
                   "l2_hot": a.l2_hot,
                   "bytes": nbytes, "ours_bytes": ours_bytes,
                   "tinygemm_us": t_tg * 1e6, "tinygemm_gb_s": nbytes / t_tg / 1e9, "ours_us": t_ours * 1e6,
                   "ours_gb_s": ours_bytes / t_ours / 1e9, "default": default, "best_us": best[0] * 1e6,
                   "best_gb_s": ours_bytes / best[0] / 1e9, "best": best[1], "err": err, "err_best": errs[best[1]],
                   "err_tinygemm": err_tg,
                   "ceiling_gb_s": ceiling}
            records.append(rec)
            print(f"g{G:<3d} {name:6s} {N:6d}x{K:<6d} {fused:8s} dp4a {int(dp4a)} codes {int(codes)} xq {xq:2d} tinygemm {t_tg*1e6:6.1f} us "
                  f"{rec['tinygemm_gb_s']:5.0f} GB/s | ours {t_ours*1e6:6.1f} us {rec['ours_gb_s']:5.0f} GB/s {default} | "
                  f"best {best[0]*1e6:6.1f} us {rec['best_gb_s']:5.0f} GB/s {best[1]} | err {err:.1e} best's {errs[best[1]]:.1e} "
                  f"tinygemm {err_tg:.1e}",
                  flush=True)
            if a.json:
                a.json.write_text(json.dumps(records, indent=1))
            ours_c = None  # (the copies freed before the next layer)


if __name__ == "__main__":
    main()
