"""What fewer bits for int4's scales and zeros would cost in quality (a question for the H200 speed:
at group 32 the float16 scale and zero of each group are a fifth of the bytes cuda_kernels.int4_gemv reads,
BENCHMARKS.md session 11). Each int4 layer's scales s and zeros z (W = (q - 8) s + z, per group) are
rounded to BITS bits relative to the largest of their block of groups in the same row (s unsigned,
s = k max(s) / (2^BITS - 1), k >= 1; z signed, z = k max|z| / (2^(BITS-1) - 1)), as llama.cpp's Q4_K
does with 6 bits in blocks of 8 groups; then each weight's level q is rounded again against the new s
and z (W from the checkpoint as it is). eval.py's perplexity of each variant, on the CPU in float32.
(Session 12 built the answer: quantize.py writes 8-bit scales and zeros on a grid with a power-of-two
unit a row, and cuda_kernels.int4_gemv reads them as codes; BENCHMARKS.md session 12.)

    python benchmarks/int4_scale_bits.py [--checkpoint checkpoints/SmolLM2-135M-Instruct-int4-g32]
        [--bits 8,6,5] [--blocks 0,6]    (--blocks: groups a block, 0 = the whole row)
"""
import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import model as M  # noqa: E402
from eval import perplexity  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


def round_relative(v: torch.Tensor, bits: int, block: int, signed: bool, pow2: bool = False) -> torch.Tensor:
    """v [N, G] rounded to `bits` bits a value relative to the largest |v| of each block of `block`
    groups in a row (0: the row); unsigned values keep at least one step (a scale of 0 would lose
    the group)."""
    N, G = v.shape
    block = block or G
    pad = -G % block
    vb = torch.nn.functional.pad(v, (0, pad)).view(N, -1, block)
    levels = 2 ** (bits - 1) - 1 if signed else 2 ** bits - 1
    step = vb.abs().amax(-1, keepdim=True).clamp(min=1e-30) / levels
    if pow2:  # the smallest power of two that keeps the block's largest within the levels
        step = torch.exp2(torch.log2(step).ceil())
    k = (vb / step).round()
    if not signed:
        k = k.clamp(min=1)
    return (k * step).view(N, -1)[:, :G]


def requantize(sd: dict, bits: int, block: int, groupsize: int, pow2: bool = False) -> dict:
    """The state dict with every int4 layer's scales and zeros rounded (round_relative) and its
    levels re-rounded against them."""
    out = dict(sd)
    for name in [k[:-len(".zeros")] for k in sd if k.endswith(".zeros")]:  # (int8 layers have scales only)
        packed, s, z = sd[name + ".weight"], sd[name + ".scales"].float(), sd[name + ".zeros"].float()
        W = M.dequantize_int4(packed, s, z, groupsize)
        s2, z2 = round_relative(s, bits, block, False, pow2), round_relative(z, bits, block, True, pow2)
        group = torch.arange(W.shape[1]) // groupsize  # column -> its group, as dequantize_int4's
        q2 = ((W - z2[:, group]) / s2[:, group] + 8).round().clamp(0, 15).to(torch.uint8)
        out[name + ".weight"] = (q2[:, ::2] | q2[:, 1::2] << 4).contiguous()
        out[name + ".scales"] = s2.to(sd[name + ".scales"].dtype)
        out[name + ".zeros"] = z2.to(sd[name + ".zeros"].dtype)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints/SmolLM2-135M-Instruct-int4-g32")
    p.add_argument("--text", type=Path, default=ROOT / "tests/data/eval_text.txt")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--bits", default="8,6,5")
    p.add_argument("--blocks", default="0,6", help="groups a block of the relative rounding (0: the whole row)")
    p.add_argument("--pow2", action="store_true", help="each block's unit a power of two (exact in bf16)")
    a = p.parse_args()
    tokens = load_tokenizer(a.checkpoint).encode(a.text.read_text(encoding="utf-8"))
    files = sorted(a.checkpoint.glob("*.safetensors"))
    if len(files) != 1:
        sys.exit(f"error: {a.checkpoint} needs exactly one .safetensors file (found {len(files)})")
    sd = load_file(files[0])
    groupsize = json.loads((a.checkpoint / "config.json").read_text())["quantization"]["groupsize"]

    def ppl(directory: Path) -> float:
        model = M.Transformer.from_checkpoint(directory, device=torch.device("cpu"), dtype=torch.float32)
        return perplexity(model, tokens, a.window, a.window // 2)

    base = ppl(a.checkpoint)
    print(f"{a.checkpoint.name}: perplexity {base:.4f} (scales and zeros as stored)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        variant = Path(tmp)
        for f in a.checkpoint.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, variant / f.name)
        for bits in (int(b) for b in a.bits.split(",")):
            for block in (int(b) for b in a.blocks.split(",")):
                save_file(requantize(sd, bits, block, groupsize, a.pow2), str(variant / files[0].name))
                v = ppl(variant)
                where = ("the row" if block == 0 else f"{block} groups") + (", power-of-two units" if a.pow2 else "")
                print(f"  {bits}-bit scales and zeros, relative to the largest of {where}: perplexity {v:.4f} "
                      f"({v / base:.4f}x)", flush=True)


if __name__ == "__main__":
    main()
