"""Decode speed on your own hardware: eager vs compiled vs graphed, against the memory bandwidth measured in the run.

    python bench.py                                   # Llama-2-7B shape, all modes, batch 1 and 8
    python bench.py --model llama-3.1-8b --modes graphs --batch-sizes 1 --json out.json
    python bench.py --checkpoint checkpoints/SmolLM2-135M-Instruct --device cpu

Modes:  eager    PyTorch ops launched one by one from Python
        compile  torch.compile's Inductor kernels, still launched one by one (no graphs)
        graphs   torch.compile(mode="reduce-overhead"): CUDAGraph Trees replay the kernels; what generate.py runs
        manual   the eager step captured by hand into one torch.cuda.CUDAGraph and replayed

Random weights of real shapes: decode speed does not depend on weight values. gdkernels.apply is used where the
hardware allows (--no-kernels: the plain model.py). Speculative decoding: benchmarks/speculation.py; the serving
engine: benchmarks/serving.py.
"""
import argparse
import datetime
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import gdkernels
import tp
from common import (DTYPES, Sampling, Step, UsageError, default_device, default_dtype, launches_per_call, no_recompiles,
                    peak_memory, synchronize, weight_bytes_per_step)
from generate import Generator, check_graphs, decode_one_token, prefill
from generate import decode_weight_bytes  # noqa: F401 (benchmarks/speculation.py's: scripts import generate via bench)
from model import ModelArgs, Transformer
from quantize import load, quantize_model

LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
PRESETS = {
    "smollm2-135m": ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152,
                              intermediate_size=1536, rope_theta=1e5, max_seq_len=8192, tie_embeddings=True),
    "llama-3.2-1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                              intermediate_size=8192, rope_theta=5e5, max_seq_len=131072, tie_embeddings=True,
                              rope_scaling={"factor": 32.0, **LLAMA3_ROPE}),
    "llama-2-7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, intermediate_size=11008,
                            max_seq_len=4096),
    "mixtral-8x7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, intermediate_size=14336,
                              rope_theta=1e6, max_seq_len=32768, n_experts=8, n_active_experts=2, expert_size=14336),
    "llama-3.1-8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                              intermediate_size=14336, rope_theta=5e5, max_seq_len=131072,
                              rope_scaling={"factor": 8.0, **LLAMA3_ROPE}),
}
QUANTIZE_CHOICES = ["int8", "int4-g32", "int4-g64", "int4-g128", "int4-g256"]


def random_model(args: ModelArgs, device, dtype) -> Transformer:
    """A model of the preset's shape with random weights, made directly on the device (under torchrun, the rank's share)."""
    n = tp.world()[1]
    with torch.device("meta"):
        model = Transformer(tp.local_args(args, n) if n > 1 else args)
    model = model.to(dtype).to_empty(device=device)  # (cast on the meta device: memory only for the weights)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.02)
    return model.eval().requires_grad_(False)


def call_times(fn, device, calls: int) -> list[float]:
    """Seconds of each of `calls` calls of fn: CUDA events between calls on the GPU (no sync inside the run), the
    host clock around each call on the CPU."""
    if device.type != "cuda":
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return times
    events = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    events[0].record()
    for end in events[1:]:
        fn()
        end.record()
    events[-1].synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in zip(events, events[1:])]


def seconds_per_call(fn, device, reps: int = 20, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    return statistics.fmean(call_times(fn, device, reps))


def copy_bandwidth(device, gib: float = 2.0) -> float:
    """Copy rate in GB/s on the device (bytes read plus written): the ceiling for a step reading every weight once."""
    cuda = device.type == "cuda"
    src = torch.randn(int(gib * 2**30) // (2 if cuda else 32),  # bf16; on the CPU float32, an eighth of the bytes
                      device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    copy = functools.partial(torch.empty_like(src).copy_, src)  # src into a buffer of its size
    seconds = seconds_per_call(copy, device, reps=20 if cuda else 5, warmup=3 if cuda else 1)
    copied = 2 * src.numel() * src.element_size()
    del src, copy
    torch.cuda.empty_cache()  # (a no-op without CUDA)
    return copied / seconds / 1e9


def capture(step, reset, pool=None) -> torch.cuda.CUDAGraph:
    """step() recorded by hand into a torch.cuda.CUDAGraph (in `pool`), after two runs on a side stream that build
    its kernels and lazy state outside the capture; reset() puts its inputs back before each run and the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            reset()
            step()
    torch.cuda.current_stream().wait_stream(side)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), torch.no_grad():
        step()
    return graph


class ManualGraph:
    """decode_one_token captured by hand in one torch.cuda.CUDAGraph, the teaching version of what reduce-overhead
    automates: the step reads and writes only static buffers (token, pos, tokens, the KV cache), so 'copy-in' is
    what prefill writes into them, and each replay runs every kernel of the step with no Python and no launch gaps.
    The first call captures (capture: reset puts the buffers and the CUDA generator back, so the warm-up changes
    neither the tokens nor what a seeded sampler draws); each call replays the graph."""
    graph = None

    def __call__(self, model, token, pos, tokens, s):
        if self.graph is None:
            saved, rng = [t.clone() for t in (token, pos, tokens)], torch.cuda.get_rng_state(token.device)

            def reset():
                for t, v in zip((token, pos, tokens), saved):
                    t.copy_(v)
                torch.cuda.set_rng_state(rng, token.device)
            self.graph = capture(functools.partial(decode_one_token, model, token, pos, tokens, s), reset)
        self.graph.replay()


def make_generator(model, mode: str, sampling: Sampling = Sampling(temperature=0)) -> Generator:
    gen = Generator(model, sampling, "eager" if mode == "manual" else mode)
    if mode == "manual":
        gen.step, gen.mode = Step(ManualGraph(), "manual", gen.device), "manual"
    return gen


def kernel_table(gen: Generator, steps: int = 4, rows: int = 15) -> str:
    """The GPU kernels of `steps` decode steps, costliest first (graph replays included); on the CPU its ops."""
    from torch.profiler import ProfilerActivity, profile

    cuda = gen.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            gen.decode_step()
        synchronize(gen.device)
    return prof.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                     row_limit=rows, max_name_column_width=70)


def warmed(model, mode: str, batch: int, prompt_tokens: int, new_tokens: int,
           sampling: Sampling = Sampling(temperature=0)) -> Generator:
    """A generator of `mode` after a random prompt of prompt_tokens, its step compiled or captured (the first
    calls, timed apart as compile_s), with room for new_tokens more."""
    gen = make_generator(model, mode, sampling)
    token, pos, tokens = gen.reserve(batch, prompt_tokens + new_tokens + 16)
    torch.manual_seed(0)
    prompt = torch.randint(0, model.args.vocab_size, (1, prompt_tokens), device=gen.device).expand(batch, -1)
    with torch.no_grad():
        token[:, 0] = prefill(model, prompt, gen.sampling)
        pos.fill_(prompt_tokens)
        while not gen.warm:
            gen.decode_step()
    return gen


def timed_decode(gen: Generator, prompt_tokens: int, new_tokens: int) -> list[float]:
    """Seconds of each of new_tokens decode steps from position prompt_tokens."""
    gen.pos.fill_(prompt_tokens)
    return call_times(gen.decode_step, gen.device, new_tokens)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


@torch.no_grad()
def bench_one(model, mode, batch, prompt_tokens, new_tokens, ceiling, check=False, show_kernels=False,
              sampling: Sampling = Sampling(temperature=0), repeat: int = 1) -> dict:
    """One configuration's record: new_tokens decode steps after a prompt, timed `repeat` times from the same
    position (the record's numbers are the last run's; tok_s_runs has every run's)."""
    device = model.tok_embeddings.weight.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        reserved_before = torch.cuda.memory_reserved(device)
    gen = warmed(model, mode, batch, prompt_tokens, new_tokens, sampling)
    counts = launches_per_call(gen.decode_step, device, 4) if device.type == "cuda" and mode != "eager" else {}
    if check:
        check_graphs(gen)
    if show_kernels:
        tp.say(f"-- {mode} B={batch}: kernels of 4 decode steps\n{kernel_table(gen)}", file=sys.stderr)
    runs = []
    with no_recompiles(gen.mode):  # (eager and manual trace nothing: no check)
        for _ in range(repeat):
            times = timed_decode(gen, prompt_tokens, new_tokens)
            runs.append(batch * new_tokens / sum(times))
    total, a = sum(times), model.args
    mean_len, itemsize = prompt_tokens + new_tokens / 2, model.tok_embeddings.weight.element_size()
    kv_bytes = 2 * a.n_layers * batch * a.n_kv_heads * mean_len * a.head_dim * itemsize
    gb_s = (weight_bytes_per_step(model, batch) + kv_bytes) * new_tokens / total / 1e9  # bytes a step must read, once
    ms = [t * 1e3 for t in times]
    record = {"mode": mode, "batch_size": batch, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
              "tok_s": batch * new_tokens / total, "tok_s_runs": runs, "step_ms_median": statistics.median(ms),
              "step_ms_p99": percentile(ms, 0.99), "gb_s": gb_s, "ceiling_gb_s": ceiling,
              "pct_of_ceiling": 100 * gb_s / ceiling, "compile_s": gen.compile_s, **counts,
              "peak_mem_gb": peak_memory(device) / 1e9}
    if device.type == "cuda":
        record["warmup_reserved_gb"] = (torch.cuda.memory_reserved(device) - reserved_before) / 1e9
    return record


def quantized(model: Transformer, spec: str) -> Transformer:
    """The model quantized in memory as quantize.py would: spec is one of QUANTIZE_CHOICES."""
    mode, _, group = spec.partition("-g")
    return quantize_model(model, mode, int(group) if group else None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-2-7b", help="preset shape, random weights")
    p.add_argument("--checkpoint", type=Path, help="a checkpoint directory instead of a preset")
    p.add_argument("--modes", help="comma-separated eager,compile,graphs,manual (default all; CPU: eager,compile)")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--repeat", type=int, default=1,
                   help="time the decode this many times from the same position; report the last run, print each")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--check-graphs", action="store_true", help="fail unless decode is one graph replay per token")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, help="weight-only quantization, in memory (quantize.py)")
    p.add_argument("--no-kernels", action="store_true", help="the plain model.py, without the kernels package")
    p.add_argument("--kernels", action="store_true", help="print the costliest GPU kernels (CPU: ops) of 4 steps")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--json", type=Path, help="append each record to this JSON list as it is measured")
    try:
        return run(p.parse_args(argv))
    except UsageError as e:  # bad input: one line, exit status 1
        tp.say(f"error: {e}", file=sys.stderr)
        return 1


def run(a) -> int:
    """Check the flags (UsageError), make or load the model, then measure, print and keep each record."""
    device = default_device(a.device)
    modes, batches = check_flags(a, device)
    model, sampling, ceiling, records, keep = prepare(a, device, modes)
    for mode in modes:
        for batch in batches:
            r = bench_one(model, mode, batch, a.prompt_tokens, a.new_tokens, ceiling,
                          a.check_graphs and mode in ("graphs", "manual"), a.kernels, sampling, a.repeat)
            runs = f"  (runs: {', '.join(f'{t:.1f}' for t in r['tok_s_runs'])} tok/s)" if a.repeat > 1 else ""
            tp.say(f"  {mode:8s} B={batch:<3d} {r['tok_s']:8.1f} tok/s  {r['step_ms_median']:7.2f} ms/step "
                   f"(p99 {r['step_ms_p99']:.2f})  {r['gb_s']:7.0f} GB/s = {r['pct_of_ceiling']:5.1f}%  "
                   f"first call {r['compile_s']:.1f} s{runs}", file=sys.stderr)
            keep(r)
    print_table(records)
    return 0


def prepare(a, device, modes: list[str], positions: int = 0):
    """What a run measures with (also benchmarks/serving.py's): the model (make_model; under torchrun the rank's
    share; UsageError if a row's `positions` pass its context), the sampling, the copy ceiling, the records and keep
    (keep_record with the run's fields); the header printed."""
    dtype = default_dtype(a.dtype, device)
    use_kernels = not a.no_kernels and gdkernels.enabled()
    if tp.world()[1] > 1:  # torchrun --nproc-per-node N bench.py: each rank times its share (tp.py); rank 0 reports
        device = tp.join(PRESETS[a.model], device, seed=0)
    model, name, swapped = make_model(a, device, dtype, use_kernels, "compile" in modes or None)
    if positions > model.args.max_seq_len:
        raise UsageError(f"{positions} positions a row would pass the model's {model.args.max_seq_len}")
    sampling = Sampling(temperature=a.temperature, top_k=None)
    ceiling = copy_bandwidth(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tp.say(f"{name} on {gpu}, {dtype}, torch {torch.__version__}; copy ceiling {ceiling:.0f} GB/s; kernels: "
           + ("; ".join(swapped) or "none" if use_kernels else "off"), file=sys.stderr)
    records = []
    keep = functools.partial(keep_record, records, a.json, device, gpu=gpu, torch=torch.__version__, model=name,
                             dtype=str(dtype).removeprefix("torch."), kernels=use_kernels)
    return model, sampling, ceiling, records, keep


def check_flags(a, device) -> tuple[list[str], list[int]]:
    """The flags' values and combinations (UsageError) -> the modes and batch sizes to measure."""
    allowed = ["eager", "compile", "graphs", "manual"] if device.type == "cuda" else ["eager", "compile"]
    modes = a.modes.split(",") if a.modes else allowed
    if not set(modes) <= set(allowed):
        raise UsageError(f"mode not run on {device.type}: {','.join(modes)}")
    if a.repeat < 1:
        raise UsageError(f"--repeat must be at least 1 (got {a.repeat})")
    if tp.world()[1] > 1 and (a.quantize or a.checkpoint):
        raise UsageError("under torchrun bench.py times a preset's float model")
    return modes, [int(b) for b in a.batch_sizes.split(",")]


def make_model(a, device, dtype, use_kernels: bool, compiled: bool | None):
    """The model (a checkpoint, or the preset's shape with random weights; under torchrun the rank's share), quantized
    and with the kernels as asked (compiled: gdkernels.apply's) -> (model, name, swapped)."""
    n = tp.world()[1]
    torch.manual_seed(0)
    name = a.checkpoint.name if a.checkpoint else a.model + (f" tp{n}" if n > 1 else "")
    model = load(a.checkpoint, device, dtype) if a.checkpoint else random_model(PRESETS[a.model], device, dtype)
    if a.quantize:
        model, name = quantized(model, a.quantize), f"{name} {a.quantize}"
    swapped = gdkernels.apply(model, fuse=n == 1, compiled=compiled) if use_kernels else []
    if n > 1:  # (after the kernels: the all-reduce wraps whichever wo and w2 run)
        tp.reduce_outputs(model)
    return model, name, swapped


def keep_record(records: list, path: Path | None, device, r: dict, **fields) -> None:
    """r with the run's fields, kept and (rank 0) added to path's JSON list at once; then on CUDA a fresh compile."""
    r.update(fields, date=datetime.date.today().isoformat(), command="python " + " ".join(sys.argv))
    records.append(r)
    if path and tp.world()[0] == 0:
        old = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(old + [r], indent=1) + "\n")
    if device.type == "cuda":
        torch._dynamo.reset()


def print_table(records):
    cols = ["model", "mode", "batch_size", "tok_s", "step_ms_median", "step_ms_p99", "gb_s", "pct_of_ceiling",
            "compile_s", "peak_mem_gb", "graph_launches_per_step", "kernels_outside_graphs_per_step"]
    tp.say("| " + " | ".join(cols) + " |")
    tp.say("|" + "---|" * len(cols))
    for r in records:
        cells = [f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
        tp.say("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
