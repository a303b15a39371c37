"""Where one decode step's time goes, kernel by kernel (BENCHMARKS.md's table of the small models' step).

A graphed batch-1 step of a preset shape (random bf16 weights, kernels on) at position 128, six steps in a
torch.profiler trace. With programmatic dependent launch the kernels overlap (each starts early, then waits for the
one before), so a kernel's duration says little; its cost is what it adds to the chain: its end minus the previous
kernel's end. Against it, the bytes it must read (its weights; attention: the KV up to the position).

    python benchmarks/step_profile.py --model llama-3.2-1b [--trace FILE]   # FILE keeps the trace's kernels
    python benchmarks/step_profile.py --from-trace FILE   # the table again (the model the trace names), no GPU needed
"""
import argparse
import collections
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (run from anywhere)
import gdkernels  # noqa: E402
from bench import PRESETS, copy_bandwidth, random_model, timed_decode, warmed  # noqa: E402

POSITION, STEPS = 128, 6


def capture(model_name: str) -> dict:
    """-> {"model", "gpu", "torch", "date", "command", "step_ms" (timed apart, median of 64 steps), "ceiling" GB/s,
    "events": the trace's GPU kernels, {"name", "start", "end"} in µs from the first one's start}."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    ceiling = copy_bandwidth(device)
    model = random_model(PRESETS[model_name], device, torch.bfloat16)
    gdkernels.apply(model)
    with torch.no_grad():
        gen = warmed(model, "graphs", 1, POSITION, 64)
        step_ms = statistics.median(timed_decode(gen, POSITION, 64)) * 1e3
        gen.pos.fill_(POSITION)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(STEPS):
                gen.decode_step()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    t0 = kernels[0]["ts"]
    return {"model": model_name, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": str(datetime.date.today()), "command": " ".join(["python", *sys.argv]), "step_ms": step_ms,
            "ceiling": ceiling, "events": [{"name": e["name"], "start": round(e["ts"] - t0, 2),
                                            "end": round(e["ts"] + e["dur"] - t0, 2)} for e in kernels]}


def table(trace: dict) -> str:
    """The kernels of the traced steps (the first left out), grouped by what they do, as a Markdown table."""
    a = PRESETS[trace["model"]]
    events = trace["events"]
    n = len(events) // STEPS
    steps = [events[i * n:(i + 1) * n] for i in range(1, STEPS)]
    if len(events) % STEPS or any([e["name"] for e in s] != [e["name"] for e in steps[0]] for s in steps):
        raise SystemExit("error: the trace's steps do not hold the same kernels")
    D, kv = a.dim // a.n_heads, a.n_kv_heads or a.n_heads
    layer = {name: 2 * a.dim * width for name, width in {  # a layer's GEMVs in their order: bf16 weights, dim x width
        "wqkv (RMSNorm fused)": (a.n_heads + 2 * kv) * D, "wo (residual fused)": a.n_heads * D,
        "w1, w3 (RMSNorm, SwiGLU fused)": 2 * a.intermediate_size, "w2 (residual fused)": a.intermediate_size}.items()}
    gemvs = sum(e["name"] == "_gemv_kernel" for e in steps[0])
    if gemvs != 4 * a.n_layers + 1:
        raise SystemExit(f"error: {gemvs} GEMVs a step, not 4 a layer and the head: not a dense batch-1 step")
    rows = collections.defaultdict(lambda: [0, 0.0, 0])  # kernels, µs added, bytes
    for s in steps:
        names = iter([*layer] * a.n_layers + ["output (the head)"])
        for i, e in enumerate(s):
            if e["name"] == "_gemv_kernel":
                what = next(names)
                kind, nbytes = "GEMV " + what, layer.get(what, a.vocab_size * a.dim * 2)
            elif e["name"] == "_attention_kernel":
                kind, nbytes = "decode attention (RoPE, cache write)", 2 * kv * (POSITION + 1) * D * 2
            else:
                kind, nbytes = "other (Inductor: embedding, final norm, argmax)", 0
            r = rows[kind]
            r[0] += 1
            r[1] += e["end"] - (s[i - 1]["end"] if i else e["start"])
            r[2] += nbytes
    k = len(steps)
    lines = [f"{trace['model']}, {trace['gpu']}, torch {trace['torch']}: step {trace['step_ms'] * 1e3:.0f} µs (timed), "
             f"{n} kernels, {sum(r[2] for r in rows.values()) / k / 1e6:.0f} MB to read"
             + (f": {sum(r[2] for r in rows.values()) / k / trace['ceiling'] / 1e3:.0f} µs at the copy ceiling "
                f"({trace['ceiling']:.0f} GB/s)" if trace.get("ceiling") else ""),
             "| kernel | a step | µs added a step | µs each | GB/s |", "|---|---|---|---|---|"]
    for kind, (count, us, nbytes) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {kind} | {count // k} | {us / k:.0f} | {us / count:.1f} | {nbytes / us / 1e3:.0f} |"
                     if nbytes else f"| {kind} | {count // k} | {us / k:.0f} | {us / count:.1f} | |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(m for m, a in PRESETS.items() if not a.n_experts), default="llama-3.2-1b")
    p.add_argument("--trace", type=Path, help="write the trace's kernels here (JSON)")
    p.add_argument("--from-trace", type=Path, help="read them from here instead of running the model")
    a = p.parse_args()
    if a.from_trace:
        try:
            trace = json.loads(a.from_trace.read_text())
            trace["events"], PRESETS[trace["model"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"error: {a.from_trace} is not a trace this script wrote ({type(e).__name__}: {e})")
    elif not torch.cuda.is_available():
        raise SystemExit("error: this needs a CUDA GPU (or --from-trace)")
    else:
        trace = capture(a.model)
        if a.trace:
            a.trace.write_text(json.dumps(trace))
    print(table(trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
