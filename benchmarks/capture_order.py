"""Is the int4 g32 step slower in the first CUDA graph a process captures, and why?

Session 26 (BENCHMARKS.md) found the 7B int4 g32 step 707-710 tok/s when it is the first step captured in a
process and 716-720 when the same step was captured before (bench.py --modes manual,graphs or graphs,graphs),
with the same clocks and power in both timings; bf16 does not change. This script tells the kinds of cause
apart in one process, with hand-captured graphs (bench.py's "manual" mode, no compile):

  A        the first capture, timed
  B        a second capture of the same step (its own token/pos buffers and graph pool), A still alive
  A again  the first graph replayed again after B's capture: fast here means the process changed, and A
           with it; slow means B's own graph is what is fast (where its buffers and pool lie)
  C        a third capture after A and B are deleted

Session 27's answers (runs 134-136): A again is as fast as B, so the process changes, not where a graph lies;
only flows with int4_ring.py's kernel and PDL differ; any capture holding that kernel, before A (--before ring1:
one launch of it) or after it (--probes capture), makes A fast; sleep, gc and uncaptured steps do not.
bench.py's manual mode and generate.py's graphs now capture the step once and drop it first
(generate.prime_capture), which this script leaves out unless --prime.

    python benchmarks/capture_order.py [--model llama-2-7b] [--quantize int4-g32] [--repeat 2] [--pad-mb N]
        [--before ring1,step] [--probes sleep,gc,eager,capture] [--trace DIR] [--no-pdl] [--prime] [--json FILE]
"""
import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bench  # noqa: E402
from generate import Generator, decode_one_token  # noqa: E402

PROMPT, NEW = 8, 200


def captured(model) -> Generator:
    """A generator whose step is captured by hand (bench.py's manual mode), after a prompt of PROMPT tokens."""
    return bench.warmed(model, "manual", 1, PROMPT, NEW)


def tok_s(gen, repeat: int) -> list[float]:
    """NEW steps from position PROMPT, timed as bench.bench_one times them, `repeat` times in a row."""
    with torch.no_grad():
        return [NEW / sum(bench.timed_decode(gen, PROMPT, NEW)) for _ in range(repeat)]


def traced(gen, path: str, steps: int = 6) -> None:
    """A Chrome trace of `steps` replays of gen's graph (each kernel's start and end) at path."""
    from torch.profiler import ProfilerActivity, profile

    token, pos, tokens = gen.buffers
    pos.fill_(PROMPT)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            gen._decode_step(token, pos, tokens)
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    summarize(path, steps)


def summarize(path: str, steps: int) -> None:
    """Per kernel name (first 40 characters): launches a step, mean microseconds from start to end; and the
    span from the first kernel's start to the last one's end, with the time no kernel ran, a step."""
    kernels = sorted((e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"),
                     key=lambda e: e["ts"])
    if not kernels:
        print("  (no kernels in the trace)")
        return
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e["name"][:40], []).append(e["dur"])
    idle, end = 0.0, kernels[0]["ts"]
    for e in kernels:
        idle += max(0.0, e["ts"] - end)
        end = max(end, e["ts"] + e["dur"])
    print(f"  {len(kernels) / steps:.0f} kernels a step; span {(end - kernels[0]['ts']) / steps:.1f} us a step, "
          f"{idle / steps:.1f} of it with no kernel running")
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(f"  {name:40s} {len(durs) / steps:5.0f} a step, mean {sum(durs) / len(durs):7.2f} us, "
              f"sum {sum(durs) / steps:7.1f} us a step")


def probe(name: str, gen, model) -> None:
    """One action between two timings of the first graph: does it make that graph fast?"""
    token, pos, tokens = gen.buffers
    if name == "sleep":
        time.sleep(2)
    elif name == "gc":
        gc.collect()
        torch.cuda.empty_cache()
    elif name == "eager":  # three steps uncaptured, on the current stream
        saved = [t.clone() for t in gen.buffers]
        with torch.no_grad():
            for _ in range(3):
                decode_one_token(model, token, pos, tokens, gen.sampling)
        for t, v in zip(gen.buffers, saved):
            t.copy_(v)
    elif name == "capture":  # the step captured once more into a graph that is never replayed, then deleted
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            decode_one_token(model, token, pos, tokens, gen.sampling)
        del graph
    else:
        raise ValueError(f"unknown probe {name!r}")
    torch.cuda.synchronize()


def ring_graph(device, launches: int) -> None:
    """A throwaway CUDA graph of `launches` int4_ring.gemv launches in a row (4096 x 4096, zeros for x), captured
    after one uncaptured launch, then deleted unreplayed."""
    import int4_ring

    K = R = 4096
    args = (torch.zeros(K, dtype=torch.bfloat16, device=device), torch.zeros(K // 2, dtype=torch.int32, device=device),
            torch.zeros(R, K // 8, dtype=torch.int32, device=device),
            torch.zeros(R, K // 32, dtype=torch.int16, device=device), torch.ones(R, 2, device=device), 1.0)
    int4_ring.gemv(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            int4_ring.gemv(*args)
    del graph
    torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-2-7b", choices=sorted(bench.PRESETS))
    p.add_argument("--quantize", default="int4-g32", help="a quantize mode as bench.py names it, or 'none' (bf16)")
    p.add_argument("--repeat", type=int, default=2, help="timed runs of each graph in a row")
    p.add_argument("--pad-mb", type=int, default=0,
                   help="allocate this many MiB (kept alive) before the first capture, to move its buffers")
    p.add_argument("--probes", default="", help="comma-separated actions, each followed by a timing of the first "
                   "graph, before B: sleep, gc, eager, capture")
    p.add_argument("--before", default="",
                   help="comma-separated actions before the first capture: ringN (a throwaway graph of N ring GEMV "
                   "launches), step (a throwaway capture of the whole step)")
    p.add_argument("--trace", help="a folder: Chrome traces of the first graph, first (A.json) and last (A-last.json)")
    p.add_argument("--prime", action="store_true", help="keep bench.py's manual mode's generate.prime_capture (by "
                   "default left out here, so that A is the process's first capture of the step)")
    p.add_argument("--no-pdl", action="store_true", help="launch our kernels without PDL (cuda_kernels.PDL = False)")
    p.add_argument("--json", help="append the results to this file")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("error: capture_order.py times CUDA graphs and needs a CUDA GPU", file=sys.stderr)
        return 1
    if a.repeat < 1:
        print(f"error: --repeat must be at least 1 (got {a.repeat})", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    if not a.prime:
        bench.prime_capture = lambda *args: None
    if a.no_pdl:
        import cuda_kernels
        cuda_kernels.PDL = False
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
        print(f"{name:10s} " + ", ".join(f"{t:.1f}" for t in results[name]) + f" tok/s (token, pos, tokens at {where})",
              flush=True)

    pad = torch.empty(a.pad_mb << 20, dtype=torch.uint8, device=device) if a.pad_mb > 0 else None

    for name in filter(None, a.before.split(",")):
        if name.startswith("ring") and name[4:].isdigit():
            ring_graph(device, int(name[4:]))
        elif name == "step":
            del captured(model).step.graph
        else:
            raise ValueError(f"unknown --before action {name!r}")
        torch.cuda.synchronize()
        print(f"(before: {name})", flush=True)
    first = captured(model)
    report("A", first)
    if a.trace:
        os.makedirs(a.trace, exist_ok=True)
        traced(first, os.path.join(a.trace, "A.json"))
        report("A traced", first)
    for name in filter(None, a.probes.split(",")):
        probe(name, first, model)
        report(f"A {name}", first)
    second = captured(model)
    report("B", second)
    report("A again", first)
    if a.trace:
        traced(first, os.path.join(a.trace, "A-last.json"))
    del first, second
    torch.cuda.empty_cache()
    report("C", captured(model))
    del pad
    if a.json:
        old = json.loads(open(a.json).read()) if os.path.exists(a.json) else []
        record = dict(tok_s_runs=results, model=f"{a.model} {a.quantize}", pad_mb=a.pad_mb, pdl=not a.no_pdl,
                      probes=a.probes, before=a.before, prime=a.prime, gpu=torch.cuda.get_device_name(device),
                      torch=torch.__version__, command="python " + " ".join(sys.argv))
        with open(a.json, "w") as f:
            f.write(json.dumps(old + [record], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
