"""What each fast path of gdkernels/ buys in the whole decode step: the plain model.py, then the GEMVs
alone, then with the norms and residuals fused into them, then with the attention kernel, then all
(BENCHMARKS.md's gains table). Graphs mode, batch 1, random weights of a preset shape.

    python benchmarks/kernel_gains.py --model llama-2-7b [--quantize int4-g32] [--json PATH]
"""
import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (run from anywhere)
import gdkernels  # noqa: E402
from bench import PRESETS, QUANTIZE_CHOICES, bench_one, copy_bandwidth, quantized, random_model  # noqa: E402

VARIANTS = {  # name: gdkernels.apply's arguments, or None for the plain model
    "reference": None,
    "GEMVs": dict(fuse=False, attend=False),
    "GEMVs + fused norms": dict(fuse=True, attend=False),
    "GEMVs + attention": dict(fuse=False, attend=True),
    "all": dict(fuse=True, attend=True),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-2-7b")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    device = torch.device("cuda")
    ceiling = copy_bandwidth(device)
    rows = []
    for name, options in VARIANTS.items():
        torch.manual_seed(0)
        model = random_model(PRESETS[a.model], device, torch.bfloat16)
        if a.quantize:
            model = quantized(model, a.quantize)
        if options is not None:
            gdkernels.apply(model, **options)
        r = bench_one(model, "graphs", a.batch, 8, 200, ceiling, repeat=a.repeat)
        r.update(variant=name, model=a.model, quantize=a.quantize, gpu=torch.cuda.get_device_name(device),
                 torch=torch.__version__, date=datetime.date.today().isoformat(), command=" ".join(sys.argv))
        rows.append(r)
        base = rows[0]["tok_s"]
        print(f"{a.model} {a.quantize or 'bf16'} B={a.batch} {name:22s} {r['tok_s']:8.1f} tok/s "
              f"({r['tok_s'] / base:.3f}x reference)  runs {', '.join(f'{t:.1f}' for t in r['tok_s_runs'])}",
              file=sys.stderr, flush=True)
        del model
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    if a.json:
        old = json.loads(a.json.read_text()) if a.json.exists() else []
        a.json.write_text(json.dumps(old + rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
