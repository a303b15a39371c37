"""Generate text with a Llama-family model: prefill, then decode one token per step through a
compiled step that never waits for the host (on CUDA: one CUDA graph replay a token).

    python generate.py --prompt "Tell me about CUDA graphs" [--checkpoint DIR] [--chat]

The decode path, in reading order (sampling: common.py):
  prefill()                  the prompt in one forward (dynamic shape: eager or compiled dynamic)
  decode_one_token()         one step on static buffers: the unit that is compiled and graphed
  Generator.generate()       the host loop: runs steps, reads tokens back every K steps, stops
  check_graphs()             --check-graphs: one graph replay per step, counted by the profiler (common.py)
gdkernels.apply() swaps in the fast kernels after loading (--no-kernels: the plain model).
"""
import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

import gdkernels
import serve
import tp
from common import (DTYPES, GraphCheckError, Sampling, Step, UsageError, cache_length, check_memory,
                    decode_mode, default_device, default_dtype, no_recompiles, peak_memory, prefill_attention, sample,
                    synchronize, weight_bytes_per_step)
from common import check_graphs as common_check_graphs
from gdkernels import aot
from model import Transformer, read_config
from quantize import load, prepare_default
from speculative import SpeculativeGenerator, load_draft
from tokenizer import load_tokenizer


# -- the two phases ------------------------------------------------------------------------------

def prefill(model: Transformer, idx: torch.Tensor, s: Sampling) -> torch.Tensor:
    """idx [B, S] prompt -> first generated token [B]. Shapes vary with the prompt, so this runs
    eagerly or compiled with dynamic=True, never as one graph per length."""
    input_pos = torch.arange(idx.shape[1], device=idx.device)
    logits = model(idx, input_pos)
    return sample(logits[:, -1], s)


def decode_one_token(model: Transformer, token: torch.Tensor, pos: torch.Tensor,
                     tokens: torch.Tensor, s: Sampling) -> None:
    """One decode step, entirely on the device and in place on static buffers:
    token [B, 1] the last token, pos [1] its position, tokens [B, L] the sequence so far.
    Writes the next token into `token` and `tokens[:, pos + 1]` and advances `pos`. Returns
    nothing, so no graph output needs cloning; the host reads `tokens` every K steps."""
    logits = model(token, pos)  # [B, 1, V]
    nxt = sample(logits[:, -1], s).unsqueeze(-1)  # [B, 1]
    pos.add_(1)
    token.copy_(nxt)
    tokens.index_copy_(1, pos, nxt)


class Generator:
    """Holds the model, its static decode buffers (token, pos, tokens: decode_one_token's, made by reserve) and the
    compiled step (common.Step: compiled or recorded, warmed up, timed apart), which decode_step runs once."""

    def __init__(self, model: Transformer, sampling: Sampling, mode: str = "eager",
                 compile_prefill: bool = False, stop_check_interval: int = 8):
        self.model, self.sampling, self.mode = model, sampling, mode
        self.device = model.tok_embeddings.weight.device
        self.stop_check_interval = stop_check_interval
        self.decode_steps = 0  # decode steps the last generate ran (up to K - 1 past a stop: GB/s counts them)
        if mode.startswith("aot") and self.device.type != "cpu":  # the CPU: gdkernels/aot.py
            raise ValueError(f"mode {mode!r} is for the CPU")
        self.step = self.make_step()
        self.prefill = torch.compile(prefill, dynamic=True) if compile_prefill else prefill
        self.tokens = None  # (reserve)

    def make_step(self) -> Step:  # (aot-cached: the ahead-of-time step only if built before)
        fn = aot.AotStep(decode_one_token, build=self.mode == "aot") if self.mode.startswith("aot") else decode_one_token
        return Step(fn, self.mode, self.device)

    warm = property(lambda self: self.step.warm())  # (its step compiled or recorded)
    compile_s = property(lambda self: self.step.compile_s)

    def reserve(self, batch: int, length: int):
        """Static buffers for `batch` rows, allocated once per batch size at the longest length
        the cache holds. Their addresses never change, which is what lets a captured graph read
        and write them on every replay. (The KV cache may hold more rows than `batch`.)"""
        self.model.setup_caches(batch, length)
        L = self.model.max_seq_length
        if self.tokens is None or self.tokens.shape != (batch, L):
            new = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=self.device)  # noqa: E731
            if self.mode.startswith("aot"):  # new shapes: a step built for them (or loaded) at the next call
                self.step = self.make_step()
            self.token, self.pos, self.tokens = self.step.static(new(batch, 1), new(1), new(batch, L))
            self.step.reset()  # new buffers: compiled steps warm up again
        return self.token, self.pos, self.tokens

    @torch.no_grad()
    def generate(self, prompt: list[list[int]], max_new_tokens: int, stop_ids: set[int] = frozenset()):
        """Yield lists of new tokens per row, as they are read back from the device (every
        stop_check_interval steps). Output equals a per-token stop check: tokens after a row's
        stop token are dropped, and generation ends when every row has stopped."""
        B, S = len(prompt), len(prompt[0])
        token, pos, tokens = self.reserve(B, S + max_new_tokens)
        idx = torch.tensor(prompt, dtype=torch.long, device=self.device)
        with prefill_attention():
            first = self.prefill(self.model, idx, self.sampling)  # [B]
        token[:, 0] = first
        tokens[:, S] = first
        pos.fill_(S)
        stopped = [False] * B
        self.decode_steps = 0
        done = S  # tokens[:, S:done] are the new tokens the host has already seen
        steps = max_new_tokens - 1  # decode steps; the first token came from prefill
        i = 0
        while True:
            new = tokens[:, done:S + 1 + i].tolist()  # the one host sync every K steps
            done = S + 1 + i
            out = []
            for b, row in enumerate(new):
                if stopped[b]:
                    row = []
                for j, t in enumerate(row):
                    if t in stop_ids:
                        row, stopped[b] = row[: j + 1], True
                        break
                out.append(row)
            yield out
            if all(stopped) or i >= steps:
                return
            for _ in range(min(self.stop_check_interval, steps - i)):
                self.decode_step()
                i += 1
            self.decode_steps = i

    def decode_step(self) -> None:
        """decode_one_token on the static buffers (its first calls compile: timed apart)."""
        self.step(self.model, self.token, self.pos, self.tokens, self.sampling)


# -- graph verification (--check-graphs: common.check_graphs) -------------------------------------

def check_graphs(gen, start: int | None = None, steps: int = 8) -> dict:
    """Profile `steps` decode steps from position `start` (None: where the buffers are), warmed up first if need be;
    GraphCheckError unless each is one graph replay, no kernel outside but the RNG's. Speculative: its own check."""
    if not isinstance(gen, Generator):
        return gen.check_graphs(start)
    start = int(gen.pos) if start is None else start
    gen.pos.fill_(start)
    while not gen.warm:
        gen.decode_step()
    gen.pos.fill_(start)
    return common_check_graphs(gen.decode_step, gen.device, steps, "decode", random=gen.sampling.temperature > 0)


# -- the command line ---------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Generate text with a Llama-family model. Without --checkpoint: SmolLM2-135M-"
                                "Instruct, prepared in ~/.cache/graphdecode ($GRAPHDECODE_CACHE); int4 g32 on the CPU.")
    p.add_argument("--checkpoint", type=Path, help="checkpoint directory (default: the default model)")
    p.add_argument("--prompt", default="Hello, my name is", help="prompt text (default: %(default)r)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature, 0 is greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=200, help="sample among the K likeliest tokens (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample within the smallest set of tokens whose probability reaches P (default: off)")
    p.add_argument("--seed", type=int, default=None, help="seed the sampler: the same seed, the same text (default: random)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--interactive", action="store_true", help="multi-turn chat on stdin until EOF")
    p.add_argument("--num-samples", type=int, default=1, help="generate this many texts from the prompt (default: %(default)s)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="(default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="activation and float weight dtype (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="compile decode (CUDA: CUDA graphs, the default there; the CPU: ahead of time, "
                        "built once and cached, then used by default; with --no-kernels torch.compile)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="decode eagerly, op by op")
    p.add_argument("--no-kernels", action="store_true",
                   help="run the plain model.py, without the kernels package (also GRAPHDECODE_KERNELS=0)")
    p.add_argument("--compile-prefill", action="store_true", help="compile prefill with dynamic shapes")
    p.add_argument("--stop-check-interval", type=int, default=8, metavar="K",
                   help="read tokens back and check stop tokens every K decode steps; with --prompts-file the "
                        "engine's round (default: %(default)s)")
    p.add_argument("--profile", type=Path, help="write a torch.profiler trace of a few decode steps")
    p.add_argument("--check-graphs", action="store_true",
                   help="after generating, verify that decode is one CUDA graph replay per token (exit 1 if not)")
    p.add_argument("--draft-checkpoint", type=Path, help="draft model for speculative decoding")
    p.add_argument("--speculate-k", type=int, default=None, help="draft tokens proposed a round (with --draft-checkpoint)")
    p.add_argument("--prompt-lookup", type=int, metavar="K", help="speculate without a draft: propose the K tokens "
                   "that followed the latest earlier occurrence of the last n tokens (pays where output copies input)")
    p.add_argument("--ngram", type=int, default=3, metavar="N", help="--prompt-lookup: match n = N..1 tokens (default 3)")
    g = p.add_argument_group("many prompts at once (serve.py: continuous batching over graph buckets)")
    g.add_argument("--prompts-file", type=Path, help="one prompt a line, or JSONL {\"prompt\", \"max_new_tokens\"}")
    g.add_argument("--output", type=Path, help="write the JSONL results here (default: stdout)")
    g.add_argument("--max-batch", type=int, default=16, help="KV-cache rows: requests decoded at once (default: %(default)s)")
    g.add_argument("--buckets", help="comma-separated graph batch sizes (default 1, 2, 4, ... --max-batch)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (UsageError, FileNotFoundError, ValueError, GraphCheckError) as e:
        log(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


INTERACTIVE_CACHE = 512  # --interactive starts with this many positions and doubles them when a turn needs more
CHECK_GRAPHS_ROOM = 12  # --check-graphs decodes 8 steps after the prompt, and up to 3 before them to warm up


def run(args) -> None:
    """The CLI in named steps: check the flags, choose where and how decode runs, load, then generate."""
    sampling = check_flags(args)
    device = default_device(args.device)
    dtype = default_dtype(args.dtype, device)
    use_kernels = not args.no_kernels and gdkernels.enabled()
    mode = decode_mode(device, args.compile, aot=use_kernels and not args.speculate_k)  # (CPU: gdkernels/aot.py)
    if args.check_graphs and mode != "graphs":
        raise UsageError("--check-graphs needs graphed decode (CUDA, without --no-compile)")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    checkpoint = args.checkpoint or prepare_default(device)  # (the CPU: its int4 form, README)
    if args.prompts_file:
        params = serve.SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, args.max_new_tokens,
                                      ignore_eos=args.ignore_eos)
        return serve.run_file(checkpoint, args.prompts_file, args.output, params, args.chat, args.max_batch,
                              parse_buckets(args.buckets), args.stop_check_interval, device, dtype, use_kernels,
                              args.compile)
    config, n = read_config(checkpoint)["args"], tp.world()[1]  # torchrun: this process's share (tp.py)
    if n > 1:
        device = tp.join(config, device, args.seed)
    tokenizer, context = load_tokenizer(checkpoint), config.max_seq_len
    gen, prompt, kernels = load_generator(args, checkpoint, tokenizer, context, sampling, device, dtype, mode,
                                          use_kernels)
    stop_ids = set() if args.ignore_eos else set(tokenizer.eos_ids)
    if args.interactive:
        return chat(args, gen, tokenizer, stop_ids, kernels, context)
    one_shot(args, gen, tokenizer, prompt, stop_ids, kernels)


def check_flags(args) -> Sampling:
    """The flags' values and combinations -> the sampling setting (errors name the flag)."""
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    try:
        sampling.check()
    except UsageError as e:  # (the library names its fields: temperature, top_k, top_p)
        raise UsageError("--" + str(e).replace("_", "-", 1)) from None
    for flag in "max_new_tokens num_samples stop_check_interval speculate_k prompt_lookup ngram max_batch".split():
        if (value := getattr(args, flag)) is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1 (got {value})")
    n = tp.world()[1]  # (under torchrun every rank preparing the default model at once would race)
    for wrong, message in [
            (bool(args.draft_checkpoint) != bool(args.speculate_k), "--draft-checkpoint and --speculate-k go together"),
            (args.prompt_lookup and args.draft_checkpoint, "--prompt-lookup goes without --draft-checkpoint"),
            (not args.interactive and not args.prompt.strip(), "the prompt is empty"),
            (args.check_graphs and args.interactive, "--check-graphs needs a --prompt (not --interactive)"),
            (args.prompts_file and (args.interactive or speculating(args) or args.check_graphs or args.profile),
             "--prompts-file goes without --interactive, a draft or --prompt-lookup, --check-graphs, --profile"),
            (n > 1 and (args.prompts_file or speculating(args) or args.interactive or args.profile
                        or not args.checkpoint),
             "under torchrun: a --checkpoint and a --prompt (no --prompts-file, speculation, --interactive, --profile)")]:
        if wrong:
            raise UsageError(message)
    return sampling


def parse_buckets(text: str | None) -> list[int] | None:
    try:
        return [int(b) for b in text.split(",")] if text else None
    except ValueError:
        raise UsageError(f"--buckets takes comma-separated batch sizes (got {text!r})") from None


def speculating(args) -> int | None:  # K, the tokens proposed a round (a draft's or prompt lookup's), or None
    return args.speculate_k or args.prompt_lookup


def room(args) -> int:
    """Positions a prompt must leave: its output, and speculating the K + 1 that the target verifies."""
    return args.max_new_tokens + (speculating(args) + 1 if speculating(args) else 0)


def encode_prompt(tokenizer, messages_or_text, args, context: int) -> list[int]:
    """A prompt's ids (--chat, --interactive: messages through the chat template), checked to leave room(args)."""
    chat = args.chat or args.interactive
    ids = tokenizer.encode_chat(messages_or_text) if chat else tokenizer.encode(messages_or_text)
    if not ids:
        raise UsageError("the prompt is empty")
    if len(ids) + room(args) > context:
        raise UsageError(f"prompt ({len(ids)} tokens) plus --max-new-tokens ({room(args)}) "
                         f"exceeds the model's context of {context} tokens")
    return ids


def positions(args, prompt: list[int] | None, config, mode: str, dtype) -> int:
    """Positions the cache holds: the prompt and its output (--interactive: INTERACTIVE_CACHE to start, a
    speculative chat the whole context), rounded up to 64 (common.cache_length), or the one length of the CPU's
    step built ahead of time, which serves every prompt and output length (gdkernels/aot.py)."""
    if args.interactive and speculating(args):
        return config.max_seq_len
    # (--check-graphs decodes CHECK_GRAPHS_ROOM steps, however few tokens are asked for)
    need = INTERACTIVE_CACHE if args.interactive else \
        len(prompt) + room(args) + args.check_graphs * max(0, CHECK_GRAPHS_ROOM - args.max_new_tokens)
    return aot.cache_length(need, config, dtype) if mode.startswith("aot") else cache_length(need, config.max_seq_len)


def load_generator(args, checkpoint: Path, tokenizer, context: int, sampling: Sampling, device, dtype, mode: str,
                   use_kernels: bool):
    """The prompt encoded; the model (under torchrun this rank's share) and any draft loaded, with the kernels
    and a cache that fits -> (generator, prompt ids or None with --interactive, whether kernels swapped in)."""
    t0 = time.perf_counter()
    prompt = None if args.interactive else encode_prompt(
        tokenizer, [{"role": "user", "content": args.prompt}] if args.chat else args.prompt, args, context)
    length = positions(args, prompt, read_config(checkpoint)["args"], mode, dtype)
    compiled = mode in ("compile", "graphs") or args.compile_prefill  # (the kernels' ops registered with Inductor)
    if tp.world()[1] > 1:  # (each rank holds 1/n of the weights and of the cache: no memory check)
        model, swapped = tp.load(checkpoint, device, dtype, use_kernels, compiled)
    else:
        check_memory(read_config(checkpoint), checkpoint, 1, context if args.interactive else length, dtype, device)
        model = load(checkpoint, device=device, dtype=dtype)
        swapped = gdkernels.apply(model, compiled=compiled) if use_kernels else []
    log(f"loaded {checkpoint} on {device} ({dtype}) in {time.perf_counter() - t0:.2f} s; decode {mode}, kernels: "
        + ("; ".join(swapped) or "none" if use_kernels else "off"))
    if speculating(args):
        draft = args.draft_checkpoint and load_draft(args.draft_checkpoint, model, tokenizer, device, dtype, length)
        if draft and use_kernels:
            gdkernels.apply(draft, compiled=compiled)
        gen = SpeculativeGenerator(model, draft or None, sampling, speculating(args), mode, args.ngram, aot.AotStep)
        gen.reserve(length)
    else:
        gen = Generator(model, sampling, mode, args.compile_prefill, args.stop_check_interval)
        gen.reserve(1, length)  # buffers at their final size up front: a later resize would recompile
    return gen, prompt, bool(swapped)


def chat(args, gen, tokenizer, stop_ids, kernels: bool, context: int) -> None:
    """--interactive: a turn a line of stdin until EOF; the cache doubles when a turn needs more."""
    history = []
    while True:
        tp.say("\n> ", end="", file=sys.stderr)  # stdout carries only generated text
        line = sys.stdin.readline()
        if not line:
            return
        history.append({"role": "user", "content": line.rstrip("\n")})
        ids = encode_prompt(tokenizer, history, args, context)
        need, have = len(ids) + room(args), gen.tokens.shape[1] if isinstance(gen, Generator) else context
        if need > have:  # (the whole conversation is prefilled)
            gen.reserve(1, max(cache_length(need, context), min(context, 2 * have)))  # (aot: doubles a fixed length)
            log(f"cache: {gen.tokens.shape[1]} positions")
        history.append({"role": "assistant",
                        "content": stream(gen, tokenizer, ids, args.max_new_tokens, stop_ids, kernels)})


def one_shot(args, gen, tokenizer, prompt: list[int], stop_ids, kernels: bool) -> None:
    """--prompt: --num-samples answers, then --profile and --check-graphs."""
    for i in range(args.num_samples):
        if args.num_samples > 1:
            tp.say(f"{chr(10) if i else ''}--- sample {i + 1} of {args.num_samples} ---")
        stream(gen, tokenizer, prompt, args.max_new_tokens, stop_ids, kernels)
    if args.profile and isinstance(gen, Generator):
        profile(gen, prompt, args.profile)
    if args.check_graphs:  # from just after the prompt (a Generator: as late as leaves CHECK_GRAPHS_ROOM - 1 steps)
        start = max(0, min(len(prompt), gen.model.max_seq_length - CHECK_GRAPHS_ROOM)) \
            if isinstance(gen, Generator) else len(prompt) + 1
        log(f"check-graphs: one graph replay per call, as expected: {check_graphs(gen, start)}")


def stream(gen, tokenizer, prompt: list[int], max_new_tokens: int, stop_ids: set[int], kernels: bool = False) -> str:
    """Generate for one prompt (a Generator or a SpeculativeGenerator), printing text as it arrives, stats to stderr."""
    decoder, speculative, device = tokenizer.stream_decoder(), not isinstance(gen, Generator), gen.device
    pieces, n_new, compile_before, first_at = [], 0, gen.compile_s, None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    start = time.perf_counter()
    chunks = gen.generate(prompt, max_new_tokens, stop_ids) if speculative else \
        (c[0] for c in gen.generate([prompt], max_new_tokens, stop_ids))
    with no_recompiles(gen.mode) if gen.warm else contextlib.nullcontext():
        for chunk in chunks:
            if first_at is None:
                first_at, first = time.perf_counter(), len(chunk)
            n_new += len(chunk)
            text = "".join(decoder.push(t) for t in chunk if t not in stop_ids)
            pieces.append(text)
            tp.say(text, end="")
    pieces.append(decoder.flush())
    tp.say(pieces[-1])
    # The figures: the prefill (the time to the `first` tokens) and the decode after it, its compile apart.
    compile_s, first_s = gen.compile_s - compile_before, first_at - start
    dec_s = max(time.perf_counter() - first_at - compile_s, 1e-9)
    log(f"prefill {len(prompt)} tokens in {first_s:.3f} s ({len(prompt) / first_s:.0f} tok/s; time to first token); "
        f"decode {n_new - first} tokens in {dec_s:.2f} s: {(n_new - first) / dec_s:.1f} tok/s, "
        f"{decode_weight_bytes(gen) / dec_s / 1e9:.1f} GB/s of weights"
        + (f", compile {compile_s:.1f} s" if compile_s >= 0.05 else "")
        + f"; {n_new} tokens in all; peak memory {peak_memory(device) / 2**30:.2f} GiB; decode: {decode_path(gen, kernels)}")
    if speculative:
        log(f"speculative: {gen.rounds} rounds, {gen.mean_tokens_per_round:.2f} tokens per round, "
            f"rounds accepting 0..{gen.k} proposals: {gen.histogram}; steps proposing nothing: {gen.plain_steps}")
    return "".join(pieces)


def decode_weight_bytes(gen) -> int:
    """Bytes of weights gen's last decode read (the prefill apart): the model once a step it ran (up to K - 1 past a
    stop), or per round the target once and any draft K + 1 times."""
    if isinstance(gen, Generator):
        return gen.decode_steps * weight_bytes_per_step(gen.model, gen.tokens.shape[0])
    draft = 0 if gen.draft is None else (gen.k + 1) * weight_bytes_per_step(gen.draft)
    return gen.rounds * (weight_bytes_per_step(gen.target, gen.k + 1) + draft)  # (verify: K + 1 tokens)


def decode_path(gen, kernels: bool) -> str:
    """Which decode ran, in words: the mode (for the CPU's ahead-of-time step, whether one was found) and the kernels."""
    if not isinstance(gen, Generator):
        return f"{'speculative' if gen.draft else 'prompt lookup'}, {gen.mode}, kernels {'on' if kernels else 'off'}"
    mode = getattr(gen.step.fn, "ran", None) or {"graphs": "compiled, CUDA graphs"}.get(gen.mode, gen.mode)
    return f"{mode}, kernels {'on' if kernels else 'off'}"


def profile(gen: Generator, prompt: list[int], path: Path) -> None:
    with torch.profiler.profile() as prof:  # (the CPU, and CUDA where there is one)
        for _ in gen.generate([prompt], 2 * gen.stop_check_interval + 1):
            pass
    prof.export_chrome_trace(str(path))
    log(f"wrote profiler trace {path}")


def log(msg: str) -> None:
    tp.say(msg, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
