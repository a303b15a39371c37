"""int4_ring.py's launches by shape, timed in the whole decode step rather than in a chain of GEMVs alone.

`python benchmarks/ring_launch.py [--model llama-2-7b] [--quantize int4-g32] --launches "DEFAULT|gate/up=4,6|..."
[--graphs "DEFAULT|gate/up=4,6"] [--json FILE]` builds the model once (random weights, quantized in memory as
bench.py does), then for each launch (int4_ring.GRAPHDECODE_INT4_RING_LAUNCH's form; DEFAULT: int4_ring.LAUNCHES)
times bench.py's one-token step (batch 1, prompt 8, 200 new tokens) captured by hand in one CUDA graph
(bench.py's "manual" mode: no compile, so a launch costs seconds) and, for those in --graphs, through
torch.compile's CUDA graphs as bench.py times it, each --repeat times in a row (the last reported). A launch that
changes only programs an SM and boxes in flight must give DEFAULT's logits bit for bit (it splits rows among
programs, never a sum), or it fails; one that changes rows or warps changes the order of sums, so its logits'
largest difference is printed instead; so does one with "attention=BLOCK_L,WARPS[,SPLITS]" (the attention
kernel's launch, as bench.py's --attention-* flags set it). "masked" and "nomasked" in a launch turn
int4_ring.MASKED on and off (the products' integer dots with fewer instructions: the same logits bit for bit, or it
fails), "onesum" and "noonesum" int4_ring.ONE_SUM (a tile's rows summed across lanes once: another order of sums,
so where it differs from the default its largest difference is printed); unsaid, each stays as int4_ring has it
(both on since session 30, unless GRAPHDECODE_INT4_RING_MASKED or _ONE_SUM say 0). Session 30's A/B, with both
then off by default, was `--launches "DEFAULT|masked|onesum|masked;onesum"`; with them on it is
`--launches "nomasked;noonesum|noonesum|nomasked|DEFAULT"`.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bench  # noqa: E402
import int4_ring  # noqa: E402
import cuda_kernels  # noqa: E402


def first_logits(model) -> torch.Tensor:
    """Logits of four one-token steps (positions 0-3, so the last attends to a cache) in eager: the int8
    flow's kernels at this launch."""
    device = model.tok_embeddings.weight.device
    model.setup_caches(1, 32)
    with torch.no_grad():
        for i, t in enumerate((1, 7, 42, 9)):
            logits = model(torch.tensor([[t]], device=device), torch.tensor([i], device=device))
    return logits.float()


DEFAULT_FLAGS = {"masked": int4_ring.MASKED, "onesum": int4_ring.ONE_SUM}  # as int4_ring has them at import


def settings_of(launch: str) -> tuple[str, tuple | None, dict]:
    """A launch's GRAPHDECODE_INT4_RING_LAUNCH text, its attention=BLOCK_L,WARPS[,SPLITS] (None: the rule's) and
    its flags ({"masked": int4_ring.MASKED, "onesum": int4_ring.ONE_SUM}, DEFAULT_FLAGS' where it says neither
    "masked" nor "nomasked", ...), checked; ValueError naming the form."""
    parts = [] if launch == "DEFAULT" else launch.split(";")
    flags = dict(DEFAULT_FLAGS)
    for p in parts:
        if p.removeprefix("no") in flags:
            flags[p.removeprefix("no")] = not p.startswith("no")
    parts = [p for p in parts if p.removeprefix("no") not in flags]
    attention = [p for p in parts if p.startswith("attention=")]
    ring = ";".join(p for p in parts if p not in attention)
    int4_ring.launch_override(ring)
    if not attention:
        return ring, None, flags
    values = cuda_kernels.launch_parts(attention[-1])[0][1]
    if len(values) not in (2, 3) or min(values) < 0 or values[1] not in (0, 1, 2, 4, 8, 16) or \
            any(v & (v - 1) for v in values[:1]):
        raise ValueError(f"{attention[-1]!r} is not attention=BLOCK_L,WARPS[,SPLITS] (BLOCK_L a power of two, "
                         f"warps a power of two up to 16, 0 for the rule's)")
    return ring, tuple(values + [0])[:3], flags


def apply(ring: str, attention: tuple | None, flags: dict) -> None:
    """Set the ring's launches and the attention kernel's (cuda_kernels.ATTENTION_BLOCK_L, _WARPS, _SPLITS, as
    bench.py's --attention-* flags set them; 0 or None: the rule's), int4_ring.MASKED and int4_ring.ONE_SUM."""
    int4_ring.LAUNCH = ring
    int4_ring.MASKED = flags["masked"]
    int4_ring.ONE_SUM = flags["onesum"]
    cuda_kernels.ATTENTION_BLOCK_L, cuda_kernels.ATTENTION_WARPS, cuda_kernels.ATTENTION_SPLITS = \
        (v or None for v in (attention or (0, 0, 0)))


def append_record(path: str, record: dict) -> None:
    """Add record to the JSON list in path (made if missing)."""
    old = json.loads(open(path).read()) if os.path.exists(path) else []
    with open(path, "w") as f:
        f.write(json.dumps(old + [record], indent=1) + "\n")


def quantized_preset(name: str, quantize: str):
    """(model, device, copy ceiling in GB/s): bench.py's preset `name` with random weights (seed 0) on CUDA,
    quantized in memory as bench.py does (`quantize`: one of its --quantize choices)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = bench.quantized(bench.random_model(bench.PRESETS[name], device, torch.bfloat16), quantize)
    return model, device, bench.copy_bandwidth(device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-2-7b", choices=sorted(bench.PRESETS))
    p.add_argument("--quantize", default="int4-g32")
    p.add_argument("--launches", default="DEFAULT", help="'|'-separated launches, DEFAULT for int4_ring.LAUNCHES")
    p.add_argument("--graphs", default="", help="'|'-separated launches also timed through torch.compile's graphs")
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--repeat", type=int, default=2, help="timed runs of each launch, the last reported (the first "
                   "launch captured in a process runs 5-11 tok/s low: BENCHMARKS.md, sessions 25-26)")
    p.add_argument("--json", help="append each record to this file")
    a = p.parse_args()
    model, device, ceiling = quantized_preset(a.model, a.quantize)
    print(f"{a.model} {a.quantize} on {torch.cuda.get_device_name(device)}, torch {torch.__version__}; "
          f"copy ceiling {ceiling:.0f} GB/s; int4_ring.LAUNCHES {int4_ring.LAUNCHES}", flush=True)
    plan = [(launch, "manual") for launch in a.launches.split("|")] + \
           [(launch, "graphs") for launch in filter(None, a.graphs.split("|"))]
    try:
        settings = {launch: settings_of(launch) for launch, _ in plan}
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    apply(*settings_of("DEFAULT"))
    reference = first_logits(model)  # DEFAULT's
    for launch, mode in plan:
        ring, attention, flags = settings[launch]
        apply(ring, attention, flags)
        logits = first_logits(model)
        same = torch.equal(logits, reference)
        # (rows, warps, the attention kernel's launch and ONE_SUM change the order of sums)
        exact = attention is None and flags["onesum"] == DEFAULT_FLAGS["onesum"] and all(
            v[2:] == int4_ring.LAUNCHES.get(shape, (0, 0, int4_ring.ROWS, int4_ring.WARPS))[2:]
            for shape, v in int4_ring.launch_override(ring).items())
        r = bench.bench_one(model, mode, 1, 8, a.new_tokens, ceiling, repeat=a.repeat)
        r.update(launch=launch, same_logits=same, gpu=torch.cuda.get_device_name(device), torch=torch.__version__,
                 model=f"{a.model} {a.quantize}", command="python " + " ".join(sys.argv))
        print(f"{mode:7s} {launch:40s} {r['tok_s']:7.1f} tok/s  {r['step_ms_median']:.3f} ms "
              f"(p99 {r['step_ms_p99']:.3f})  same logits: {same}"
              + ("" if same else f" (largest difference {(logits - reference).abs().max().item():.3g})"), flush=True)
        if a.json:
            append_record(a.json, r)
        if mode == "graphs":
            torch._dynamo.reset()
        if exact and not same:
            print(f"error: launch {launch!r} changed the logits", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
