"""Speculative decoding's table in BENCHMARKS.md (speculative.py), per mode in one process: plain decode at batch 1,
then a record "speculative-MODE": tok/s, the acceptance histogram (with random weights, a property of that set-up),
tokens per round, and the draft loop (K draft steps, one graph in mode graphs) against K single draft steps.

    python benchmarks/speculation.py --model llama-2-7b --speculate-k 4 --draft-quantize int4-g32 --temperature 1
    python benchmarks/speculation.py --device cpu --checkpoint DIR --draft-checkpoint DRAFT --speculate-k 4

The draft: --draft-quantize MODE, the target's own quantized copy (random weights: the usual set-up), or a checkpoint.
"""
import argparse
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (run from anywhere)
import gdkernels  # noqa: E402
from bench import (PRESETS, QUANTIZE_CHOICES, bench_one, copy_bandwidth, decode_weight_bytes, keep_record,  # noqa: E402
                   print_table, quantized, random_model, seconds_per_call, warmed)
from common import (DTYPES, Sampling, UsageError, default_device, default_dtype, launches_per_call,  # noqa: E402
                    peak_memory, synchronize)
from quantize import load  # noqa: E402
from speculative import SpeculativeGenerator  # noqa: E402


@torch.no_grad()
def bench_speculative(target, draft, k: int, mode: str, prompt_tokens: int, new_tokens: int,
                      sampling: Sampling, ceiling: float = 0.0) -> dict:
    """Speculative decode of new_tokens after a random prompt (batch 1), timed from the first
    round (prefill apart, as bench.bench_one does), and the draft loop against K single draft steps."""
    device = target.tok_embeddings.weight.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    gen = SpeculativeGenerator(target, draft, sampling, k, mode)
    torch.manual_seed(0)
    prompt = torch.randint(0, target.args.vocab_size, (prompt_tokens,)).tolist()
    # Caches sized once for all below (the timed run, 24 single draft steps): no recompile for a longer cache.
    gen.reserve(prompt_tokens + max(new_tokens, 4 * (k + 1), 24) + k + 1 + 8)
    start = time.perf_counter()
    list(gen.generate(prompt, 4 * (k + 1)))  # compile and record both functions
    compile_s = time.perf_counter() - start
    torch.manual_seed(1)
    chunks = gen.generate(prompt, new_tokens)
    next(chunks)  # prefill's token
    synchronize(device)
    start = time.perf_counter()
    n = sum(len(c) for c in chunks)
    synchronize(device)
    decode_s = time.perf_counter() - start
    gb_s = decode_weight_bytes(gen) / decode_s / 1e9  # (a round: the target once, the draft K + 1 times)
    record = {"mode": f"speculative-{mode}", "batch_size": 1, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
              "speculate_k": k, "temperature": sampling.temperature, "tok_s": n / decode_s, "rounds": gen.rounds,
              "acceptance_histogram": gen.histogram, "mean_tokens_per_round": gen.mean_tokens_per_round,
              "compile_s": compile_s, "gb_s": gb_s, "ceiling_gb_s": ceiling, "peak_mem_gb": peak_memory(device) / 1e9}
    # Both timed from just after the prompt: the last round may have run up to the end of the cache.
    gen.pos.fill_(prompt_tokens + 1)
    loop_s = seconds_per_call(gen.draft_loop, device)
    single = warmed(draft, mode, 1, prompt_tokens, 0, sampling)  # (reserve keeps the draft's longer cache)
    step_s = seconds_per_call(single.decode_step, device)  # (<= 24 steps: they fit)
    record.update(draft_loop_ms=loop_s * 1e3, draft_step_ms=step_s * 1e3, draft_loop_vs_k_steps=loop_s / (k * step_s))
    if device.type == "cuda":
        counts = launches_per_call(gen.draft_loop, device, 4)
        record.update(draft_loop_graph_launches=counts["graph_launches_per_step"],
                      draft_loop_kernels_outside_graphs=counts["kernels_outside_graphs_per_step"])
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speculate-k", type=int, metavar="K", help="draft tokens a round (>= 1)")
    p.add_argument("--draft-quantize", choices=QUANTIZE_CHOICES, help="the draft is the target quantized this way")
    p.add_argument("--draft-checkpoint", type=Path, help="a draft checkpoint directory instead")
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-2-7b", help="preset shape, random weights")
    p.add_argument("--checkpoint", type=Path, help="a checkpoint directory instead of a preset")
    p.add_argument("--modes", help="comma-separated eager,compile,graphs (default: graphs; CPU: eager)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--no-kernels", action="store_true", help="the plain model.py, without the kernels package")
    p.add_argument("--json", type=Path, help="append each record to this JSON list as it is measured")
    try:
        return run(p.parse_args(argv))
    except UsageError as e:  # bad input: one line, exit status 1
        print(f"error: {e}", file=sys.stderr)
        return 1


def run(a) -> int:
    if a.speculate_k is None or a.speculate_k < 1 or bool(a.draft_quantize) == bool(a.draft_checkpoint):
        raise UsageError("--speculate-k K (>= 1) goes with one of --draft-quantize, --draft-checkpoint")
    device = default_device(a.device)
    dtype = default_dtype(a.dtype, device)
    allowed = ["eager", "compile", "graphs"] if device.type == "cuda" else ["eager", "compile"]
    modes = a.modes.split(",") if a.modes else ["graphs" if device.type == "cuda" else "eager"]
    if not set(modes) <= set(allowed):
        raise UsageError(f"mode not run on {device.type}: {','.join(modes)}")
    torch.manual_seed(0)
    model = load(a.checkpoint, device, dtype) if a.checkpoint else random_model(PRESETS[a.model], device, dtype)
    # (the draft first: the kernels may keep the target's weights in a layout of their own)
    draft = quantized(model, a.draft_quantize) if a.draft_quantize else load(a.draft_checkpoint, device, dtype)
    if draft.args.vocab_size != model.args.vocab_size:
        raise UsageError(f"the draft's vocabulary ({draft.args.vocab_size}) differs from the target's "
                         f"({model.args.vocab_size})")
    kernels = not a.no_kernels and gdkernels.enabled()
    for m in (model, draft) if kernels else ():
        gdkernels.apply(m, compiled="compile" in modes or None)
    sampling, ceiling = Sampling(temperature=a.temperature, top_k=None), copy_bandwidth(device)
    records, gpu = [], torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    keep = functools.partial(keep_record, records, a.json, device, gpu=gpu, torch=torch.__version__,
                             model=a.checkpoint.name if a.checkpoint else a.model,
                             dtype=str(dtype).removeprefix("torch."), kernels=kernels)
    for mode in modes:
        r = bench_one(model, mode, 1, a.prompt_tokens, a.new_tokens, ceiling, sampling=sampling)
        print(f"  {mode:8s} {r['tok_s']:8.1f} tok/s  {r['step_ms_median']:7.2f} ms/step", file=sys.stderr)
        keep(r)
        r = bench_speculative(model, draft, a.speculate_k, mode, a.prompt_tokens, a.new_tokens, sampling, ceiling)
        r["draft"] = a.draft_quantize or a.draft_checkpoint.name
        print(f"  speculative-{mode} K={a.speculate_k} {r['tok_s']:8.1f} tok/s  "
              f"{r['mean_tokens_per_round']:.2f} tokens/round  accepted {r['acceptance_histogram']}  "
              f"draft loop {r['draft_loop_ms']:.2f} ms = {r['draft_loop_vs_k_steps']:.2f}x K draft steps "
              f"({r['draft_step_ms']:.2f} ms each)", file=sys.stderr)
        keep(r)
    print_table(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
