"""The serving engine: continuous batching over CUDA-graph buckets while requests arrive (nano-vllm's shape).

    LLM(checkpoint).generate(["Hi", "Tell me about graphs"], SamplingParams(temperature=0)) -> list[str]
    req = llm.add_request(ids, params); llm.step() -> [(req, new_ids, finished)]; llm.abort(req)

In reading order:
  SamplingParams  a request's settings: its sampling (per row data in the graph), budget, stops, logprobs
  Request         one prompt, its settings and its output so far (stops found here)
  serve_step()    one decode step of a bucket on static buffers, each row with its own sampling setting
  Runner          the device side: cache rows, static buffers, one compiled step per bucket; no policy
  Scheduler       who runs: waiting prompts in chunks within a token budget, then every decoding row; no tensors
  LLM             add_request / step / abort, generate(), and submit / receive / loop for another thread
  run_file()      generate.py --prompts-file: JSONL in, JSONL out, progress on stderr

Cache rows. The decoding requests hold rows 0..n-1, those prefilling the next; a finished request's row takes the last
decoding row's keys and values (the prefilling rows move down one). Joining prompts are prefilled at once, packed, in
the rows after the decoding ones (prefill_forward: the layers on the chunks' tokens only, attention on a grid of rows x
longest chunk); a round decodes rows 0..n-1 padded to the least bucket b >= n (padding writes go unread).

Graphs. Each bucket's step is compiled with static shapes and warmed up at start-up, largest first, into CUDAGraph
Trees' one memory pool (the CPU: built ahead of time once). Temperature, top-k, top-p and the seed are per-row tensors:
one graph a bucket serves every mix of settings (bucket 1 also has a plain one, the argmax alone, for a lone greedy
row). Compiled, prefill is one compilation for any shape (no graph). A recompile after warm-up is an error.
"""
import json
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

import gdkernels
from common import (LEAST, Sampling, Step, UsageError, argmax, cache_length, check_memory, decode_mode, default_device,
                    default_dtype, no_recompiles, prefill_attention, sample_rows)
from gdkernels import aot
from model import Transformer, read_config
from quantize import load
from tokenizer import load_tokenizer

TOP_LOGPROBS = 5  # alternatives a decode step keeps a row (OpenAI's legacy maximum): one width, one graph a bucket
PREFILL_LEAST = 32  # tokens a prefill pads to at least: fewer take gdkernels' decode paths (a compilation each)


@dataclass(frozen=True)
class SamplingParams(Sampling):
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()  # stop strings: the text ends just before the first one generated
    stop_ids: tuple[int, ...] = ()  # stop tokens besides the tokenizer's end-of-sequence ones
    ignore_eos: bool = False  # the end-of-sequence tokens do not stop (stop_ids still do)
    logprobs: bool = False  # keep each generated token's log-probability (the model's, before temperature)
    prompt_logprobs: bool = False  # and each prompt token's (the first has none)
    top_logprobs: int = 0  # and with each, the N <= TOP_LOGPROBS likeliest tokens there: [(id, log-probability)]
    seed: int | None = None  # the same seed, prompt and settings: the same tokens, whatever the batch (None: random)

    def check(self) -> None:  # (a wrong type is a UsageError too; a bool is not an integer here)
        super().check()
        if type(self.max_new_tokens) is not int or self.max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be an integer >= 1 (got {self.max_new_tokens!r})")
        if type(self.top_logprobs) is not int or not 0 <= self.top_logprobs <= TOP_LOGPROBS:
            raise UsageError(f"top_logprobs must be an integer in [0, {TOP_LOGPROBS}] (got {self.top_logprobs!r})")
        if self.seed is not None and type(self.seed) is not int:
            raise UsageError(f"seed must be an integer (got {self.seed!r})")
        if not isinstance(self.stop, (tuple, list)) or not all(isinstance(s, str) and s for s in self.stop):
            raise UsageError(f"stop must be a sequence of non-empty strings (got {self.stop!r})")
        if not isinstance(self.stop_ids, (tuple, list)) or not all(type(t) is int for t in self.stop_ids):
            raise UsageError(f"stop_ids must be token ids (got {self.stop_ids!r})")


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams = SamplingParams()
    out: list[int] = field(default_factory=list)  # generated tokens, a stop token included
    logprobs: list[float] = field(default_factory=list)  # out's log-probabilities (params.logprobs)
    prompt_logprobs: list = field(default_factory=list)  # [None, then each later prompt token's] (if asked)
    top_logprobs: list = field(default_factory=list)  # per out token its alternatives [(id, logprob)] (if asked)
    prompt_top_logprobs: list = field(default_factory=list)  # [None, then per later prompt token] (if asked)
    text: str = ""  # out as text (with a tokenizer): stop tokens left out, cut before a stop string
    final: int = 0  # text[:final] changes no more (a stop string cannot begin in it): what a stream may send
    finish_reason: str | None = None  # "stop", "length" or "abort"
    prefilled: int = 0  # prompt tokens in the KV cache
    stop_ids: frozenset = frozenset()
    decoder: object = None  # the tokenizer's stream decoder, when the engine has a tokenizer
    aborted: bool = False  # abort() asked; the next step frees the row
    outbox: object = None  # submit()'s queue of (new_ids, finished), or its own: put() called on the loop's thread

    done = property(lambda self: self.finish_reason is not None)
    pos = property(lambda self: len(self.prompt) + len(self.out) - 1)  # the last token's position: the next step's input

    def accept(self, tokens: list[int], logprobs: list[float], tops: list) -> list[int]:
        """Append tokens (and log-probabilities, alternatives) until a stop or the budget -> those taken; checked token
        by token (as a per-token check), a stop string spanning rounds found (searched from where one could begin)."""
        first, longest = len(self.out), max(map(len, self.params.stop), default=0)
        for t, lp, top in zip(tokens, logprobs, tops):
            if self.done:
                break
            self.out.append(t)
            if self.params.logprobs:
                self.logprobs.append(lp)
                self.top_logprobs += [top[:self.params.top_logprobs]] if self.params.top_logprobs else []
            if t in self.stop_ids:
                self.finish_reason = "stop"
            elif self.decoder is not None:
                self.append(self.decoder.push(t), longest)
            if not self.done and len(self.out) >= self.params.max_new_tokens:
                self.finish_reason = "length"
        if self.done and self.decoder is not None:  # what the decoder held back (a stop string may end in it)
            self.append(self.decoder.flush(), longest)
            self.decoder = None
        self.final = len(self.text) if self.done else max(self.final, len(self.text) - max(longest - 1, 0))
        return self.out[first:]

    def append(self, text: str, longest: int) -> None:  # to self.text, cut before a stop string that ends in it
        start = max(0, len(self.text) - longest + 1)  # (where one could begin)
        self.text += text
        hits = [i for i in (self.text.find(s, start) for s in self.params.stop) if i >= 0]
        if hits:  # cut there; what the decoder holds back lies past the cut
            self.text, self.finish_reason, self.decoder = self.text[:min(hits)], "stop", None


def serve_step(model: Transformer, token, pos, out, logp, col, temperature, top_k, top_p, seed, top, top_ids,
               plain: bool = False) -> None:
    """One decode step of a bucket, on static buffers: token [b, 1] the last tokens, pos [b, 1] their positions, out,
    logp [b, K] a round's tokens and logprobs, top, top_ids [b, K, TOP_LOGPROBS] the likeliest, col [1] the step, and
    temperature, top_k, top_p, seed [b] each row's sampling (plain: the argmax alone, as Generator's step). Next tokens:
    `token`, out[:, col] (no host between)."""
    logits = model(token, pos)[:, -1].float()  # [b, V]
    nxt = (argmax(logits) if plain else sample_rows(logits, temperature, top_k, top_p, seed, pos))[:, None]  # [b, 1]
    token.copy_(nxt)
    out.index_copy_(1, col, nxt)  # (column col of the round)
    if not plain:
        lp = logits.log_softmax(-1)
        values, ids = lp.topk(TOP_LOGPROBS, -1)  # [b, TOP_LOGPROBS]
        for buffer, x in [(logp, lp.gather(-1, nxt)), (top, values[:, None]), (top_ids, ids[:, None])]:
            buffer.index_copy_(1, col, x)
    col.add_(1)
    pos.add_(1).clamp_(max=model.max_seq_length - 1)  # a row done mid-round never leaves the cache


def prefill_forward(model: Transformer, idx, pos, first: int, keep) -> torch.Tensor:
    """model(idx, pos, keep), the grid's row i in cache row first - 2 + i (+ 2: Dynamo specialises ints 0 and 1)."""
    caches = [layer.attention.kv_cache for layer in model.layers]
    for c in caches:
        c.first = first - 2
    try:
        return model(idx, pos, keep)
    finally:
        for c in caches:
            c.first = 0


def pairs(logp: torch.Tensor, ids: torch.Tensor) -> list[list[tuple[int, float]]]:  # topk's [P, N]: (id, logprob)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), logp.tolist())]


def default_buckets(max_batch: int) -> list[int]:  # 1, 2, 4, 8, ... and max_batch itself
    return sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})


def row_settings(s: list[SamplingParams], vocab: int) -> list[list[float]]:  # temperature, top_k, top_p (off: V, inf), seed
    return [[p.temperature and max(p.temperature, LEAST) for p in s], [min(p.top_k or vocab, vocab) for p in s],
            [float("inf") if p.top_p in (None, 1) else max(p.top_p, LEAST) for p in s], [p.seed or 0 for p in s]]


class Runner:
    """The device side: the KV cache rows, the static buffers, one compiled step per bucket. `rows[i]` is the
    request in cache row i: the `decoding` first, then those still prefilling."""

    def __init__(self, model: Transformer, max_batch: int, length: int, buckets: list[int] | None = None,
                 mode: str = "eager", steps: int = 8):
        self.model, self.steps, self.mode, self.length = model, steps, mode, length
        self.device, self.vocab = model.tok_embeddings.weight.device, model.args.vocab_size
        self.buckets = sorted(buckets or default_buckets(max_batch))
        if self.buckets[0] < 1 or self.buckets[-1] != max_batch:
            raise UsageError(f"buckets {self.buckets} must be >= 1 and end at max_batch {max_batch}")
        fixed = mode.startswith("aot") and aot.cache_length(length, model.args, model.tok_embeddings.weight.dtype, max_batch)
        model.setup_caches(max_batch, fixed or length)  # (it may hold more: an earlier user's, or the CPU's fixed length)
        new = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=self.device)  # noqa: E731
        self.token, self.pos, self.out, self.col = new(max_batch, 1), new(max_batch, 1), new(max_batch, steps), new(1)
        self.logp, self.temperature = new(max_batch, steps, dtype=torch.float), new(max_batch, dtype=torch.float)
        self.top_k, self.top_p, self.seed = new(max_batch), new(max_batch, dtype=torch.float), new(max_batch)
        self.top, self.top_ids = (new(max_batch, steps, TOP_LOGPROBS, dtype=d) for d in (torch.float, torch.long))
        # Per bucket, views of the largest buffers, made once: a graph replays on fixed addresses.
        self.views = {b: (self.token[:b], self.pos[:b], self.out[:b], self.logp[:b], self.col, self.temperature[:b],
                          self.top_k[:b], self.top_p[:b], self.seed[:b], self.top[:b], self.top_ids[:b])
                      for b in self.buckets}
        fn = aot.AotStep(serve_step, build=mode == "aot") if mode.startswith("aot") else serve_step  # (cached on disk)
        self.step = Step(fn, mode, self.device, dynamic=False)
        for views in self.views.values():
            self.step.static(*views)
        self.forward = torch.compile(prefill_forward, dynamic=True) if mode in ("compile", "graphs") else prefill_forward
        self.prefill_warm = self.forward is prefill_forward
        self.plain = 1 if self.device.type == "cuda" else None  # the bucket with a plain step too (aot keys on shapes)
        self.rows, self.decoding = [], 0  # (rows: list[Request])

    def warm_up(self, progress=None) -> None:
        """Compile (CUDA: record) each bucket's step, largest first (one pool), then prefill; progress(what, seconds)."""
        for b, plain in [(b, plain) for b in reversed(self.buckets) for plain in (False, True)[:1 + (b == self.plain)]]:
            while not self.step.warm((b, plain)):
                self.write([], b)
                self.step(self.model, *self.views[b], plain, key=(b, plain))
            if progress is not None and self.mode != "eager":
                progress(f"bucket {b}", self.step.compile_s)
        if not self.prefill_warm:  # one prompt, then several (Dynamo specialises a size of 1); duck shapes off: no size
            start = time.perf_counter()  # is taken to equal another because their values happen to be equal
            with torch.no_grad(), prefill_attention(), torch.fx.experimental._config.patch(use_duck_shape=False), \
                    torch._dynamo.config.patch(recompile_limit=8):  # (its two entries, whatever the limit)
                for m in (1, 2)[:self.buckets[-1]]:
                    keep = torch.arange(PREFILL_LEAST, device=self.device)  # (packed: PREFILL_LEAST of m rows)
                    self.forward(self.model, keep[None] * 0, keep.clamp(max=self.length - 1).repeat(m, 1), 2, keep)
            self.prefill_warm, self.step.compile_s = True, self.step.compile_s + time.perf_counter() - start
            if progress is not None:
                progress("prefill", self.step.compile_s)

    how = property(lambda self: f"{self.mode} ({self.step.fn.ran})" if self.mode.startswith("aot") else self.mode)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def write(self, rows: list[Request], b: int) -> None:
        """A round's inputs for bucket b; padding rows (greedy) write where their row holds nothing yet (or at 0)."""
        pad = [r.prefilled if r.prefilled < len(r.prompt) else 0 for r in self.rows[len(rows):b]] + [0] * (b - len(self.rows))
        settings = row_settings([r.params for r in rows] + [SamplingParams(temperature=0)] * len(pad), self.vocab)
        host = torch.tensor([[r.out[-1] for r in rows] + [0] * len(pad), [r.pos for r in rows] + pad, *settings],
                            dtype=torch.float64).to(self.device)  # (one copy; token ids and positions exact in it)
        for buffer, values in zip(self.views[b][:2] + self.views[b][5:9], host):
            buffer.copy_(values.view(buffer.shape))
        self.col.zero_()

    @torch.no_grad()
    def decode(self) -> list[tuple[Request, list[int], list[float], list]]:
        """A round: K steps of the least bucket holding the decoding rows -> their tokens, logprobs, alternatives."""
        self.write(rows := self.rows[:self.decoding], b := self.bucket(self.decoding))
        plain = b == self.plain and not any(r.params.temperature or r.params.logprobs for r in rows)
        for _ in range(self.steps):
            self.step(self.model, *self.views[b], plain, key=(b, plain))
        out, logp = self.out[:len(rows)].tolist(), self.logp[:len(rows)].tolist()
        tops = [pairs(*t) for t in zip(self.top[:len(rows)].cpu(), self.top_ids[:len(rows)].cpu())] \
            if any(r.params.top_logprobs for r in rows) else [[None] * self.steps] * len(rows)  # (read if asked)
        return list(zip(rows, out, logp, tops))

    @torch.no_grad()
    def prefill(self, chunks: list[tuple[Request, int]]) -> list[tuple]:
        """(request, stop): prompt[request.prefilled:stop] into its row (new ones: the first free rows), in one
        forward -> per chunk (first token or None, its logprob and top ones, the prompt's or None). Complete: decode."""
        self.rows += [r for r, _ in chunks if r not in self.rows]
        first = self.rows.index(chunks[0][0])
        complete = [stop == len(r.prompt) for r, stop in chunks]
        assert first == self.decoding and self.rows[first:first + len(chunks)] == [r for r, _ in chunks] and \
            complete == sorted(complete, reverse=True), "chunks: the prefilling rows in order, the complete ones first"
        S, last = max(PREFILL_LEAST, *(stop - r.prefilled for r, stop in chunks)), self.length - 1
        # Packed: the chunks' tokens in turn, at places in a grid of rows x S positions (past a chunk: not held yet)
        pos = [[min(p, last) for p in range(r.prefilled, r.prefilled + S)] for r, _ in chunks]
        keep = [i * S + j for i, (r, stop) in enumerate(chunks) for j in range(stop - r.prefilled)]
        keep += range(keep[-1] + 1, keep[-1] + 1 + PREFILL_LEAST - len(keep))  # (too few: the last row's next places)
        idx = [t for r, stop in chunks for t in r.prompt[r.prefilled:stop]]
        idx, pos, keep = (torch.tensor(x, device=self.device) for x in ([idx + [0] * (len(keep) - len(idx))], pos, keep))
        with prefill_attention():
            logits = self.forward(self.model, idx, pos, first + 2, keep)[0]  # [N, V]
        starts = [sum(stop - r.prefilled for r, stop in chunks[:i]) for i in range(len(chunks) + 1)]  # (in idx)
        final = logits[[s - 1 for s in starts[1:]]].float()  # [m, V]: each chunk's last
        settings = torch.tensor(row_settings([r.params for r, _ in chunks], self.vocab), dtype=torch.double).to(self.device)
        at, (t, k, p, seed) = torch.tensor([stop - 1 for _, stop in chunks], device=self.device), settings  # (last positions)
        tokens, logp = sample_rows(final, t.float(), k.long(), p.float(), seed.long(), at), final.log_softmax(-1)
        firsts = zip(tokens.tolist(), logp.gather(-1, tokens[:, None])[:, 0].tolist(), pairs(*logp.topk(TOP_LOGPROBS)))
        results = []
        for i, ((r, stop), (t, lp, top)) in enumerate(zip(chunks, firsts)):
            lps = tops = None
            if r.params.prompt_logprobs:  # logits at position j score the prompt's token j + 1
                targets = torch.tensor(r.prompt[r.prefilled + 1:stop + 1], device=self.device)
                every = logits[starts[i]:starts[i] + len(targets)].float().log_softmax(-1)  # [n, V]
                lps = every.gather(-1, targets[:, None])[:, 0].tolist()
                tops = pairs(*every.topk(r.params.top_logprobs, -1))
            results.append((t if complete[i] else None, lp, top, lps, tops))
        self.decoding += sum(complete)
        return results

    def move(self, src: int, dst: int, positions: int) -> None:
        """Cache row src's first `positions` keys and values to row dst, in every layer."""
        for c in (layer.attention.kv_cache for layer in self.model.layers):
            for t in (c.k_cache, c.v_cache):
                t[dst, :, :positions].copy_(t[src, :, :positions])

    def release(self, r: Request) -> None:
        """Free r's row: the last decoding row fills it, and the prefilling rows after move down one."""
        i = self.rows.index(r)
        filled = lambda q: q.prefilled + max(len(q.out) - 1, 0)  # noqa: E731 (positions its cache row holds)
        if i < self.decoding:
            self.decoding -= 1
            if i != self.decoding:
                self.move(self.decoding, i, filled(self.rows[self.decoding]))
                self.rows[i] = self.rows[self.decoding]
            i = self.decoding
        for j in range(i + 1, len(self.rows)):
            self.move(j, j - 1, filled(self.rows[j]))
        del self.rows[i]


class Scheduler:
    """Who runs, between rounds; it never touches a tensor. Waiting requests join in arrival order while rows are free:
    a round first prefills the next prompt chunks that fit one forward of `budget` tokens (padded: rows x the longest
    chunk; a longer prompt in chunks over rounds, first in line until done), then decodes every decoding row."""

    def __init__(self, max_batch: int, budget: int):
        self.max_batch, self.budget = max_batch, budget
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # (in row order; at most one holds a partial prompt)
        self.running: list[Request] = []

    def live(self) -> list[Request]:
        return [*self.waiting, *self.prefilling, *self.running]

    def chunks(self) -> list[tuple[Request, int]]:
        """This round's prefill: (request, stop) for prompt[request.prefilled:stop]."""
        free = self.max_batch - len(self.running) - len(self.prefilling)
        line = self.prefilling + [self.waiting[i] for i in range(min(free, len(self.waiting)))]
        out, width = [], 0
        for r in line:
            cap = self.budget // (len(out) + 1)  # the widest chunk a forward of one more row may hold
            if cap < max(width, 1):
                break
            n = min(len(r.prompt) - r.prefilled, cap)
            out.append((r, r.prefilled + n))
            width = max(width, n)
            if r.prefilled + n < len(r.prompt):  # a partial prompt goes on next round, first
                break
        self.prefilling += [self.waiting.popleft() for _ in out[len(self.prefilling):]]
        return out

    def prefilled(self, r: Request) -> None:  # its prompt is in the cache: it decodes from now on
        self.prefilling.remove(r)
        self.running.append(r)

    def finish(self, r: Request) -> None:
        for q in (self.waiting, self.prefilling, self.running):
            if r in q:
                q.remove(r)


class LLM:
    """The engine: LLM(checkpoint).generate(prompts, params) -> texts; or add_request / step / abort; or, from
    other threads, submit / receive while loop() runs in one. max_length: positions a row holds (a prompt and
    its output), fixed at start-up as the graphs are. prefill_budget: tokens of one prefill forward."""

    def __init__(self, checkpoint=None, device=None, dtype=None, max_batch: int = 16, max_length: int = 1024,
                 buckets: list[int] | None = None, steps: int = 8, prefill_budget: int = 1024, kernels: bool = True,
                 compile: bool | None = None, model: Transformer | None = None, tokenizer=None):
        if min(max_batch, steps, prefill_budget, max_length) < 1:
            raise UsageError(f"max_batch, steps, prefill_budget and max_length must be >= 1 (got {max_batch}, "
                             f"{steps}, {prefill_budget}, {max_length})")
        if model is None:  # (refused before loading where the cache, the weights and the sampling's buffers do not fit)
            device, config = default_device(device), read_config(checkpoint)
            dtype = default_dtype(dtype, device)
            check_memory(config, checkpoint, max_batch, min(max_length, config["args"].max_seq_len), dtype, device,
                         workspace=max_batch * config["args"].vocab_size * 64)  # (sampling's [rows, vocab] buffers)
            model = load(checkpoint, device=device, dtype=dtype)
            if kernels and gdkernels.enabled():
                gdkernels.apply(model, compiled=compile)
        self.model, self.device = model, model.tok_embeddings.weight.device
        self.tokenizer = tokenizer or (load_tokenizer(checkpoint) if checkpoint else None)
        self.runner = Runner(model, max_batch, min(max_length, model.args.max_seq_len), buckets, decode_mode(
            self.device, compile, aot=getattr(model, "ahead_of_time", False)), steps)  # (gdkernels.apply sets it)
        self.scheduler = Scheduler(max_batch, prefill_budget)
        self.inbox = queue.SimpleQueue()  # submit()'s requests, for the loop's thread
        self.tokens_out, self.seconds = 0, 0.0  # generated tokens of the last run(), and its seconds

    def warm_up(self, progress=None) -> None:  # (a second call finds every bucket warm)
        self.runner.warm_up(progress)

    def add_request(self, prompt: list[int], params: SamplingParams = SamplingParams()) -> Request:
        """A request for the next step (checked here: errors are UsageErrors, nothing is queued)."""
        self.scheduler.waiting.append(r := self.make_request(prompt, params))
        return r

    def make_request(self, prompt, params: SamplingParams) -> Request:
        params.check()
        if not prompt or not all(type(t) is int and 0 <= t < self.runner.vocab for t in prompt):
            raise UsageError(f"a prompt must be a non-empty list of token ids in [0, {self.runner.vocab})")
        if len(prompt) + params.max_new_tokens > self.runner.length:
            raise UsageError(f"the prompt ({len(prompt)} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                             f"exceeds the {self.runner.length} positions a row holds")
        if params.stop and self.tokenizer is None:
            raise UsageError("stop strings need the engine's tokenizer")
        eos = () if params.ignore_eos or self.tokenizer is None else self.tokenizer.eos_ids
        decoder = self.tokenizer.stream_decoder() if self.tokenizer is not None else None
        seeded = replace(params, seed=int(torch.randint(2 ** 32, ())) if params.seed is None else params.seed % 2 ** 32)
        return Request(list(prompt), seeded, stop_ids=frozenset(eos) | frozenset(params.stop_ids), decoder=decoder)

    def abort(self, r: Request) -> None:
        """Stop r (from any thread): the next step frees its row and reports it finished ("abort")."""
        r.aborted = True

    @torch.no_grad()
    def step(self) -> list[tuple[Request, list[int], bool]]:
        """One round: aborts, the prefill chunks that fit, K decode steps -> (request, new tokens, finished)."""
        self.warm_up()
        while not self.inbox.empty():  # (the loop's thread is the only reader)
            self.scheduler.waiting.append(self.inbox.get_nowait())
        s, events = self.scheduler, {}
        for r in [r for r in s.live() if r.aborted]:
            r.finish_reason, events[r] = "abort", []
        self.retire(events)
        chunks = s.chunks()
        with no_recompiles(self.runner.mode):
            for (r, stop), (token, lp, top, lps, tops) in zip(chunks, self.runner.prefill(chunks) if chunks else []):
                if r.params.prompt_logprobs:  # (the first prompt token has none)
                    r.prompt_logprobs += [None] * (r.prefilled == 0) + lps
                    r.prompt_top_logprobs += [None] * (r.prefilled == 0) + tops
                r.prefilled = stop
                if token is not None:
                    s.prefilled(r)
                    events[r] = r.accept([token], [lp], [top])
            self.retire(events)  # (requests done at their first token)
            for r, tokens, logp, tops in self.runner.decode() if self.runner.decoding else []:
                events[r] = events.get(r, []) + r.accept(tokens, logp, tops)
        self.retire(events)
        return [(r, new, r.done) for r, new in events.items()]

    def retire(self, requests) -> None:
        for r in [r for r in requests if r.done]:
            if r in self.runner.rows:
                self.runner.release(r)
            self.scheduler.finish(r)

    def generate(self, prompts, params=SamplingParams(), chat: bool = False, progress=None) -> list[str]:
        """Texts for prompts (texts, or (text, max_new_tokens) pairs), in order."""
        reqs = self.requests(encode(self.tokenizer, prompts, chat), params)
        self.run(reqs, progress)
        return [r.text for r in reqs]

    def requests(self, encoded: list[tuple[list[int], int | None]], params: SamplingParams) -> list[Request]:
        """encode()'s (token ids, max_new_tokens or None) -> requests, each checked (errors name the prompt)."""
        out = []
        for i, (ids, n) in enumerate(encoded, 1):
            try:
                out.append(self.make_request(ids, params if n is None else replace(params, max_new_tokens=n)))
            except UsageError as e:
                raise UsageError(f"prompt {i}: {e}") from None
        return out

    def run(self, requests: list[Request], progress=None) -> None:
        """Requests (make_request's) to completion; progress(request) as each finishes."""
        self.warm_up()
        start = time.perf_counter()
        self.scheduler.waiting.extend(requests)
        while not all(r.done for r in requests):
            for r, _, finished in self.step():
                if finished and progress is not None:
                    progress(r)
        self.seconds, self.tokens_out = time.perf_counter() - start, sum(len(r.out) for r in requests)

    def submit(self, prompt: list[int], params: SamplingParams = SamplingParams(), outbox=None) -> Request:
        """From any thread: a request for loop()'s thread (checked here); its tokens come by receive() or outbox."""
        r = self.make_request(prompt, params)
        r.outbox = outbox or queue.SimpleQueue()
        self.inbox.put(r)
        return r

    @staticmethod
    def receive(r: Request, timeout: float | None = None) -> tuple[list[int], bool]:
        """The next (new token ids, finished) of a submitted request; queue.Empty after `timeout` seconds."""
        return r.outbox.get(timeout=timeout)

    def loop(self, stop: threading.Event, idle: float = 0.01) -> None:
        """The engine loop for one background thread until `stop` is set: steps while there is work, else waits for
        submit()'s. At its end (stopped, or a step raised) each live request ends "abort" with ([], True)."""
        try:
            while not stop.is_set():
                if not self.scheduler.live():
                    try:
                        self.scheduler.waiting.append(self.inbox.get(timeout=idle))
                    except queue.Empty:
                        continue
                for r, new, finished in self.step():
                    if r.outbox is not None:
                        r.outbox.put((new, finished))
        finally:
            for r in (live := self.scheduler.live() + [self.inbox.get_nowait() for _ in range(self.inbox.qsize())]):
                r.finish_reason = "abort"
                if r.outbox is not None:
                    r.outbox.put(([], True))
            self.retire(live)


def encode(tokenizer, prompts, chat: bool) -> list[tuple[list[int], int | None]]:
    """Prompts (texts, or (text, max_new_tokens) pairs) -> (token ids, max_new_tokens or None)."""
    out = []
    for i, p in enumerate(prompts, 1):
        text, n = p if isinstance(p, tuple) else (p, None)
        if not isinstance(text, str) or not text.strip():
            raise UsageError(f"prompt {i} is empty (or not a string)")
        out.append((tokenizer.encode_chat([{"role": "user", "content": text}]) if chat else tokenizer.encode(text), n))
    return out


def read_prompts(path: Path) -> list[tuple[str, int | None]]:
    """One prompt a line, or JSONL lines {"prompt": ..., "max_new_tokens": N (optional)}."""
    try:
        lines = [(n, line) for n, line in enumerate(Path(path).read_text().splitlines(), 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read the prompts file {path} ({e})") from None
    if not lines:
        raise UsageError(f"the prompts file {path} holds no prompt")
    prompts = []
    for n, line in lines:  # (n: the file's line number)
        try:
            d = json.loads(line) if line.lstrip().startswith("{") else {"prompt": line}
            prompts.append((d["prompt"], d.get("max_new_tokens")))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UsageError(f"{path} line {n}: not a JSON object with a \"prompt\" ({e})") from None
        if prompts[-1][1] is not None and (not isinstance(prompts[-1][1], int) or prompts[-1][1] < 1):
            raise UsageError(f"{path} line {n}: max_new_tokens must be an integer >= 1 (got {prompts[-1][1]!r})")
    return prompts


def run_file(checkpoint: Path, prompts_file: Path, output: Path | None, params: SamplingParams, chat: bool,
             max_batch: int, buckets: list[int] | None, steps: int, device, dtype, kernels: bool,
             compile: bool | None) -> None:
    """Every prompt of a file through the engine, one JSONL line {"prompt", "text"} each, in order (to
    `output`, else stdout); progress and figures on stderr."""
    if output and not output.resolve().parent.is_dir():  # (before the run, not after it)
        raise UsageError(f"{output}: no such directory")
    prompts = read_prompts(prompts_file)
    tokenizer, config = load_tokenizer(checkpoint), read_config(checkpoint)
    encoded = encode(tokenizer, prompts, chat)
    need = max(len(ids) + (n or params.max_new_tokens) for ids, n in encoded)
    length = cache_length(need, config["args"].max_seq_len)  # (too long: the requests below say which)
    llm = LLM(checkpoint, device, dtype, max_batch, length, buckets, steps, kernels=kernels, compile=compile,
              tokenizer=tokenizer)
    reqs = llm.requests(encoded, params)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    llm.warm_up(lambda what, sec: log(f"engine: {what} warm ({sec:.1f} s)"))
    r = llm.runner
    log(f"engine: {r.how}, buckets {r.buckets}, {r.steps} decode steps a round, {r.length} positions a row, "
        f"warm-up {r.step.compile_s:.1f} s")
    start = time.perf_counter()
    with tqdm(total=len(reqs), unit="req", file=sys.stderr, disable=None) as bar:
        def progress(q: Request):
            tokens = sum(len(x.out) for x in reqs)
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.1f} tok/s", refresh=False)
            bar.update()
        llm.run(reqs, progress)
    lines = "".join(json.dumps({"prompt": p, "text": q.text}) + "\n" for (p, _), q in zip(prompts, reqs))
    (Path(output).write_text if output else sys.stdout.write)(lines)
    log(f"{len(reqs)} requests, {llm.tokens_out} tokens in {llm.seconds:.2f} s: {llm.tokens_out / llm.seconds:.1f} tok/s")
