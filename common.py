"""What several modules share, below all of them: graph-safe sampling (fixed-shape ops, no host sync:
sampling stays inside the step's one CUDA graph), the decode modes, the cache directory, dtypes."""
import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cache_dir() -> Path:
    """Where the default model, the CPU kernels and the ahead-of-time steps are kept."""
    return Path(os.environ.get("GRAPHDECODE_CACHE", Path.home() / ".cache" / "graphdecode"))


def compiled(fn, mode: str, device: torch.device, dynamic: bool | None = None):
    """fn as decode runs it: "eager"; "compile", Inductor's kernels launched one by one (on the CPU not
    handing decode's small loops to OpenMP threads); "graphs", those kernels replayed as CUDA graphs.
    dynamic=False: one static compilation per input shape (serve.py's buckets), never a dynamic one."""
    if mode == "eager":
        return fn
    if mode == "compile":
        return torch.compile(fn, fullgraph=True, dynamic=dynamic,
                             options={"cpp.min_chunk_size": 65536} if device.type == "cpu" else None)
    if mode != "graphs":
        raise ValueError(f"unknown decode mode {mode!r}")
    if device.type != "cuda":
        raise ValueError("mode 'graphs' needs a CUDA device")
    return torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=dynamic)


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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class UsageError(Exception):
    """Bad input from the user: printed as one `error:` line, exit status 1."""


class ConversionError(Exception):
    """A problem with a checkpoint to convert, reported as one line by the CLI."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8  # 0: greedy
    top_k: int | None = 200
    top_p: float | None = None

    def check(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise UsageError(f"--temperature must be >= 0 (got {self.temperature})")
        if self.top_k is not None and not 1 <= self.top_k:
            raise UsageError(f"--top-k must be >= 1 (got {self.top_k})")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1] (got {self.top_p})")


def logits_to_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [B, V] -> sampling distribution [B, V] in float32."""
    logits = logits.float() / s.temperature
    if s.top_k is not None and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p is not None and s.top_p < 1:
        # Keep the smallest prefix of the sorted distribution whose mass reaches top_p: a token is
        # dropped when the mass before it already does. Full-vocabulary sort: a fixed shape.
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= s.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor) -> torch.Tensor:
    """probs [..., V] (need not be normalised) -> one draw per row [...]. argmax(p / E) with
    E ~ Exponential(1) draws from p (the exponential race) without torch.multinomial, which syncs
    with the host."""
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(-1)


def sample(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    if s.temperature == 0:
        return logits.argmax(-1)
    return draw(logits_to_probs(logits, s))


def available_memory(device: torch.device) -> int:
    """Bytes free on the device (the CPU: MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        free = [line for line in f if line.startswith("MemAvailable:")]
    return int(free[0].split()[1]) * 1024 if free else 1 << 62


def check_memory(config: dict, checkpoint: Path, batch: int, length: int, dtype: torch.dtype, device) -> None:
    """Refuse, before loading anything, a KV cache that would not fit next to the weights."""
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
    if kv + weights > free:
        raise UsageError(f"the KV cache ({kv / 2**30:.1f} GiB for batch {batch} x {length} tokens) and weights "
                         f"({weights / 2**30:.1f} GiB) do not fit in the {free / 2**30:.1f} GiB free on {device}; "
                         f"lower --max-new-tokens (or, with --prompts-file, --max-batch)")
