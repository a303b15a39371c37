"""The serving engine's tables in BENCHMARKS.md (serve.py): its throughput on random requests (random weights of a
preset's shape, or a checkpoint), and on one GPU its buckets captured by hand.

    python benchmarks/serving.py --model llama-2-7b --requests 256 --max-batch 64 --modes graphs --prefill-budget 2048
    python benchmarks/serving.py --device cpu --checkpoint DIR --requests 16 --max-batch 16 --length 128 --alone 16
    python benchmarks/serving.py --model llama-2-7b --parts pools,padding,steps --json OUT.json

Throughput: --requests random requests arriving at once, continuous batching up to --max-batch rows, once per
prefill budget on the same warm engine (bench_serving says what each record holds); bench.py's flags --model,
--checkpoint, --device, --dtype, --quantize, --no-kernels, --temperature and --json mean what they mean there.

Parts (CUDA, instead of the throughput; each appends records to --json as it goes):
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
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gdkernels  # noqa: E402
import tp  # noqa: E402
from bench import (PRESETS, QUANTIZE_CHOICES, call_times, capture, percentile, prepare, print_table,  # noqa: E402
                   random_model, seconds_per_call, timed_decode, warmed)
from common import (DTYPES, Sampling, UsageError, default_device, launches_per_call, peak_memory,  # noqa: E402
                    weight_bytes_per_step)
from serve import TOP_LOGPROBS, LLM, Request, Runner, SamplingParams, default_buckets, serve_step  # noqa: E402

CUDA = torch.device("cuda")


def record(path, **r):
    r.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=str(datetime.date.today()),
             command="python " + " ".join(sys.argv))
    print(json.dumps(r), flush=True)
    if path:
        old = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(old + [r], indent=1))


def workload(n: int, vocab: int, longest: int = 512, sampling: Sampling = Sampling(temperature=0),
             seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """n requests of random tokens, their prompt and output lengths uniform in 16..longest (seeded), no stop."""
    rng, shortest = random.Random(seed), min(16, longest)
    return [([rng.randrange(vocab) for _ in range(rng.randint(shortest, longest))],
             SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, max_new_tokens=rng.randint(
                 shortest, longest), ignore_eos=True)) for _ in range(n)]


class Timed:
    """A runner's prefills, row moves and decode steps timed by CUDA events (their GPU time, not the gaps
    between); per round its decoding rows, padding rows and the KV positions its K steps read; prefills counted."""

    def __init__(self, runner: Runner):
        self.events, self.rounds, self.prefills = [], [], 0
        for name in ("prefill", "move"):
            setattr(runner, name, self.wrap(name, getattr(runner, name)))
        runner.step.fn = self.wrap("step", runner.step.fn)  # (the Step stays: its warm-up state with it)
        decode, K = runner.decode, runner.steps

        def counted():
            rows = runner.rows[:runner.decoding]
            self.rounds.append((len(rows), runner.bucket(len(rows)) - len(rows),
                                sum(K * (r.pos + 1) + K * (K - 1) // 2 for r in rows)))
            return decode()
        runner.decode = counted

    def wrap(self, name, fn):
        def timed(*a, **kw):
            self.prefills += name == "prefill"
            if not torch.cuda.is_available():
                return fn(*a, **kw)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            r = fn(*a, **kw)
            e.record()
            self.events.append((name, s, e))
            return r
        return timed

    def gpu_s(self, name: str | None = None) -> float:  # (of the calls of `name`; None: of all)
        torch.cuda.synchronize()
        return sum(s.elapsed_time(e) for n, s, e in self.events if name in (None, n)) / 1e3


def bench_serving(model, mode: str, requests: int, max_batch: int, steps: int, longest: int, sampling: Sampling,
                  ceiling: float, budgets: list[int], alone: int = 0) -> list[dict]:
    """The serving engine (serve.py) on `requests` random requests arriving at once (workload), continuous
    batching up to max_batch rows over its default buckets, once per prefill budget on the same warm engine:
    output tok/s; its share of the bandwidth bound (weights once a step and each decoding row's KV up to its
    position, at the copy ceiling); inter-token latency of the decoding rows (a round's wall time over K, for
    each row it decoded) against the median step of rounds without a prefill; time to first token from
    arrival; warm-up. Then the engine's bucket-1 step against Generator's (at position 256 or longest), and the first
    `alone` requests one by one through Generator (generate.py's path), all in the same process."""
    device = model.tok_embeddings.weight.device
    start = time.perf_counter()
    llm = LLM(model=model, max_batch=max_batch, max_length=2 * longest, steps=steps, compile=mode != "eager")
    llm.warm_up()
    warmup_s, runner, a = time.perf_counter() - start, llm.runner, model.args
    timed = Timed(runner)
    kv_per_pos = 2 * a.n_layers * a.n_kv_heads * a.head_dim * model.tok_embeddings.weight.element_size()
    records, work = [], workload(requests, a.vocab_size, longest, sampling)
    for budget in budgets:
        llm.scheduler.budget = budget
        reqs = [llm.make_request(p, params) for p, params in work]
        timed.events.clear(), timed.rounds.clear()
        prefills_before = timed.prefills
        torch.manual_seed(0)
        itl, quiet, first, t0 = [], [], {}, time.perf_counter()
        for r in reqs:
            llm.scheduler.waiting.append(r)
        while llm.scheduler.live():
            t, n, prefills = time.perf_counter(), len(timed.rounds), timed.prefills
            events = llm.step()
            now = time.perf_counter()
            if len(timed.rounds) > n:  # (a round that decoded)
                itl += [(now - t) / steps] * timed.rounds[-1][0]
                if timed.prefills == prefills:
                    quiet.append((now - t) / steps)
            first.update((r, now - t0) for r, new, _ in events if new and r not in first)
        seconds, tokens = time.perf_counter() - t0, sum(len(r.out) for r in reqs)
        read = sum(steps * weight_bytes_per_step(model, n + pad) + kv_per_pos * kv for n, pad, kv in timed.rounds)
        bound = tokens / (read / (ceiling * 1e9))
        rows, padding = (sum(x[i] for x in timed.rounds) for i in (0, 1))
        ttft = list(first.values())
        records.append({"mode": f"serve-{mode}", "batch_size": max_batch, "requests": requests, "longest": longest,
                        "decode_steps": steps, "prefill_budget": budget, "tok_s": tokens / seconds, "seconds": seconds,
                        "tokens": tokens, "bound_tok_s": bound, "share_of_bound": tokens / seconds / bound,
                        "itl_ms_p50": 1e3 * percentile(itl, 0.5), "itl_ms_p99": 1e3 * percentile(itl, 0.99),
                        "step_ms_median": 1e3 * percentile(quiet, 0.5), "ttft_s_p50": percentile(ttft, 0.5),
                        "ttft_s_p99": percentile(ttft, 0.99), "padded_row_share": padding / (rows + padding),
                        "compile_s": warmup_s, "ceiling_gb_s": ceiling, "peak_mem_gb": peak_memory(device) / 1e9,
                        "rounds": len(timed.rounds), "prefills": timed.prefills - prefills_before})
        if device.type == "cuda":
            records[-1].update(host_overhead=seconds / timed.gpu_s(),
                               **{f"{n}_gpu_share": timed.gpu_s(n) / timed.gpu_s() for n in ("prefill", "move", "step")})

    at = min(256, longest)
    n = max(1, min(64, 2 * longest - at - 16))  # (Generator's steps: room in the cache)

    def round_of(plain):  # a round of bucket 1 at position `at` (plain: a lone greedy row's step, as decode() picks)
        runner.write([], 1)
        runner.pos[:1].fill_(at)
        return call_times(lambda: runner.step(model, *runner.views[1], plain, key=(1, plain)), device, steps)

    def bucket1(plain):  # ms: the median step (CUDA events between steps, as Generator's); a round's time over K
        median = statistics.median([t for _ in range(10) for t in round_of(plain)])
        return 1e3 * median, 1e3 * seconds_per_call(lambda: round_of(plain), device, 10) / steps
    (engine_step, engine_round), (full_step, _) = bucket1(runner.plain == 1 and not sampling.temperature), \
        bucket1(False)
    gen = warmed(model, mode, 1, at, n, sampling)
    gen_step = statistics.median(timed_decode(gen, at, n))
    extra = {"bucket1_step_ms": engine_step, "bucket1_round_ms_per_step": engine_round,
             "generator_step_ms": gen_step * 1e3, "bucket1_full_step_ms": full_step}
    if alone:
        gen.reserve(1, 2 * longest)
        t0 = time.perf_counter()
        tokens = sum(len(c[0]) for p, params in work[:alone] for c in gen.generate([p], params.max_new_tokens))
        extra.update(alone=alone, alone_tok_s=tokens / (time.perf_counter() - t0))
    for r in records:
        r.update(extra)
    return records


def measure_serving(a, model, modes, budgets, sampling, ceiling, keep) -> None:
    for mode in modes:
        for r in bench_serving(model, mode, a.requests, a.max_batch, a.stop_check_interval, a.length, sampling,
                               ceiling, budgets, a.alone):
            alone = f", {r['tok_s'] / r['alone_tok_s']:.1f}x one by one ({r['alone_tok_s']:.1f})" if "alone" in r else ""
            tp.say(f"  serve-{mode} {a.requests} requests, {a.max_batch} rows, prefill budget {r['prefill_budget']}: "
                   f"{r['tok_s']:8.1f} tok/s = {r['share_of_bound']:.0%} of {r['bound_tok_s']:.0f}{alone}; inter-token "
                   f"p50/p99 {r['itl_ms_p50']:.2f}/{r['itl_ms_p99']:.2f} ms (step {r['step_ms_median']:.2f}); first "
                   f"token p50/p99 {r['ttft_s_p50']:.2f}/{r['ttft_s_p99']:.2f} s; padding {r['padded_row_share']:.1%}; "
                   + (f"GPU time in prefill {r['prefill_gpu_share']:.0%}; " if "prefill_gpu_share" in r else "") +
                   f"bucket-1 step {r['bucket1_step_ms']:.2f} ms (full {r['bucket1_full_step_ms']:.2f}; a round over K "
                   f"{r['bucket1_round_ms_per_step']:.2f}), "
                   f"Generator's {r['generator_step_ms']:.2f}; "
                   f"warm-up {r['compile_s']:.1f} s", file=sys.stderr)
            keep(r)


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-2-7b", help="preset shape, random weights")
    p.add_argument("--checkpoint", type=Path, help="a checkpoint directory instead of a preset")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, help="weight-only quantization, in memory (quantize.py)")
    p.add_argument("--no-kernels", action="store_true", help="the plain model.py, without the kernels package")
    p.add_argument("--modes", help="comma-separated: eager,graphs on CUDA, eager,compile on the CPU (default both)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--requests", type=int, default=256, help="random requests, arriving at once")
    p.add_argument("--max-batch", type=int, default=64, help="the engine's rows (largest bucket)")
    p.add_argument("--stop-check-interval", type=int, default=8, metavar="K", help="decode steps a round")
    p.add_argument("--length", type=int, default=512, help="prompt and output lengths uniform in 16..N tokens")
    p.add_argument("--prefill-budget", default="1024", help="comma-separated token budgets of a prefill")
    p.add_argument("--alone", type=int, default=16,
                   help="then the first N requests one by one through generate.py's Generator (0: none)")
    p.add_argument("--parts", help="instead, on CUDA: comma-separated pools,padding,steps")
    p.add_argument("--json", type=Path, help="append each record to this JSON list as it is measured")
    try:
        a = p.parse_args(argv)
        return run_parts(a) if a.parts else run(a)
    except UsageError as e:  # bad input: one line, exit status 1
        tp.say(f"error: {e}", file=sys.stderr)
        return 1


def run(a) -> int:
    device = default_device(a.device)
    allowed = ["eager", "graphs"] if device.type == "cuda" else ["eager", "compile"]  # (buckets graphed or eager)
    modes = a.modes.split(",") if a.modes else allowed
    if not set(modes) <= set(allowed):
        raise UsageError(f"mode not run by the engine on {device.type}: {','.join(modes)}")
    budgets = [int(b) for b in a.prefill_budget.split(",") if b.strip().isdigit()]
    if min(a.requests, a.max_batch, a.stop_check_interval, a.length, *budgets or [0]) < 1 or a.alone < 0:
        raise UsageError("--requests, --max-batch, --stop-check-interval, --length and --prefill-budget must be >= 1")
    model, sampling, ceiling, records, keep = prepare(a, device, modes, positions=2 * a.length)  # (prompt, output)
    measure_serving(a, model, modes, budgets, sampling, ceiling, keep)
    print_table(records)
    return 0


def run_parts(a) -> int:
    torch.manual_seed(0)
    model = random_model(PRESETS[a.model], CUDA, torch.bfloat16)
    print("kernels:", gdkernels.apply(model), file=sys.stderr)
    model.setup_caches(64, 320)  # (pools, padding: 256 positions and room; the engine grows it)
    for part in a.parts.split(","):
        print(f"== {part} {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
        if part == "steps":
            torch._dynamo.reset()
            part_steps(LLM(model=model, max_batch=64, max_length=320, buckets=[1, 64], steps=8), a.json,
                       "buckets 1 and 64 alone")
        else:
            {"pools": part_pools, "padding": part_padding}[part](model, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
