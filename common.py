"""What several modules share, below all of them: graph-safe sampling (fixed-shape ops, no host sync: sampling stays
inside the step's one CUDA graph), the defaults every entry point uses, the decode modes and Step (a decode step on
static buffers, compiled or recorded, warmed up and checked), the cache directory, dtypes."""
import contextlib
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CPU_OPTIONS = {"cpp.min_chunk_size": 65536}  # Inductor on the CPU: decode's small loops not handed to OpenMP threads
LEAST = 1e-30  # the least temperature (above 0) and top_p the samplers use: smaller, logits overflow or round to 0


def cache_dir() -> Path:
    """Where the default model, the CPU kernels and the ahead-of-time steps are kept."""
    return Path(os.environ.get("GRAPHDECODE_CACHE", Path.home() / ".cache" / "graphdecode"))


def default_device(name: str | None = None) -> torch.device:
    """The device every entry point uses unless told: CUDA where there is one."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("device cuda: no CUDA device is available")
    return device


def default_dtype(name, device: torch.device) -> torch.dtype:
    """A dtype's name (or a dtype, or None: bf16 on CUDA, fp32 on the CPU) -> the dtype."""
    return DTYPES.get(name, name) or DTYPES["bf16" if device.type == "cuda" else "fp32"]


def cache_length(need: int, context: int) -> int:
    """Positions a KV cache holds for `need`: rounded up to 64 (prompts of about one length then share a compiled
    step and its graphs), at most the model's context."""
    return min(context, -(-need // 64) * 64)


def decode_mode(device: torch.device, compile: bool | None, aot: bool = False) -> str:
    """How decode runs (compile: None the default, True asked for, False refused): CUDA graphs on CUDA; on
    the CPU eager, or torch.compile when asked; aot (the CPU kernels' single-prompt step, gdkernels/aot.py):
    built when asked, else used if built before."""
    if compile is False:
        return "eager"
    if device.type == "cuda":
        return "graphs"
    if aot:
        return "aot" if compile else "aot-cached"
    return "compile" if compile else "eager"


@contextlib.contextmanager
def no_recompiles(mode: str):
    """After warm-up a recompile is an error naming the guard that failed, never a silent slowdown
    (dynamo raises with the failed guard in its message). Modes that trace nothing pass through."""
    if mode not in ("compile", "graphs"):
        yield
        return
    with torch._dynamo.config.patch(error_on_recompile=True):
        try:
            yield
        except torch._dynamo.exc.RecompileError as e:
            raise RuntimeError(f"decode recompiled after warm-up: {str(e).strip().splitlines()[-1]}") from e


class Step:
    """A decode step on static buffers as `mode` runs it, the one place Generator, the engine's Runner and the
    speculative generator get it from: "eager"; "compile", Inductor's kernels launched one by one (on the CPU
    with CPU_OPTIONS); "graphs", those kernels replayed as CUDA graphs; "aot" and "manual": fn is gdkernels'
    ahead-of-time step or bench.py's graph captured by hand already. The buffers it mutates are marked static (a
    graph replays on fixed addresses), and the first calls per key (an input shape: a bucket) are timed apart as
    warm-up (compile; CUDAGraph Trees: a warm-up run, the recording, a first replay). dynamic=False: one static
    compilation per shape (the engine's buckets). check_graphs() verifies what runs after warm-up."""

    WARMUP_CALLS = {"eager": 0, "compile": 1, "graphs": 3, "aot": 1, "aot-cached": 1, "manual": 1}

    def __init__(self, fn, mode: str, device: torch.device, dynamic: bool | None = None):
        if mode == "graphs" and device.type != "cuda":
            raise ValueError("mode 'graphs' needs a CUDA device")
        self.mode, self.device, self.fn = mode, device, fn
        if mode in ("compile", "graphs"):
            self.fn = torch.compile(fn, fullgraph=True, dynamic=dynamic, mode="reduce-overhead" if mode == "graphs"
                                    else None, options=CPU_OPTIONS if device.type == "cpu" else None)
        self.calls: dict = {}  # key -> calls so far, up to WARMUP_CALLS[mode]
        self.compile_s = 0.0

    def static(self, *tensors: torch.Tensor) -> tuple:
        if self.mode in ("compile", "graphs"):  # (eager and aot need no marks, nor the 1.3 s import of torch._dynamo)
            for t in tensors:
                torch._dynamo.mark_static_address(t)  # mutated in the graph: must stay put
        return tensors

    def warm(self, key=None) -> bool:
        return self.calls.get(key, 0) >= self.WARMUP_CALLS[self.mode]

    def reset(self) -> None:
        """New buffers: the steps warm up (compile, record) again."""
        self.calls.clear()

    @torch.no_grad()  # grad mode is part of what a compiled step is specialised on
    def __call__(self, *args, key=None):
        if self.warm(key):
            return self.fn(*args)
        start = time.perf_counter()
        # Dynamo keeps an entry a key (a shape: the engine's 9 buckets at 256 rows): its limit, 8, must allow them all
        with torch._dynamo.config.patch(recompile_limit=max(8, len(self.calls.keys() | {key}))) \
                if self.mode in ("compile", "graphs") else contextlib.nullcontext():
            out = self.fn(*args)
        synchronize(self.device)
        self.compile_s += time.perf_counter() - start
        self.calls[key] = self.calls.get(key, 0) + 1
        return out


class GraphCheckError(RuntimeError):
    """A step did not run as the CUDA graph replays expected."""


# A graph that draws random numbers (sampling; the engine's step always) comes with two small kernels outside it at
# each replay: PyTorch writes the generator's seed and offset into the graph's inputs (CUDAGraph's replay prologue).
RNG_KERNELS_PER_REPLAY = 2


def launches_per_call(fn, device, calls: int) -> dict:
    """Graph launches and kernels launched outside graphs per call of fn, from the profiler (a graph break, a
    skipped graph or an eager fallback shows up as kernels outside graphs)."""
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        synchronize(device)
    names = [e.name for e in prof.events()]
    graphs = sum(n.startswith(("cudaGraphLaunch", "cuGraphLaunch")) for n in names)
    kernels = sum(n.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel")) for n in names)
    return {"graph_launches_per_step": graphs / calls, "kernels_outside_graphs_per_step": kernels / calls}


def check_graphs(fn, device, calls: int, what: str, graphs: int = 1, outside: int = 0, random: bool = False) -> dict:
    """The one graph check: profile `calls` calls of fn and raise GraphCheckError unless each launches exactly
    `graphs` graphs and at most `outside` kernels outside them (random: and each graph's RNG kernels)."""
    outside += RNG_KERNELS_PER_REPLAY * graphs * random
    counts = launches_per_call(fn, device, calls)
    if counts["graph_launches_per_step"] != graphs or counts["kernels_outside_graphs_per_step"] > outside:
        raise GraphCheckError(
            f"{what} is not {'one graph replay' if graphs == 1 else f'{graphs} graph replays'} per call: "
            f"{counts['graph_launches_per_step']:g} graph launches and {counts['kernels_outside_graphs_per_step']:g} "
            f"kernels outside graphs per call (expected {graphs} and at most {outside}): a graph break, a skipped "
            "graph or an eager fallback")
    return counts


def prefill_attention():
    """Within: PyTorch's attention without cuDNN's kernel, which builds a plan for each new shape, and prefill's
    shapes change with every prompt and chunk (BENCHMARKS.md)."""
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def weight_bytes_per_step(model, rows: int = 1) -> int:
    """Bytes of weights a decode step of `rows` rows reads: every stored tensor once (quantized weights and their
    scales included), but the embedding table, of which it reads a row a sequence (unless tied), and of a mixture's
    experts those gathered, rows x k a layer, or all of them once that reaches E (model.MoEFeedForward)."""
    persistent = model.state_dict().keys()
    tensors = dict(model.named_parameters())  # shared (tied) parameters appear once
    tensors.update((n, b) for n, b in model.named_buffers() if n in persistent)  # not the KV cache
    if not model.args.tie_embeddings:
        tensors.pop("tok_embeddings.weight")
    a, expert = model.args, re.compile(r"feed_forward\.w[123](_scales)?$")
    share = min(1.0, rows * a.n_active_experts / a.n_experts) if a.n_experts else 1.0
    return int(sum(t.numel() * t.element_size() * (share if expert.search(n) else 1) for n, t in tensors.items()))


def peak_memory(device: torch.device) -> int:  # bytes: the peak GPU memory allocated, or the peak resident size
    import resource
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class UsageError(Exception):
    """Bad input from the user: printed as one `error:` line, exit status 1."""


class ConversionError(Exception):
    """A problem with a checkpoint to convert, reported as one line by the CLI."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def one_line_errors(run, errors=(ConversionError, OSError)) -> int:
    """A CLI's exit status: run(), with `errors` printed as one `error:` line on stderr (status 1)."""
    try:
        run()
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8  # 0: greedy
    top_k: int | None = 200
    top_p: float | None = None

    def check(self) -> None:  # (a wrong type is a UsageError too; a bool is not a number here)
        if type(self.temperature) not in (int, float) or not 0 <= self.temperature < math.inf:
            raise UsageError(f"temperature must be a number >= 0 (got {self.temperature!r})")
        if self.top_k is not None and not (type(self.top_k) is int and 1 <= self.top_k):
            raise UsageError(f"top_k must be an integer >= 1 (got {self.top_k!r})")
        if self.top_p is not None and not (type(self.top_p) in (int, float) and 0 <= self.top_p <= 1):
            raise UsageError(f"top_p must be a number in [0, 1] (got {self.top_p!r})")


@torch.library.custom_op("graphdecode::cumsum", mutates_args=())
def cumsum(x: torch.Tensor) -> torch.Tensor:
    """x.cumsum(-1) as ATen runs it, also when compiled: torch 2.11's Inductor splits a vocabulary-long scan over
    few rows into a SplitScan whose Triton code fails to build."""
    return x.cumsum(-1)


@cumsum.register_fake
def _(x):
    return torch.empty_like(x)


def logits_to_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [B, V] -> sampling distribution [B, V] in float32."""
    logits = logits.float() / max(s.temperature, LEAST)
    if s.top_k is not None and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p is not None and s.top_p < 1:
        # Keep the smallest prefix of the sorted distribution whose mass reaches top_p: a token is
        # dropped when the mass before it already does. Full-vocabulary sort: a fixed shape.
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        drop_sorted = (cumsum(sorted_probs) - sorted_probs) >= max(s.top_p, LEAST)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] -> x.argmax(-1) (the first maximum), as two reductions where V splits in 64 slices: Inductor
    reduces a row in one program, and one program over Llama-3's 128k logits takes 32 µs of a 0.9 ms H200 step."""
    k = 64 if x.shape[-1] % 64 == 0 else 1
    best, at = x.unflatten(-1, (k, -1)).max(-1)  # [..., k]: each slice's maximum and its first place
    s = best.argmax(-1, keepdim=True)  # [..., 1]: the first slice that holds the row's maximum
    return (s * (x.shape[-1] // k) + at.gather(-1, s))[..., 0]


def draw(probs: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """probs [..., V] (need not be normalised) -> one draw per row [...]. argmax(p / E) with
    E ~ Exponential(1) draws from p (the exponential race) without torch.multinomial, which syncs
    with the host. noise: E given (seeded_noise), else drawn from PyTorch's generator."""
    return argmax(probs / (torch.empty_like(probs).exponential_(1) if noise is None else noise))


def _mix(h: torch.Tensor) -> torch.Tensor:  # a 32-bit integer hash (h in [0, 2^32) as int64: no overflow)
    for _ in range(2):
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    return h ^ (h >> 16)


def seeded_noise(seed: torch.Tensor, pos: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exponential(1) noise [B, vocab] for draw(), a hash of each row's seed [B] and position [B] (or [B, 1]) and of
    the token: a seeded request draws the same tokens whatever else its batch holds, with no generator state."""
    h = _mix((seed.view(-1, 1) + _mix(pos.view(-1, 1) & 0xFFFFFFFF)) & 0xFFFFFFFF)
    u = ((_mix(h ^ torch.arange(vocab, device=seed.device)) >> 8).float() + 0.5) / 2 ** 24  # uniform in (0, 1)
    return -u.log()


def sample(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    if s.temperature == 0:
        return argmax(logits)
    return draw(logits_to_probs(logits, s))


def row_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits_to_probs with a setting per row, as tensors (one compiled step serves every mix): logits [B, V],
    temperature [B] (> 0), top_k [B] (V: off), top_p [B] (inf: off) -> [B, V] float32. One full-vocabulary
    sort (a fixed shape) serves both filters: top-k keeps logits >= the k-th (ties kept, as topk's rule
    there), top-p the smallest prefix of the sorted distribution whose mass reaches top_p."""
    logits = logits.float() / temperature[:, None]
    ranked, order = logits.sort(-1, descending=True)  # [B, V]
    # The k-th largest as the least of the first k (a reduction: Inductor's Triton code for a gather fused
    # into the softmax's split reduction fails to build in torch 2.11).
    first_k = torch.arange(logits.shape[-1], device=logits.device) < top_k[:, None]
    kth = ranked.masked_fill(~first_k, float("inf")).amin(-1, keepdim=True)
    p = ranked.masked_fill(ranked < kth, -float("inf")).softmax(-1)
    p = p.masked_fill((cumsum(p) - p) >= top_p[:, None], 0.0)
    return torch.zeros_like(p).scatter_(-1, order, p / p.sum(-1, keepdim=True))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                seed: torch.Tensor | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B], each row by its own setting (row_probs); temperature 0: argmax. With each
    row's seed and position [B]: the noise hashed from them (seeded_noise), else PyTorch's generator's. On the CPU
    the sampler (a sort of the vocabulary a row: the step's costliest part after the matmuls) runs only when some
    row samples: a branch, compiled as torch.cond; on CUDA a graph's work is fixed, and the GPU's sort is cheap."""
    def sampled(logits, temperature, top_k, top_p, *seed_pos):
        noise = seeded_noise(*seed_pos, logits.shape[-1]) if seed_pos else None
        drawn = draw(row_probs(logits, torch.where(temperature > 0, temperature, 1.0), top_k, top_p), noise)
        return torch.where(temperature > 0, drawn, argmax(logits))

    operands = (logits, temperature, top_k, top_p, *(() if seed is None else (seed, pos)))
    if logits.device.type == "cuda":
        return sampled(*operands)
    if torch.compiler.is_compiling():
        return torch.cond((temperature > 0).any(), sampled, lambda logits, *rest: argmax(logits), operands)
    return sampled(*operands) if (temperature > 0).any() else argmax(logits)


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        free = [line for line in f if line.startswith("MemAvailable:")]
    return int(free[0].split()[1]) * 1024 if free else 1 << 62


def check_memory(config: dict, checkpoint: Path, batch: int, length: int, dtype: torch.dtype, device,
                 workspace: int = 0) -> None:
    """Refuse, before loading anything, a KV cache that would not fit next to the weights (and `workspace`
    bytes more: the engine's graph pool, its steps' largest buffers)."""
    from safetensors import safe_open

    a = config["args"]
    kv = 2 * a.n_layers * batch * a.n_kv_heads * length * a.head_dim * dtype.itemsize
    weights = 0
    try:
        with safe_open(checkpoint / "model.safetensors", framework="pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                itemsize = dtype.itemsize if s.get_dtype() in ("BF16", "F16", "F32") else 1
                weights += math.prod(s.get_shape()) * itemsize
    except Exception:  # unreadable: from_checkpoint reports it properly
        return
    free = available_memory(device)
    if kv + weights + workspace > free:
        raise UsageError(f"the KV cache ({kv / 2**30:.1f} GiB for batch {batch} x {length} tokens) and weights "
                         f"({weights / 2**30:.1f} GiB) do not fit in the {free / 2**30:.1f} GiB free on {device}; "
                         f"ask for fewer tokens or rows")
