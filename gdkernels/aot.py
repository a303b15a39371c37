"""The CPU's decode step compiled ahead of time: torch.export + AOTInductor, cached on disk.

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
from pathlib import Path

import torch

from common import cache_dir

HERE = Path(__file__).resolve().parent
# What the compiled step runs, besides the step function's own file
SOURCES = [HERE.parent / "model.py", HERE.parent / "quantize.py", HERE / "__init__.py", HERE / "cpu.py",
           HERE / "cpu.cpp"]
OPTIONS = {"cpp.min_chunk_size": 65536}  # (Inductor on the CPU: see generate.Generator)


class _Step(torch.nn.Module):
    def __init__(self, step, model, s):
        super().__init__()
        self.step, self.model, self.s = step, model, s

    def forward(self, token, pos, tokens):
        self.step(self.model, token, pos, tokens, self.s)


class AotStep:
    """step(model, token, pos, tokens, sampling) -- generate.decode_one_token -- compiled ahead of time
    on its first call. With build=False a missing package means the eager step; if exporting or
    compiling fails, torch.compile, with a note."""

    def __init__(self, step, build: bool = True):
        self.step, self.build, self.runner = step, build, None
        self.ran = None  # which step ran, in words (generate.py's stats say it)

    def __call__(self, model, token, pos, tokens, s):
        if self.runner is None:
            self.runner = self._load_or_build(model, token, pos, tokens, s)
        self.runner(model, token, pos, tokens, s)

    def key(self, model, token, tokens, s) -> str:
        sources = [Path(inspect.getfile(self.step)), *SOURCES]
        h = hashlib.sha256(b"".join(f.read_bytes() for f in sources))
        state = [(n, list(t.shape), str(t.dtype)) for n, t in [*model.named_parameters(), *model.named_buffers()]]
        h.update(json.dumps([model.args.to_dict(), state, list(token.shape), list(tokens.shape), repr(s),
                             torch.__version__, torch.backends.cpu.get_cpu_capability()]).encode())
        return h.hexdigest()[:20]

    def _load_or_build(self, model, token, pos, tokens, s):
        path = cache_dir() / "aot" / f"decode-{self.key(model, token, tokens, s)}.pt2"
        if not path.is_file() and not self.build:
            self.ran = "eager (--compile builds a step ahead of time for this model, batch and cache length, ~80 s)"
            return self.step
        try:
            if not path.is_file():
                self._build(model, token, pos, tokens, s, path)
            # PyTorch's C++ loader: torch._inductor.aoti_load_package would first import Inductor,
            # 2.6 s of every start; this takes milliseconds.
            loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
            constants = {**dict(model.named_parameters()), **dict(model.named_buffers())}
            constants = {n: constants[n.removeprefix("model.")] for n in loader.get_constant_fqns()}
            loader.load_constants(constants, False, True, True)  # (use_inactive, check_full_update, user_managed)
        except Exception as e:  # noqa: BLE001 (whatever export or the compiler raised: decode still runs)
            print(f"note: compiling decode ahead of time failed ({type(e).__name__}: "
                  f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); using torch.compile",
                  file=sys.stderr)
            self.ran = "torch.compile (building ahead of time failed)"
            return torch.compile(self.step, fullgraph=True, options=OPTIONS)
        self.ran = "compiled ahead of time"
        return lambda model, token, pos, tokens, s: loader.boxed_run([token, pos, tokens])

    def _build(self, model, token, pos, tokens, s, path: Path):
        with warnings.catch_warnings():  # torch's own pytree deprecation (LeafSpec) inside export: not the user's
            warnings.simplefilter("ignore", FutureWarning)
            self._export_and_compile(model, token, pos, tokens, s, path)

    def _export_and_compile(self, model, token, pos, tokens, s, path: Path):
        from . import register_fallbacks

        print(f"compiling the decode step ahead of time, once for this model, batch and cache length "
              f"(~80 s for the default model) into {path.parent}", file=sys.stderr, flush=True)
        register_fallbacks()
        exported = torch.export.export(_Step(self.step, model, s), (token, pos, tokens))  # (fake tensors)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".pt2")  # renamed when complete
        os.close(fd)
        try:
            torch._inductor.aoti_compile_and_package(exported, package_path=tmp, inductor_configs={
                **OPTIONS,
                "fallback_random": True,  # sampling draws from PyTorch's generator: --seed holds
                "aot_inductor.package_constants_in_so": False})  # the weights come from the model
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
