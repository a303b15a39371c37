"""What cuda_kernels.int4_gemv's integer form (dp4a) does to quality: eval.py's perplexity of an int4
checkpoint as it is, and with the input of every int4 layer rounded as that kernel rounds it, to
int8 per group of the int4 layer's columns (q = floor(x 127 / max|x| + 0.5), x ~ q max|x| / 127;
the kernel's group, gcd(groupsize, K): Int4Linear.kernel_groupsize). The kernel only
runs one-row decode steps on CUDA, which eval.py's prefill never reaches, so this simulates it on
the CPU in float32 instead: the same rounding, applied to every token.

    python benchmarks/x_int8_perplexity.py --checkpoint checkpoints/SmolLM2-135M-Instruct-int4-g32
"""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import model as M  # noqa: E402
from eval import perplexity  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


def int8_per_group(x: torch.Tensor, group: int) -> torch.Tensor:
    """x rounded to int8 per group of `group` columns, as _int4_dp4a_block rounds it, back in x's dtype."""
    xg = x.reshape(*x.shape[:-1], -1, group)
    amax = xg.abs().amax(-1, keepdim=True)
    q = torch.floor(xg * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)) + 0.5)
    return (q * amax / 127).reshape(x.shape)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints/SmolLM2-135M-Instruct-int4-g32")
    p.add_argument("--text", type=Path, default=ROOT / "tests/data/eval_text.txt")
    p.add_argument("--window", type=int, default=512)
    a = p.parse_args()
    tokens = load_tokenizer(a.checkpoint).encode(a.text.read_text(encoding="utf-8"))
    model = M.Transformer.from_checkpoint(a.checkpoint, device=torch.device("cpu"), dtype=torch.float32)
    if not any(isinstance(m, M.Int4Linear) for m in model.modules()):
        sys.exit(f"error: {a.checkpoint} has no int4 layers")
    plain = perplexity(model, tokens, a.window, a.window // 2)
    linear = M.Int4Linear.linear
    M.Int4Linear.linear = lambda self, x: linear(self, int8_per_group(x, self.kernel_groupsize))
    try:
        rounded = perplexity(model, tokens, a.window, a.window // 2)
    finally:
        M.Int4Linear.linear = linear
    print(f"{a.checkpoint.name}: perplexity {plain:.4f}; with each int4 layer's input in int8 per group: "
          f"{rounded:.4f} ({rounded / plain:.5f}x)")


if __name__ == "__main__":
    main()
