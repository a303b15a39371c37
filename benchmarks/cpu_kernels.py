"""The CPU decode matmuls alone: cpu_kernels.cpp against PyTorch's weight-only ops, one row, on the
default model's shapes (SmolLM2-135M: dim 576, 3 KV heads of 64, FFN 1536, vocab 49152), random
weights cycled over 20 copies per layer so that they come from memory as in decode. Prints the
time per call, the error against float64 on the same dequantized weights, and the sum over a
token's 30 layers plus the head (BENCHMARKS.md, CPU).

    python benchmarks/cpu_kernels.py [--threads N]
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cpu_kernels  # noqa: E402
from model import dequantize_int4, dequantize_int8, pack_int4  # noqa: E402

SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w13": (3072, 576), "w2": (576, 1536)}  # N, K; 30 layers
HEAD = (49152, 576)
COPIES = 20


def per_call(fn, args_list, reps=200) -> float:
    for a in args_list[:5]:
        fn(*a)
    start = time.perf_counter()
    for i in range(reps):
        fn(*args_list[i % len(args_list)])
    return (time.perf_counter() - start) / reps


def rel(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: PyTorch's)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if not cpu_kernels.available():
        sys.exit("cpu_kernels.cpp cannot run here")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    g = torch.Generator().manual_seed(0)
    totals = {"ours": 0.0, "pytorch": 0.0}
    for name, (N, K) in [*SHAPES.items(), ("head (int8)", HEAD)]:
        x = torch.randn(1, K, generator=g)
        if name.startswith("head"):
            w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
            s = torch.rand(N, generator=g).add(0.5).mul(1e-3).bfloat16().float()
            ref = x.double() @ dequantize_int8(w, s).double().T
            ours = [(x, w.clone(), s.clone()) for _ in range(COPIES // 4)]
            theirs = [(x.bfloat16(), w.clone(), s.bfloat16()) for _ in range(COPIES // 4)]
            fo, ft = cpu_kernels.int8_linear, torch._weight_int8pack_mm
            count = 1
        else:
            w = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
            s = torch.rand(N, K // 32, generator=g).add(0.1).mul(0.01).bfloat16().float()
            z = torch.randn(N, K // 32, generator=g).mul(0.01).bfloat16().float()
            ref = x.double() @ dequantize_int4(w, s, z, 32).double().T
            bs, bz = cpu_kernels.block_params(s, z, 32, K)
            packed, sz = pack_int4(w, s, z, 32)
            ours = [(x, w.clone(), bs.clone(), bz.clone()) for _ in range(COPIES)]
            theirs = [(x.bfloat16(), packed.clone(), 32, sz.clone()) for _ in range(COPIES)]
            fo, ft = cpu_kernels.int4_linear, torch._weight_int4pack_mm_for_cpu
            count = 30
        to, tt = per_call(fo, ours), per_call(ft, theirs)
        totals["ours"] += count * to
        totals["pytorch"] += count * tt
        print(f"{name:12s} {N:6d}x{K:<5d} ours {to * 1e6:7.1f} us (error {rel(fo(*ours[0]), ref):.1e}) | "
              f"PyTorch {tt * 1e6:7.1f} us (error {rel(ft(*theirs[0]).float(), ref):.1e}) | x{tt / to:.2f}")
    print(f"a token's matmuls (30 layers + head): ours {totals['ours'] * 1e3:.2f} ms, "
          f"PyTorch {totals['pytorch'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
