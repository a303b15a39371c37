"""A timing probe: how much faster would the int4 g32 decode step be with one code byte a group instead of two?

int4_ring.py's kernel reads, a group of 32 weights, 16 bytes of nibbles and an int16 code: the scale's code in the
low byte, the zero's in the high. A format without zeros (symmetric int4) or with both codes in one byte would
read 17 bytes instead of 18. This builds bench.py's 7B int4 g32 model (random weights, quantized in memory), then
times bench.py's one-token step (batch 1, prompt 8, 200 new tokens) with the codes of every layer's wo and w2 (the
ring layers without the norm: 31% of the weights; with the norm, one-byte codes gave wrong numbers in session 28, fixed since: --all-layers):

  int16            as quantized (the shipped step)
  int16, no zeros  the zeros' codes set to 0: the numbers of the next line
  int8             int4_ring.code_bytes of those: the scales' codes alone, one byte a group (the kernel then
                   also skips the zeros' products and x's sums: not bytes alone)

Dropping the zeros changes the model (its tokens are not the shipped model's): only the time means anything. The
last two must give the same logits bit for bit (checked). Each variant is timed captured by hand (bench.py's
manual mode) and through torch.compile's CUDA graphs (--graphs), each --repeat times in a row (the last reported).

    python benchmarks/ring_codes.py [--model llama-2-7b] [--graphs] [--all-layers] [--repeat 2] [--cycles 2]
        [--json FILE]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bench  # noqa: E402
import int4_ring  # noqa: E402
from benchmarks.ring_launch import append_record, first_logits, quantized_preset  # noqa: E402
from model import Int4Linear  # noqa: E402


def ring_layers(model, all_layers: bool = False) -> list[Int4Linear]:
    """The int4 layers the ring's kernel runs without the norm in one-token decode: every layer's wo and w2; or
    (all_layers) every layer it runs, wqkv and w13 too, which take RMSNorm's scale in the kernel (where one-byte
    codes gave wrong numbers before the fix of session 28, checked on the H200 in session 29)."""
    first = model.layers[0].attention.wqkv  # (cuda_kernels.int4_gemv's: x comes in bf16)
    parts = (lambda b: (b.attention.wqkv, b.attention.wo, b.feed_forward.w13, b.feed_forward.w2)) if all_layers \
        else (lambda b: (b.attention.wo, b.feed_forward.w2))
    return [m for block in model.layers for m in parts(block)
            if isinstance(m, Int4Linear) and getattr(m, "gemv_ring", False) and m is not first]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-2-7b", choices=sorted(bench.PRESETS))
    p.add_argument("--graphs", action="store_true", help="also time each variant through torch.compile's graphs")
    p.add_argument("--all-layers", action="store_true", help="one-byte codes in wqkv and w13 too (with the norm)")
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--cycles", type=int, default=1, help="times through the variants in each mode (2: ABCABC, so "
                   "that an order effect shows)")
    p.add_argument("--json", help="append each record to this file")
    a = p.parse_args()
    model, device, ceiling = quantized_preset(a.model, "int4-g32")
    layers = ring_layers(model, a.all_layers)
    if not layers:
        print("error: no layer runs int4_ring.py's kernel here (sm_90 and Triton's Gluon needed)", file=sys.stderr)
        return 1
    print(f"{a.model} int4-g32 on {torch.cuda.get_device_name(device)}, torch {torch.__version__}; copy ceiling "
          f"{ceiling:.0f} GB/s; one-byte codes in {len(layers)} layers ({'all the ring runs' if a.all_layers else 'wo, w2'})",
          flush=True)
    shipped = [m.gemv_sz for m in layers]
    no_zeros = [c & 255 for c in shipped]
    variants = {"int16": shipped, "int16, no zeros": no_zeros, "int8": [int4_ring.code_bytes(c) for c in no_zeros]}
    saved = {k: sum(c.numel() * c.element_size() for c in v) for k, v in variants.items()}
    logits = {}
    for mode in ("manual", "graphs") if a.graphs else ("manual",):
        for name, codes in list(variants.items()) * a.cycles:
            for m, c in zip(layers, codes):
                m.gemv_sz = c
            if mode == "manual":
                logits[name] = first_logits(model)
            r = bench.bench_one(model, mode, 1, 8, a.new_tokens, ceiling, repeat=a.repeat)
            r.update(variant=name, code_bytes=saved[name], gpu=torch.cuda.get_device_name(device),
                     torch=torch.__version__, model=f"{a.model} int4-g32", command="python " + " ".join(sys.argv))
            print(f"{mode:7s} {name:16s} {r['tok_s']:7.1f} tok/s (runs {', '.join(f'{t:.1f}' for t in r['tok_s_runs'])})"
                  f"  {r['step_ms_median']:.3f} ms (p99 {r['step_ms_p99']:.3f})  codes {saved[name] / 2**20:.0f} MiB",
                  flush=True)
            if a.json:
                append_record(a.json, r)
            if mode == "graphs":
                torch._dynamo.reset()
    same = torch.equal(logits["int8"], logits["int16, no zeros"])
    print(f"int8 codes give the logits of int16 codes without zeros bit for bit: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
