"""Instructions a weight in the main loop of cuda_kernels.py's one-row GEMV, counted in its sm_90 machine
code, compiled here without a GPU (Triton's own ptxas and cuobjdump; the pip package of Triton has
both). This is how the float16-pair int8 path (cuda_kernels.INT8_HALF) was sized before any GPU run:
each launch of the 7B shapes with its fusions, in bf16, int8 float32 and int8 float16 pairs (for
wo and w2, which cuda_kernels.use_half leaves in float32, at the float16 launch: what they would run).

    python benchmarks/sass_count.py

The count is of one thread's loop body (the longest backward branch) times the program's threads,
over the weights one iteration reads; Triton 3.9 here, 3.6 on the H200, so a lead, not a measurement.
"""
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import cuda_kernels  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*i8", "scale_ptr": "*bf16", "g_ptr": "*bf16", "r_ptr": "*bf16",
             "y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "blocks_per_split": "i32", "eps": "fp32"}


def loop_counts(constants: dict, warps: int, stages: int, weight_type: str) -> tuple[int, collections.Counter]:
    """(instructions, opcode counts) of the main loop of _gemv_kernel compiled for sm_90."""
    fn = cuda_kernels._gemv_kernel
    signature = {**SIGNATURE, "w_ptr": weight_type, **{k: "constexpr" for k in constants}}
    names = list(fn.arg_names)  # pointers and sizes divisible by 16, as Triton specialises them at run time
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, t in SIGNATURE.items()
             if t.startswith("*") or k in ("N", "K")}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    cubin = Path("/tmp") / f"sass_count_{os.getpid()}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(BIN / "cuobjdump"), "--dump-sass", str(cubin)], capture_output=True, text=True).stdout
    cubin.unlink()
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    at = [int(re.match(r"\s+/\*([0-9a-f]{4})\*/", line).group(1), 16) for line in lines]
    loop = None  # the longest backward branch
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+0x([0-9a-f]+)", line)
        if m and int(m.group(1), 16) < at[i] and (loop is None or at[i] - int(m.group(1), 16) > loop[1] - loop[0]):
            loop = (int(m.group(1), 16), at[i])
    body = [line for line, a in zip(lines, at) if loop and loop[0] <= a <= loop[1]]
    ops = collections.Counter(re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", line).split()[0].split(".")[0]
                              for line in body)
    return len(body), ops


def main():
    import bench

    a = bench.PRESETS["llama-2-7b"]
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    layers = [("wqkv", q + 2 * kv, a.dim, dict(NORM=True)), ("wo", a.dim, q, dict(RESIDUAL=True)),
              ("w13", 2 * a.intermediate_size, a.dim, dict(NORM=True, SWIGLU=True)),
              ("w2", a.dim, a.intermediate_size, dict(RESIDUAL=True)), ("head", a.vocab_size, a.dim, dict(NORM=True))]
    print(f"{'layer':6s} {'weights':16s} {'launch':22s} {'instr/weight':>12s}  top opcodes")
    for name, N, K, fused in layers:
        for kind, half in (("bf16", False), ("int8", False), ("int8", True)):
            swiglu = fused.get("SWIGLU", False)
            launch = cuda_kernels.config(kind, 1, N, K, swiglu, half)
            block_n, block_k, _, warps, stages = launch
            constants = dict(INT8=kind == "int8", EVEN=K % block_k == 0, NORM=fused.get("NORM", False),
                             RESIDUAL=fused.get("RESIDUAL", False), SWIGLU=swiglu, BLOCK_M=1, BLOCK_N=block_n,
                             BLOCK_K=block_k, PDL=True, HALF=half, EMULATE=False)
            n, ops = loop_counts(constants, warps, stages, "*bf16" if kind == "bf16" else "*i8")
            per_weight = n * warps * 32 / (block_n * block_k * (2 if swiglu else 1))
            label = kind + (" float16 pairs" if half else " float32" if kind == "int8" else "")
            print(f"{name:6s} {label:16s} {str(launch):22s} {per_weight:12.2f}  "
                  + ", ".join(f"{k} {v}" for k, v in ops.most_common(6)), flush=True)


if __name__ == "__main__":
    main()
