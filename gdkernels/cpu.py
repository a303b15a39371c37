"""The CPU decode matmuls for int4 and int8 weights and attention over a static cache (cpu.cpp), built
with the system C++ compiler on first use.

`int4_linear(x, weight, scales, zeros)` and `int8_linear(x, weight, scales)` (weights interleaved from the file's
layout by `interleave`) multiply float32 rows by the quantized weights in integer instructions (AVX2, or AVX-512
VNNI's where the CPU has them: the library is built for the machine it runs on), with x carried in two int8 parts
per block of 32 columns (~1/32000 of the block's largest value: closer than bf16); on the default model's shapes
int4 runs at ~2.2x PyTorch's `_weight_int4pack_mm_for_cpu` (BENCHMARKS.md). `attention(q, k, v, pos)` reads
each query's keys up to its position only: a step costs what its position costs, not what the cache
holds, and one ahead-of-time build (aot.py) serves every length. `available()` builds the
library once into common.cache_dir() / "cpu_kernels" (~15 s; keyed by the source, torch version
and flags), loads it and registers the ops (graphdecode::int4_linear, int8_linear, attention) for
torch.compile; it returns False, after saying why on stderr once, on a CPU without AVX2 or without a
compiler, and callers then use PyTorch's ops.
"""
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import common

SOURCE = Path(__file__).with_name("cpu.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-w"]
_loaded: bool | None = None  # None: not tried yet


def available() -> bool:
    """Whether torch.ops.graphdecode.int4_linear can run here (built and loaded on the first call)."""
    global _loaded
    if _loaded is None:
        why = unsupported()
        if why is None:
            try:
                torch.ops.load_library(str(_build()))
                torch.library.register_fake("graphdecode::int4_linear")(_linear_fake)
                torch.library.register_fake("graphdecode::int8_linear")(_linear_fake)
                torch.library.register_fake("graphdecode::attention")(lambda q, *kv_pos: torch.empty_like(q))
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                why = f"building {SOURCE.name} failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
        if why is not None:
            print(f"note: int4 and int8 on the CPU use PyTorch's kernels ({why})", file=sys.stderr)
        _loaded = why is None
    return _loaded


def unsupported() -> str | None:
    """Why cpu.cpp cannot run on this machine, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() not in (
            "AVX2", "AVX512"):
        return f"this CPU lacks AVX2 ({platform.machine()}, {torch.backends.cpu.get_cpu_capability()})"
    return None


def _build() -> Path:
    from torch.utils import cpp_extension

    libs = cpp_extension.library_paths()
    command = [os.environ.get("CXX", "g++"), *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *[f"-I{p}" for p in cpp_extension.include_paths()], str(SOURCE),
               *[f"-L{p}" for p in libs], "-lc10", "-ltorch_cpu", *[f"-Wl,-rpath,{p}" for p in libs]]
    flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")][:1] \
        if Path("/proc/cpuinfo").is_file() else [platform.processor()]  # (-march=native: this CPU's instructions)
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([torch.__version__, *command, *flags]).encode()).hexdigest()[:16]
    out = common.cache_dir() / "cpu_kernels" / f"cpu-{key}.so"
    if not out.is_file():
        print(f"building {SOURCE.name} (once, ~15 s) into {out.parent}", file=sys.stderr, flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")  # then renamed: never a half-written library
        os.close(fd)
        try:
            result = subprocess.run([*command, "-o", tmp], capture_output=True, text=True)
            if result.returncode:
                raise RuntimeError((result.stderr.strip() or f"{command[0]} exited with {result.returncode}"))
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def _linear_fake(x, weight, *scales_and_zeros):
    return x.new_empty(x.shape[0], weight.shape[0])


def block_params(scales: torch.Tensor, zeros: torch.Tensor, groupsize: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group scales and zeros [N, ceil(K/G)] -> the kernel's bf16 [N, Bp]: one per block of 32
    columns, Bp = K/32 rounded up to a multiple of 8, padded with zeros."""
    blocks = K // 32
    group = torch.arange(blocks) * 32 // groupsize  # block -> its group
    padded = -(-blocks // 8) * 8
    return tuple(torch.nn.functional.pad(t[:, group].to(torch.bfloat16), (0, padded - blocks)).contiguous()
                 for t in (scales, zeros))


def interleave(w: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """A weight's rows [N, bytes] (int4: 16 bytes a block of 32 columns, int8: 32) -> the kernels' layout, where
    each 32 bytes hold 4 bytes of each of 8 blocks (a last chunk of fewer blocks: 4 bytes of each of those);
    inverse: back to the file's layout."""
    N, size = w.shape
    blocks, per = size // 16 if w.dtype == torch.uint8 else size // 32, 4 if w.dtype == torch.uint8 else 8
    parts = []
    for start in range(0, blocks, 8):  # [N, blocks, 4-byte groups, 4] <-> [N, groups, blocks, 4]
        n = min(8, blocks - start)
        part = w[:, start * per * 4:(start + n) * per * 4]
        shape = (N, per, n, 4) if inverse else (N, n, per, 4)
        parts.append(part.reshape(shape).transpose(1, 2).reshape(N, -1))
    return torch.cat(parts, 1).contiguous()


def _check() -> None:
    if not _loaded and not available():
        raise RuntimeError("gdkernels/cpu.cpp cannot run here (see the note above)")


def int4_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W.T -> [M, N] float32, W = (q - 8) * scales + zeros per block of 32
    (block_params); weight uint8 [N, K/2] interleaved."""
    _check()
    return torch.ops.graphdecode.int4_linear(x, weight, scales, zeros)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """q [B, H, S, D] float32, k and v a cache's first B rows [B, Hkv, L, D] (float32 or bf16), pos [S] or
    [B, S] -> [B, H, S, D] float32: each query over the keys up to its position, reading no others."""
    _check()
    return torch.ops.graphdecode.attention(q, k, v, pos)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ (weight * scales[:, None]).T -> [M, N] float32; weight int8 interleaved, scales float32."""
    _check()
    return torch.ops.graphdecode.int8_linear(x, weight, scales)
