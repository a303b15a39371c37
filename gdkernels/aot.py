"""The CPU's decode step compiled ahead of time: torch.export + AOTInductor, cached on disk.

One build serves every prompt and output length: the cache has a fixed length (cache_length: the
model's context where its cache is small enough), and cpu.cpp's attention reads each row's keys up to
its position only, so a short generation in a long cache costs what it costs in a short one.

torch.compile traces the model again in every new process (~11 s for the default model, ~85 s
cold); AotStep compiles once, into a package in $GRAPHDECODE_CACHE/aot/ (by default
~/.cache/graphdecode/aot/) keyed by what the compiled code depends on (the model's architecture and
parameter shapes, batch, cache length, sampling, torch version, the source files), and a later
process loads it in milliseconds. The package holds no weights: its constants (weights, KV cache,
RoPE tables) are the model's own tensors, handed over at load (user-managed), so the prefill's
cache writes are the ones decode reads, and any checkpoint of the same shapes reuses it.
"""
import hashlib
import inspect
import json
import os
import sys
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

import common
from common import cache_dir

HERE = Path(__file__).resolve().parent
# What the compiled step runs, besides the step function's own file
SOURCES = [HERE.parent / "model.py", HERE.parent / "quantize.py", HERE.parent / "common.py", HERE / "__init__.py",
           HERE / "cpu.py", HERE / "cpu.cpp"]
CACHE_BYTES = 2 << 30  # the fixed-length cache is halved while it would take more than this


def cache_length(need: int, args, dtype: torch.dtype, rows: int = 1) -> int:
    """Positions the cache holds for the step built ahead of time, the same whatever `need` (a prompt and its
    output): the model's context, halved while the cache (of `rows` rows) passes CACHE_BYTES and the half still
    holds need.
    Without cpu.cpp's attention (which reads up to each position only) the step would read the whole
    cache: common.cache_length's rounding then."""
    from . import cpu

    if not cpu.available():
        return common.cache_length(need, args.max_seq_len)
    length, per_position = args.max_seq_len, 2 * rows * args.n_layers * args.n_kv_heads * args.head_dim * dtype.itemsize
    while length // 2 >= need and length * per_position > CACHE_BYTES:
        length //= 2
    return length


class _Step(torch.nn.Module):
    """step(model, *args) as a module of the tensors among args (what export traces); the rest are constants."""

    def __init__(self, step, model, args):
        super().__init__()
        self.step, self.model = step, model
        self.constants = [None if isinstance(a, torch.Tensor) else a for a in args]

    def forward(self, *tensors):
        it = iter(tensors)
        self.step(self.model, *(next(it) if c is None else c for c in self.constants))


class AotStep:
    """step(model, *args) -- generate.decode_one_token, serve.serve_step -- compiled ahead of time on its first
    call for each set of shapes (the engine's buckets), non-tensor args built in. With build=False a missing
    package means the eager step; if exporting or compiling fails, torch.compile, with a note."""

    def __init__(self, step, build: bool = True):
        self.step, self.build, self.runners = step, build, {}
        self.ran = None  # which step ran, in words (generate.py's stats say it)

    def __call__(self, model, *args):
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        if shapes not in self.runners:
            self.runners[shapes] = self._load_or_build(model, args)
        self.runners[shapes](model, *args)

    def key(self, model, *args) -> str:
        sources = [Path(inspect.getfile(self.step)), *SOURCES]
        h = hashlib.sha256(b"".join(f.read_bytes() for f in sources))
        state = [(n, list(t.shape), str(t.dtype)) for n, t in [*model.named_parameters(), *model.named_buffers()]]
        h.update(json.dumps([asdict(model.args), state, [list(a.shape) if isinstance(a, torch.Tensor) else repr(a)
                                                           for a in args],
                             torch.__version__, torch.backends.cpu.get_cpu_capability()]).encode())
        return h.hexdigest()[:20]

    def _load_or_build(self, model, args):
        path = cache_dir() / "aot" / f"{self.step.__name__}-{self.key(model, *args)}.pt2"
        if not path.is_file() and not self.build:
            self.ran = "eager (--compile builds a step ahead of time once for this model, batch and sampling, ~40-80 s)"
            return self.step
        try:
            if not path.is_file():
                self._build(model, args, path)
            # PyTorch's C++ loader: torch._inductor.aoti_load_package would first import Inductor at every start.
            loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
            constants = {**dict(model.named_parameters()), **dict(model.named_buffers())}
            constants = {n: constants[n.removeprefix("model.")] for n in loader.get_constant_fqns()}
            loader.load_constants(constants, False, True, True)  # (use_inactive, check_full_update, user_managed)
        except Exception as e:  # noqa: BLE001 (whatever export or the compiler raised: decode still runs)
            print(f"note: compiling decode ahead of time failed ({type(e).__name__}: "
                  f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); using torch.compile",
                  file=sys.stderr)
            self.ran = "torch.compile (building ahead of time failed)"
            return torch.compile(self.step, fullgraph=True, options=common.CPU_OPTIONS)
        self.ran = "compiled ahead of time"
        return lambda model, *args: loader.boxed_run([a for a in args if isinstance(a, torch.Tensor)])

    def _build(self, model, args, path: Path):
        from . import register_fallbacks

        print(f"building the decode step once for this model, batch and sampling (~40-80 s; any prompt and "
              f"output length reuses it), cached in {path.parent}", file=sys.stderr, flush=True)
        register_fallbacks()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".pt2")  # renamed when complete
        os.close(fd)
        try:
            with warnings.catch_warnings():  # torch's own pytree deprecation (LeafSpec) inside export: not the user's
                warnings.simplefilter("ignore", FutureWarning)
                exported = torch.export.export(_Step(self.step, model, args),
                                               tuple(a for a in args if isinstance(a, torch.Tensor)))
                torch._inductor.aoti_compile_and_package(exported, package_path=tmp, inductor_configs={
                    **common.CPU_OPTIONS,
                    "fallback_random": True,  # sampling draws from PyTorch's generator: --seed holds
                    "aot_inductor.package_constants_in_so": False})  # the weights come from the model
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
