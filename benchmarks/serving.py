"""The serving engine's tables in BENCHMARKS.md (serve.py), on one GPU, random weights of a preset's shape.

    python benchmarks/serving.py --model llama-2-7b --parts pools,padding,steps --json OUT.json

(The engine's throughput is bench.py's: python bench.py --serving 256 --max-batch 64 --modes graphs,manual,eager.)

Parts (each appends records to --json as it goes):
  pools       every bucket 1..64 captured by hand (torch.cuda.CUDAGraph, the eager step): graph memory with one
              pool captured largest first, smallest first, and one pool per bucket; capture time; device memory
              per captured kernel (free memory lost beyond what the allocator's pool holds, per kernel node)
  padding     by hand as well: the step at active counts 5, 12, 40 against the buckets they pad to (8, 16, 64),
              and bucket 64 against bucket 1, every row at 256 cached positions
  steps       multi-step rounds: K = 1, 4, 8 steps a round for buckets 1 and 64: tok/s and host overhead
"""
import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gdkernels  # noqa: E402
from bench import PRESETS, Timed, capture, launches_per_call, random_model  # noqa: E402 (generate.py's, through bench)
from serve import TOP_LOGPROBS, LLM, Request, SamplingParams, default_buckets, serve_step  # noqa: E402

CUDA = torch.device("cuda")


def record(path, **r):
    r.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=str(datetime.date.today()),
             command="python " + " ".join(sys.argv))
    print(json.dumps(r), flush=True)
    if path:
        old = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(old + [r], indent=1))


class Bucket:
    """One bucket's step captured by hand (bench.capture): static views of the largest buffers, recorded into
    `pool`. replay() runs it with every row at position `at` (col reset: out has 64 columns)."""

    def __init__(self, model, b, buffers, pool, at):
        views = [t if t.shape[0] == 1 and t.dim() == 1 else t[:b] for t in buffers]  # (col: [1])
        self.pos, self.col, self.at = views[1], views[4], at
        self.graph = capture(lambda: serve_step(model, *views), self.reset, pool)

    def reset(self):
        self.pos.fill_(self.at)
        self.col.zero_()

    def seconds_per_step(self, reps=40) -> float:
        self.reset()
        self.graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.reset()
        start.record()
        for _ in range(reps):
            self.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps


def buffers(n):
    """serve_step's buffers for n greedy rows (top-k and top-p off, seed 0)."""
    z = lambda *s, dtype=torch.long: torch.zeros(*s, dtype=dtype, device=CUDA)  # noqa: E731
    top_k = torch.full((n,), 1 << 30, device=CUDA)  # (clamped to the vocabulary: off)
    return (z(n, 1), z(n, 1), z(n, 64), z(n, 64, dtype=torch.float), z(1), z(n, dtype=torch.float), top_k,
            torch.full((n,), float("inf"), device=CUDA), z(n), z(n, 64, TOP_LOGPROBS, dtype=torch.float),
            z(n, 64, TOP_LOGPROBS))


def part_pools(model, out):
    kernels = launches_per_call(lambda: serve_step(model, *buffers(1)), CUDA, 2)["kernels_outside_graphs_per_step"]
    buckets = default_buckets(64)
    for b in buckets:  # (each size's kernels and cuBLAS workspaces made before any pool is measured)
        serve_step(model, *buffers(b))
    for how in ("one pool, largest first", "one pool, smallest first", "a pool per bucket"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        bufs = buffers(64)
        free0, reserved0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        graphs = [Bucket(model, b, bufs, torch.cuda.graph_pool_handle() if how.startswith("a pool") else pool, 0)
                  for b in (reversed(buckets) if "largest" in how else buckets)]
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        pool_bytes = torch.cuda.memory_reserved() - reserved0
        lost = free0 - torch.cuda.mem_get_info()[0]
        record(out, part="pools", how=how, buckets=buckets, capture_s=round(seconds, 2), pool_mb=pool_bytes / 2**20,
               device_mb=lost / 2**20, kernels_per_step=kernels,
               kb_per_kernel_node=(lost - pool_bytes) / (kernels * len(buckets)) / 1024)
        del graphs, bufs


def part_padding(model, out):
    bufs = buffers(64)
    pool = torch.cuda.graph_pool_handle()
    graphs = {b: Bucket(model, b, bufs, pool, 256) for b in (64, 40, 16, 12, 8, 5, 1)}
    t = {b: g.seconds_per_step() for b, g in graphs.items()}
    for n, b in ((5, 8), (12, 16), (40, 64)):
        record(out, part="padding", active=n, bucket=b, exact_ms=t[n] * 1e3, padded_ms=t[b] * 1e3,
               tax=t[b] / t[n] - 1)
    record(out, part="padding", what="bucket 64 step / bucket 1 step at 256 cached positions",
           b1_ms=t[1] * 1e3, b64_ms=t[64] * 1e3, ratio=t[64] / t[1])
    from torch.profiler import ProfilerActivity, profile  # where bucket 64's step goes

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs[64].seconds_per_step(reps=5)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), file=sys.stderr)
    del graphs, bufs


def part_steps(llm, out, what):
    """Rounds of K steps on buckets 1 and 64, every row at 256 cached positions."""
    llm.warm_up()
    runner = llm.runner
    gpu = Timed(runner)
    for b in (1, 64):
        if b not in runner.buckets:
            continue
        runner.rows = [Request([1] * 256, SamplingParams(temperature=0), out=[3]) for _ in range(b)]
        runner.decoding = b
        for k in (1, 4, 8):
            runner.steps = k
            rounds = max(4, 64 // k)
            runner.decode()  # (a round before the timed ones)
            torch.cuda.synchronize()
            gpu.events.clear()
            start = time.perf_counter()
            for _ in range(rounds):
                runner.decode()
            wall = time.perf_counter() - start
            step_s = gpu.gpu_s()
            record(out, part="steps", engine=what, dim=llm.model.args.dim, bucket=b, steps_a_round=k,
                   tok_s=b * k * rounds / wall, step_ms=step_s / (k * rounds) * 1e3, host_overhead=wall / step_s)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-2-7b")
    p.add_argument("--parts", default="pools,padding,steps")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.manual_seed(0)
    model = random_model(PRESETS[args.model], CUDA, torch.bfloat16)
    print("kernels:", gdkernels.apply(model), file=sys.stderr)
    model.setup_caches(64, 320)  # (pools, padding: 256 positions and room; the engine grows it)
    for part in args.parts.split(","):
        print(f"== {part} {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
        if part == "steps":
            torch._dynamo.reset()
            part_steps(LLM(model=model, max_batch=64, max_length=320, buckets=[1, 64], steps=8), args.json,
                       "buckets 1 and 64 alone")
        else:
            {"pools": part_pools, "padding": part_padding}[part](model, args.json)


if __name__ == "__main__":
    main()
