"""Is the int4 g32 step slower in the first CUDA graph a process captures, and why?

Session 26 (BENCHMARKS.md) found the 7B int4 g32 step 707-710 tok/s when it is the first step captured in a
process and 716-720 when the same step was captured before (bench.py --modes manual,graphs or graphs,graphs),
with the same clocks and power in both timings; bf16 does not change. This script tells the two kinds of
cause apart in one process, with hand-captured graphs (bench.py's "manual" mode, no compile):

  A        the first capture, timed
  B        a second capture of the same step (its own token/pos buffers and graph pool), A still alive
  A again  the first graph replayed again after B's capture: fast here means the process changed, and A
           with it; slow means B's own graph is what is fast (where its buffers and pool lie)
  C        a third capture after A and B are deleted

    python benchmarks/capture_order.py [--model llama-2-7b] [--quantize int4-g32] [--repeat 2] [--pad-mb N]
                                      [--json FILE]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bench  # noqa: E402
from generate import Generator  # noqa: E402

PROMPT, NEW = 8, 200


def captured(model) -> Generator:
    """A generator whose step is captured by hand (bench.py's manual mode), after a prompt of PROMPT tokens."""
    return bench.warmed(model, "manual", 1, PROMPT, NEW)


def tok_s(gen, repeat: int) -> list[float]:
    """NEW steps from position PROMPT, timed as bench.bench_one times them, `repeat` times in a row."""
    with torch.no_grad():
        return [NEW / sum(bench.timed_decode(gen, PROMPT, NEW)) for _ in range(repeat)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-2-7b", choices=sorted(bench.PRESETS))
    p.add_argument("--quantize", default="int4-g32", help="a quantize mode as bench.py names it, or 'none' (bf16)")
    p.add_argument("--repeat", type=int, default=2, help="timed runs of each graph in a row")
    p.add_argument("--pad-mb", type=int, default=0,
                   help="allocate this many MiB (kept alive) before the first capture, to move its buffers")
    p.add_argument("--json", help="append the results to this file")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("error: capture_order.py times CUDA graphs and needs a CUDA GPU", file=sys.stderr)
        return 1
    if a.repeat < 1:
        print(f"error: --repeat must be at least 1 (got {a.repeat})", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = bench.random_model(bench.PRESETS[a.model], device, torch.bfloat16)
    if a.quantize != "none":
        model = bench.quantized(model, a.quantize)
    torch.cuda.empty_cache()
    print(f"{a.model} {a.quantize} on {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    results = {}

    def report(name, gen):
        results[name] = tok_s(gen, a.repeat)
        where = ", ".join(f"{b.data_ptr():#x}" for b in gen.buffers)
        print(f"{name:8s} " + ", ".join(f"{t:.1f}" for t in results[name]) + f" tok/s (token, pos, tokens at {where})",
              flush=True)

    pad = torch.empty(a.pad_mb << 20, dtype=torch.uint8, device=device) if a.pad_mb > 0 else None

    first = captured(model)
    report("A", first)
    second = captured(model)
    report("B", second)
    report("A again", first)
    del first, second
    torch.cuda.empty_cache()
    report("C", captured(model))
    del pad
    if a.json:
        old = json.loads(open(a.json).read()) if os.path.exists(a.json) else []
        record = dict(tok_s_runs=results, model=f"{a.model} {a.quantize}", pad_mb=a.pad_mb, gpu=torch.cuda.get_device_name(device),
                      torch=torch.__version__, command="python " + " ".join(sys.argv))
        with open(a.json, "w") as f:
            f.write(json.dumps(old + [record], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
