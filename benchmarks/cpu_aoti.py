"""Probe: the CPU decode step ahead of time, through torch.export and AOTInductor (issue 3: a warm
`generate.py` must finish 128 tokens in <= 10 s, and torch.compile re-traces the model in every new
process, ~12 s warm). Compiles model(token, pos) -> argmax for a checkpoint into a .pt2 package
once, then, in a fresh process, loads it and times greedy decode, against the eager model on the
same weights (first-step logits and tokens).

    python benchmarks/cpu_aoti.py compile CHECKPOINT PACKAGE [--length 256]
    python benchmarks/cpu_aoti.py run CHECKPOINT PACKAGE [--length 256]
"""
import argparse
import sys
import time

T0 = time.perf_counter()
import torch  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import Transformer  # noqa: E402


class Step(torch.nn.Module):
    """One greedy decode step: next token [1, 1] from the last one and its position."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, token, pos):
        return self.model(token, pos)[:, -1].argmax(-1, keepdim=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["compile", "run"])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("package", type=Path)
    p.add_argument("--length", type=int, default=256, help="KV cache positions (fixed in the package)")
    a = p.parse_args()
    model = Transformer.from_checkpoint(a.checkpoint, device="cpu", dtype=torch.float32)
    model.setup_caches(1, a.length)
    loaded = time.perf_counter()
    print(f"import and load: {loaded - T0:.1f} s", flush=True)
    with torch.no_grad():
        if a.what == "compile":
            ep = torch.export.export(Step(model).eval(), (torch.tensor([[1]]), torch.tensor([0])))
            print(f"export: {time.perf_counter() - loaded:.1f} s", flush=True)
            t = time.perf_counter()
            torch._inductor.aoti_compile_and_package(ep, package_path=str(a.package),
                                                     inductor_configs={"cpp.min_chunk_size": 65536})
            print(f"AOTInductor compile: {time.perf_counter() - t:.1f} s", flush=True)
            return
        runner = torch._inductor.aoti_load_package(str(a.package))
        print(f"package load: {time.perf_counter() - loaded:.2f} s", flush=True)
        n = a.length - 16
        token, got = torch.tensor([[1]]), []
        for i in range(8):
            token = runner(token, torch.tensor([i]))
        t = time.perf_counter()
        for i in range(8, 8 + n):
            token = runner(token, torch.tensor([i]))
            got.append(token.item())
        dt = time.perf_counter() - t
        print(f"AOTInductor decode: {n / dt:.1f} tok/s ({n} tokens, cache {a.length})", flush=True)
        model.setup_caches(1, a.length)
        token, ref = torch.tensor([[1]]), []
        for i in range(8 + n):
            token = model(token, torch.tensor([i]))[:, -1].argmax(-1, keepdim=True)
            if i >= 8:
                ref.append(token.item())
        same = next((i for i, (x, y) in enumerate(zip(got, ref)) if x != y), n)
        print(f"greedy tokens equal to eager's for the first {same} of {n}", flush=True)


if __name__ == "__main__":
    main()
