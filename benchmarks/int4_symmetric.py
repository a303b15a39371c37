"""What symmetric int4 at group 32 (no zero: W = (q - 8) s, q in 0..15) would cost in quality. A question
for the H200 speed (BENCHMARKS.md session 28): with no zeros, int4_ring.py's kernel would read one code byte a
group instead of two (17 bytes a group of 32 weights instead of 18, 5.6% fewer) and skip the zero's products.
Each block layer's weight of a float checkpoint is replaced by its symmetric int4 g32 values: per group the
best of several clipped absolute maxima, each refitted by least squares for its levels, then the scale moved
onto quantize.py's 8-bit grid (a power-of-two unit a row, 1..255 units; the better of the two codes around
it). The same for quantize.quantize_int4 (asymmetric, the shipped format) as the control. Then eval.py's
perplexity of each, on the CPU in float32. (The default model's weights come from a Q4_1 file, asymmetric g32,
which the shipped format holds almost exactly: a model with float weights would lose less to symmetric.)

    python benchmarks/int4_symmetric.py [--checkpoint DIR]    (default: the default model, converted in bf16
        from its GGUF into a temporary directory) [--text tests/data/eval_text.txt] [--json FILE]
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import quantize  # noqa: E402
from eval import perplexity  # noqa: E402
from model import Transformer, dequantize_int4  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

G = 32


def symmetric_int4(w: torch.Tensor, clips=(0.0, 0.05, 0.1, 0.15),
                   divisors=(7.0, 7.5, 8.0)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 32) -> symmetric int4 g32: (levels q - 8 [N, K/32, 32] in -8..7, scales s
    [N, K/32, 1], units [N, 1, 1]), float32, w ~ (q - 8) s per group, s a whole number 1..255 of its row's
    power-of-two unit."""
    N, K = w.shape
    x = w.float().view(N, K // G, G)
    amax = x.abs().amax(-1, keepdim=True).clamp(min=1e-12)
    best_err = best_s = None
    for clip in clips:
        for div in divisors:
            s = amax * (1 - clip) / div
            for refit in (False, True):
                if refit:  # least squares for x ~ q s, the levels q fixed
                    q = (x / s).round().clamp(-8, 7)
                    num, den = (q * x).sum(-1, keepdim=True), (q * q).sum(-1, keepdim=True)
                    s = torch.where((den > 0) & (num > 0), num / den.clamp(min=1e-30), s)
                err = (((x / s).round().clamp(-8, 7) * s - x) ** 2).sum(-1, keepdim=True)
                if best_err is None:
                    best_err, best_s = err, s
                else:
                    better = err < best_err
                    best_err, best_s = torch.where(better, err, best_err), torch.where(better, s, best_s)
    # the grid: the smallest power of two a row that holds its largest scale in 255 units
    unit = torch.exp2(torch.ceil(torch.log2(best_s.amax(dim=(1, 2), keepdim=True) / 255)))
    best = None
    for code in ((best_s / unit).floor(), (best_s / unit).ceil()):
        s = code.clamp(1, 255) * unit
        levels = (x / s).round().clamp(-8, 7)
        err = ((levels * s - x) ** 2).sum(-1, keepdim=True)
        best = (err, levels, s) if best is None else tuple(torch.where(err < best[0], a, b)
                                                           for a, b in zip((err, levels, s), best))
    return best[1], best[2], unit


def symmetric_values(w: torch.Tensor) -> torch.Tensor:
    """symmetric_int4's values of w [N, K]: (q - 8) s, [N, K] float32."""
    levels, scales, _ = symmetric_int4(w)
    return (levels * scales).view(w.shape)


def asymmetric_int4(w: torch.Tensor) -> torch.Tensor:
    """quantize.quantize_int4 at group 32 (the shipped format), dequantized: [N, K] float32."""
    q, scales, zeros = quantize.quantize_int4(w, G)
    return dequantize_int4(q, scales.float(), zeros.float(), G)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, help="a float checkpoint (default: the default model, bf16)")
    p.add_argument("--text", type=Path, default=ROOT / "tests/data/eval_text.txt")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = a.checkpoint
        if checkpoint is None:
            from convert_hf_checkpoint import convert, fetch_default_gguf

            checkpoint = convert(str(fetch_default_gguf()), Path(tmp) / "default", dtype="bf16")
        tokens = load_tokenizer(checkpoint).encode(a.text.read_text(encoding="utf-8"))
        results = []
        for name, fit in (("float", None), ("int4 g32 asymmetric (shipped)", asymmetric_int4),
                          ("int4 g32 symmetric", symmetric_values)):
            start = time.perf_counter()
            model = Transformer.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32)
            err = norm = 0.0
            with torch.no_grad():
                for module_name, m in model.named_modules():
                    if fit and module_name.startswith("layers.") and getattr(m, "weight", None) is not None \
                            and m.weight.dim() == 2:
                        w = m.weight.data
                        new = fit(w)
                        err, norm = err + ((new - w) ** 2).sum().item(), norm + (w ** 2).sum().item()
                        m.weight.data = new.to(w.dtype)
                ppl = perplexity(model, tokens, 512, 256)
            results.append({"variant": name, "perplexity": ppl, "weights_rel_sq_error": err / norm if norm else 0.0})
            ratio = ppl / results[0]["perplexity"]
            print(f"{name}: perplexity {ppl:.4f} ({ratio:.4f}x float), weights' relative squared error "
                  f"{results[-1]['weights_rel_sq_error']:.3e} ({time.perf_counter() - start:.0f} s)", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"checkpoint": str(a.checkpoint or "default model, bf16"), "window": 512,
                                      "stride": 256, "dtype": "float32", "results": results}, indent=1))


if __name__ == "__main__":
    main()
