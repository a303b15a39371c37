"""Many prompts at once: continuous batching over CUDA-graph buckets, the way serving engines keep
their graphs while the batch changes every step (nano-vllm's shape, in one file).

    python generate.py --prompts-file prompts.txt [--max-batch 64] [--output out.jsonl]
    LLM(checkpoint).generate(["Hi", "Tell me about graphs"], Sampling(temperature=0)) -> list[str]

In reading order:
  Request      one prompt, its token budget and its output so far
  Runner       owns the cache rows, the static buffers and one compiled step per bucket; no policy
  LLM.run()    the scheduler: between decode rounds it retires finished rows and admits waiting
               requests; a round is K decode steps launched back to back, read back once
  main_file()  generate.py --prompts-file: JSONL in, JSONL out, progress on stderr

Cache rows. The model reads and writes the first B rows of its KV cache, so batch row i is cache
row i, and the engine keeps its n active requests in rows 0..n-1: a finished request's row takes
the last active row's keys and values (Runner.move); a joining request is prefilled in row 0 after
row 0's request moves to row n. A round runs the smallest bucket b >= n; its padding rows n..b-1
are free rows, the scratch that no request reads (a request joining there is prefilled over it,
and attention masks every position past a row's own).

Graphs. Each bucket's step is compiled with static shapes and warmed at start-up, largest bucket
first, so CUDAGraph Trees records every bucket into its one memory pool and the smaller ones reuse
the largest one's memory. The inputs are views of buffers sized for the largest bucket, made once
per bucket and marked static, so a replay reads them where they are. After warm-up a recompile is
an error (common.no_recompiles).
"""
import json
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

import gdkernels
from common import DTYPES, Sampling, UsageError, check_memory, compiled, no_recompiles, sample, synchronize
from model import Transformer, read_config
from quantize import load
from tokenizer import load_tokenizer


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    out: list[int] = field(default_factory=list)  # generated tokens, the stop token included
    done: bool = False

    def accept(self, tokens: list[int], stop_ids) -> None:
        """Append tokens until a stop token or the budget; the rest (a round's tail) is dropped."""
        for t in tokens:
            if self.done:
                return
            self.out.append(t)
            self.done = t in stop_ids or len(self.out) >= self.max_new_tokens

    @property
    def pos(self) -> int:  # the position of the last token, the next step's input
        return len(self.prompt) + len(self.out) - 1


def serve_step(model: Transformer, token, pos, out, col, s: Sampling) -> None:
    """One decode step for a bucket, on static buffers: token [b, 1] the last tokens, pos [b, 1] their
    positions (each row its own), out [b, K] a round's tokens, col [1] the step within the round.
    The next tokens go to `token` and to out[:, col] (on-device feedback: no host between steps)."""
    logits = model(token, pos)  # [b, 1, V]
    nxt = sample(logits[:, -1], s).unsqueeze(-1)  # [b, 1]
    token.copy_(nxt)
    out.index_copy_(1, col, nxt)
    col.add_(1)
    pos.add_(1).clamp_(max=model.max_seq_length - 1)  # a row done mid-round never leaves the cache


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, ... and max_batch itself."""
    return sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})


class Runner:
    """The device side: the KV cache rows, the static buffers, one compiled step per bucket."""

    def __init__(self, model: Transformer, sampling: Sampling, max_batch: int, length: int,
                 buckets: list[int] | None = None, mode: str = "eager", steps: int = 1):
        self.model, self.sampling, self.steps = model, sampling, steps
        self.device = model.tok_embeddings.weight.device
        self.buckets = sorted(buckets or default_buckets(max_batch))
        if self.buckets[0] < 1 or self.buckets[-1] != max_batch:
            raise UsageError(f"buckets {self.buckets} must be >= 1 and end at --max-batch {max_batch}")
        model.setup_caches(max_batch, length)
        self.length = model.max_seq_length
        new = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=self.device)  # noqa: E731
        self.token, self.pos, self.out, self.col = new(max_batch, 1), new(max_batch, 1), new(max_batch, steps), new(1)
        # Per bucket, views of the largest buffers, made once: a graph replays on fixed addresses.
        self.views = {b: (self.token[:b], self.pos[:b], self.out[:b]) for b in self.buckets}
        self.mode = mode
        if mode in ("compile", "graphs"):
            gdkernels.register_fallbacks()
            for t in (self.col, *(v for views in self.views.values() for v in views)):
                torch._dynamo.mark_static_address(t)
        self.step = compiled(serve_step, mode, self.device, dynamic=False)
        self.warmup_s = 0.0

    @torch.no_grad()
    def warm_up(self, progress=None) -> None:
        """Compile (and on CUDA record) every bucket's step, largest first, so the smaller buckets'
        graphs are recorded into the memory the largest one's left in the shared pool."""
        if self.mode == "eager":
            return
        start = time.perf_counter()
        skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
        with torch._dynamo.config.patch(recompile_limit=256):  # (one compile a bucket, for every runner made)
            for b in reversed(self.buckets):
                for _ in range(3):  # CUDAGraph Trees: a warm-up run, then the recording, then a replay
                    self.pos.zero_()
                    self.col.zero_()
                    self.step(self.model, *self.views[b], self.col, self.sampling)
                if progress is not None:
                    synchronize(self.device)
                    progress(b, time.perf_counter() - start)
        synchronize(self.device)
        if torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] > skips:  # Inductor logged why
            raise RuntimeError("a bucket's decode step was not CUDA-graphed (see the log of torch._inductor)")
        self.warmup_s = time.perf_counter() - start

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @torch.no_grad()
    def prefill(self, prompt: list[int]) -> int:
        """The prompt into cache row 0 (the model writes the first rows) -> its first token."""
        idx = torch.tensor([prompt], device=self.device)
        logits = self.model(idx, torch.arange(len(prompt), device=self.device))
        return sample(logits[:, -1], self.sampling).item()

    def move(self, src: int, dst: int) -> None:
        """Cache row src's keys and values to row dst, in every layer."""
        for layer in self.model.layers:
            c = layer.attention.kv_cache
            c.k_cache[dst].copy_(c.k_cache[src])
            c.v_cache[dst].copy_(c.v_cache[src])

    @torch.no_grad()
    def decode(self, rows: list[Request]) -> list[list[int]]:
        """One round: K steps of the smallest bucket that holds the rows -> K new tokens per row.
        The host writes the inputs once, launches K replays back to back and reads back once."""
        b = self.bucket(len(rows))
        pad = b - len(rows)  # padding rows: token 0 at position 0 of a free row
        inputs = torch.tensor([[r.out[-1] for r in rows] + [0] * pad, [r.pos for r in rows] + [0] * pad])
        token, pos, out = self.views[b]
        inputs = inputs.to(self.device, non_blocking=True)
        token.copy_(inputs[0, :, None])
        pos.copy_(inputs[1, :, None])
        self.col.zero_()
        for _ in range(self.steps):
            self.step(self.model, token, pos, out, self.col, self.sampling)
        return out[: len(rows), : self.steps].tolist()


class LLM:
    """The Python API: LLM(checkpoint).generate(prompts, sampling) -> texts, in the prompts' order.
    max_length: positions a row holds (a prompt and its output), fixed at start-up as the graphs are."""

    def __init__(self, checkpoint=None, device=None, dtype=None, max_batch: int = 16, max_length: int = 1024,
                 buckets: list[int] | None = None, steps: int = 8, kernels: bool = True,
                 compile: bool | None = None, model: Transformer | None = None, tokenizer=None):
        if max_batch < 1 or steps < 1:
            raise UsageError(f"--max-batch and --decode-steps must be >= 1 (got {max_batch}, {steps})")
        if model is None:
            device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            dtype = DTYPES.get(dtype, dtype) or DTYPES["bf16" if device.type == "cuda" else "fp32"]  # a name or a dtype
            model = load(checkpoint, device=device, dtype=dtype)
            if kernels and gdkernels.enabled():
                gdkernels.apply(model)
        self.model, self.device = model, model.tok_embeddings.weight.device
        self.tokenizer = tokenizer or (load_tokenizer(checkpoint) if checkpoint else None)
        cuda = self.device.type == "cuda"  # by default graphs on CUDA; on the CPU eager (compiling buckets is slow)
        self.mode = {None: "graphs" if cuda else "eager", True: "graphs" if cuda else "compile", False: "eager"}[compile]
        self.max_batch, self.steps, self.buckets = max_batch, steps, buckets
        self.max_length = min(max_length, model.args.max_seq_len)
        self.runners, self.runner = {}, None  # a warm runner per sampling setting; the last one used
        self.tokens_out, self.seconds = 0, 0.0  # generated tokens of the last run, and its seconds (warm-up apart)

    def requests(self, prompts, max_new_tokens: int = 256, chat: bool = False) -> list[Request]:
        """Prompts (texts, or (text, max_new_tokens) pairs) -> Requests, each checked against max_length."""
        return encode_requests(self.tokenizer, prompts, max_new_tokens, chat, self.max_length)

    def generate(self, prompts, sampling: Sampling = Sampling(), max_new_tokens: int = 256, chat: bool = False,
                 ignore_eos: bool = False, progress=None) -> list[str]:
        reqs = self.requests(prompts, max_new_tokens, chat)
        stop_ids = set() if ignore_eos else set(self.tokenizer.eos_ids)
        self.run(reqs, sampling, stop_ids, progress)
        return self.texts(reqs, stop_ids)

    def texts(self, requests: list[Request], stop_ids) -> list[str]:
        """Each request's generated text, its stop token left out."""
        return [self.tokenizer.decode([t for t in r.out if t not in stop_ids]) for r in requests]

    def make_runner(self, sampling: Sampling, progress=None) -> Runner:
        """The runner for a sampling setting (part of the compiled step), warmed up once (progress(bucket,
        seconds so far) after each bucket)."""
        sampling.check()
        if sampling not in self.runners:
            self.runners[sampling] = Runner(self.model, sampling, self.max_batch, self.max_length, self.buckets,
                                            self.mode, self.steps)
            self.runners[sampling].warm_up(progress)
        self.runner = self.runners[sampling]
        return self.runner

    def run(self, requests: list[Request], sampling: Sampling, stop_ids=frozenset(), progress=None) -> None:
        """The scheduler: continuous batching. Between rounds, finished rows leave (the last active row
        moves into each) and waiting requests join (each prefilled in row 0, whose request moves to the
        first free row); then a round decodes every active row at its own position."""
        runner = self.make_runner(sampling)
        if any(len(r.prompt) + r.max_new_tokens > runner.length for r in requests):
            raise UsageError(f"a request's prompt and max_new_tokens exceed the {runner.length} positions a row holds")
        synchronize(self.device)
        start = time.perf_counter()
        waiting, active = deque(requests), []  # active[i] is the request in cache row i
        with no_recompiles(runner.mode):
            while waiting or active:
                while waiting and len(active) < self.max_batch:
                    r = waiting.popleft()
                    active.append(r)
                    if len(active) > 1:  # row 0's request to the first free row, r to row 0
                        runner.move(0, len(active) - 1)
                        active[0], active[-1] = r, active[0]
                    r.accept([runner.prefill(r.prompt)], stop_ids)
                    self.retire(active, progress)
                if active:
                    for r, tokens in zip(active, runner.decode(active)):
                        r.accept(tokens, stop_ids)
                    self.retire(active, progress)
        synchronize(self.device)
        self.seconds = time.perf_counter() - start
        self.tokens_out = sum(len(r.out) for r in requests)

    def retire(self, active: list[Request], progress) -> None:
        """Remove finished rows, highest first, moving the last active row into each."""
        for i in reversed([i for i, r in enumerate(active) if r.done]):
            if i != len(active) - 1:
                self.runner.move(len(active) - 1, i)
            r, active[i] = active[i], active[-1]
            active.pop()
            if progress is not None:
                progress(r)


def encode_requests(tokenizer, prompts, max_new_tokens: int, chat: bool, length: int) -> list[Request]:
    """Prompts (texts, or (text, max_new_tokens) pairs) -> Requests, each within `length` positions."""
    out = []
    for i, p in enumerate(prompts, 1):
        text, budget = p if isinstance(p, tuple) else (p, max_new_tokens)
        if not isinstance(text, str) or not text.strip():
            raise UsageError(f"prompt {i} is empty")
        if not isinstance(budget, int) or budget < 1:
            raise UsageError(f"prompt {i}: max_new_tokens must be an integer >= 1 (got {budget!r})")
        ids = tokenizer.encode_chat([{"role": "user", "content": text}]) if chat else tokenizer.encode(text)
        if len(ids) + budget > length:
            raise UsageError(f"prompt {i} ({len(ids)} tokens) plus max_new_tokens ({budget}) exceeds the "
                             f"{length} positions a row holds (the model's context, or max_length)")
        out.append(Request(ids, budget))
    return out


def read_prompts(path: Path, max_new_tokens: int) -> list:
    """One prompt a line, or JSONL lines {"prompt": ..., "max_new_tokens": N (optional)}."""
    try:
        lines = [(n, line) for n, line in enumerate(Path(path).read_text().splitlines(), 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--prompts-file: cannot read {path} ({e})") from None
    if not lines:
        raise UsageError(f"--prompts-file: {path} holds no prompt")
    prompts = []
    for n, line in lines:  # (n: the file's line number)
        if not line.lstrip().startswith("{"):
            prompts.append((line, max_new_tokens))
            continue
        try:
            d = json.loads(line)
            prompts.append((d["prompt"], d.get("max_new_tokens", max_new_tokens)))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UsageError(f"--prompts-file line {n}: not a JSON object with a \"prompt\" ({e})") from None
    return prompts


def main_file(args, checkpoint, device, dtype, use_kernels: bool, sampling: Sampling, log) -> None:
    """generate.py --prompts-file: every prompt through the engine, one JSONL line each, in order."""
    from tqdm import tqdm

    if args.interactive or args.draft_checkpoint or args.check_graphs or args.profile:
        raise UsageError("--prompts-file goes without --interactive, --draft-checkpoint, --check-graphs, --profile")
    if args.output and not args.output.resolve().parent.is_dir():  # (before the run, not after it)
        raise UsageError(f"--output {args.output}: no such directory")
    tokenizer, config = load_tokenizer(checkpoint), read_config(checkpoint)
    context = config["args"].max_seq_len
    prompts = read_prompts(args.prompts_file, args.max_new_tokens)
    reqs = encode_requests(tokenizer, prompts, args.max_new_tokens, args.chat, context)
    length = min(context, -(-max(len(r.prompt) + r.max_new_tokens for r in reqs) // 64) * 64)
    check_memory(config, checkpoint, args.max_batch, length, dtype, device)  # the KV cache of every row
    try:
        buckets = [int(b) for b in args.buckets.split(",")] if args.buckets else None
    except ValueError:
        raise UsageError(f"--buckets takes comma-separated batch sizes (got {args.buckets!r})") from None
    llm = LLM(checkpoint, device, dtype, args.max_batch, length, buckets, args.decode_steps, use_kernels,
              args.compile, tokenizer=tokenizer)
    runner = llm.make_runner(sampling, lambda b, sec: log(f"engine: bucket {b} compiled and warm ({sec:.1f} s)"))
    log(f"engine: {llm.mode}, buckets {runner.buckets}, {llm.steps} decode steps a round, {runner.length} "
        f"positions a row, warm-up {runner.warmup_s:.1f} s")
    stop_ids = set() if args.ignore_eos else set(tokenizer.eos_ids)
    start, tokens = time.perf_counter(), 0
    with tqdm(total=len(reqs), unit="req", file=sys.stderr, disable=None) as bar:
        def progress(r: Request):
            nonlocal tokens
            tokens += len(r.out)
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.1f} tok/s", refresh=False)
            bar.update()
        llm.run(reqs, sampling, stop_ids, progress)
    lines = "".join(json.dumps({"prompt": p, "text": t}) + "\n" for (p, _), t in zip(prompts, llm.texts(reqs, stop_ids)))
    if args.output:
        Path(args.output).write_text(lines)
    else:
        sys.stdout.write(lines)
    log(f"{len(reqs)} requests, {llm.tokens_out} tokens in {llm.seconds:.2f} s: {llm.tokens_out / llm.seconds:.1f} tok/s")
