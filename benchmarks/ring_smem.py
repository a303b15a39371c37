"""Where int4_ring.py's kernel keeps things in shared memory, compiled here for sm_90 without a GPU, and whether the
compiler laid any scratch (a cross-warp sum, a layout change) over one of the kernel's own buffers.

Session 28 found that way why one-byte codes gave wrong numbers in the GEMVs with the norm: without zeros, x's sums
were copied (cp.async) into a buffer nothing read; the allocator counted it dead and put the norm's sum at its
offset while the copy was still landing. (_x_stage no longer copies them there.) This prints each buffer's and each
scratch's [start, end) from the IR after shared-memory allocation (MLIR_ENABLE_DUMP, in a child process) and exits 1
if a scratch overlaps a buffer (2: a variant did not compile; 3: no offsets found in the IR). Any overlap counts,
whether or not the buffer is live there: a scratch over a buffer that is only written is the bug above. Triton
3.6's names are mapped to newer Triton's where they were renamed.

    python benchmarks/ring_smem.py [--variants int16,int8] [--norm 0,1] [--swiglu 0,1] [--masked 0,1]
        [--one-sum 0,1]
        [--n 4096 --k 4096 --stages 6]
"""
import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BYTES = {"i8": 1, "i16": 2, "i32": 4, "f32": 4, "i64": 8, "bf16": 2, "f16": 2}


def compile_variant(codes_dtype: str, norm: bool, swiglu: bool, N: int, K: int, stages: int,
                    masked: bool = False, one_sum: bool = False) -> int:
    """Compile the kernel (child process): its shared memory in bytes."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT))
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.language._core import shared_memory_descriptor
    from triton.runtime.jit import mangle_type

    import int4_ring

    # newer Triton's names for what int4_ring.py calls by Triton 3.6's
    if hasattr(int4_ring.tma, "async_load"):
        int4_ring.tma.async_copy_global_to_shared = int4_ring.tma.async_load
    if hasattr(int4_ring.async_copy, "async_load"):
        int4_ring.async_copy.async_copy_global_to_shared = int4_ring.async_copy.async_load
    if not hasattr(gl, "thread_barrier"):
        gl.thread_barrier = gl.barrier
    if not hasattr(shared_memory_descriptor, "_reinterpret"):
        shared_memory_descriptor._reinterpret = shared_memory_descriptor.reinterpret
    rows = int4_ring.XG
    R = 2 * N if swiglu else N
    words = torch.zeros(R, K // 8, dtype=torch.int32)
    codes = torch.zeros(R, K // 32, dtype=torch.int16)
    codes = codes if codes_dtype == "int16" else int4_ring.code_bytes(codes)  # (rows padded to 16 bytes)
    w_desc, c_desc = int4_ring.descriptors(words, codes, rows)
    mangle = (lambda d: d.__mangle__()) if hasattr(w_desc, "__mangle__") else mangle_type  # (Triton 3.6: no __mangle__)
    signature = {"w_desc": mangle(w_desc), "c_desc": mangle(c_desc), "xw_ptr": "*i32", "xs_ptr": "*fp32",
                 "u_ptr": "*fp32", "r_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32", "K": "i32", "eps": "fp32",
                 "w_unscale": "fp32", "yw_ptr": "*i32", "ys_ptr": "*fp32", "go_ptr": "*bf16"}
    constants = dict(NORM=norm, RESIDUAL=False, SWIGLU=swiglu, BN=rows, CHUNKS=-(-(K // 8) // int4_ring.CHUNK),
                     NX_P2=triton.next_power_of_2(K // int4_ring.XG), STAGES=stages, XQ_OUT=True, GO=False,
                     ZEROS=codes_dtype == "int16", MASKED=masked, ONE_SUM=one_sum)
    signature.update({k: "constexpr" for k in constants})
    src = GluonASTSource(fn=int4_ring._int4_gemv_ring_kernel, signature=signature, constexprs=constants)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": int4_ring.WARPS})
    return compiled.metadata.shared


def regions(ir: str) -> tuple[dict, list]:
    """({buffer name: (start, end)}, [(op, start, end)] of scratch) from IR with allocation offsets."""
    buffers, scratch = {}, []
    for line in ir.splitlines():
        m = re.search(r"%(\w+) = ttg\.local_alloc \{allocation\.offset = (\d+) : i32\} : \(\) -> !ttg\.memdesc<([\dx]+)x(\w+),",
                      line)
        if m:
            size = BYTES[m.group(4)]
            for d in m.group(3).split("x"):
                size *= int(d)
            buffers[m.group(1)] = (int(m.group(2)), int(m.group(2)) + size)
            continue
        m = re.search(r"allocation\.offset = (\d+) : i32, allocation\.size = (\d+) : i32", line)
        if m:
            op = re.search(r"= ([\w.]+) ", line)
            name = "tt.reduce" if line.strip().startswith("})") else op.group(1) if op else "?"
            scratch.append((name, int(m.group(1)), int(m.group(1)) + int(m.group(2))))
    return buffers, scratch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="int16,int8", help="codes: int16 (scale and zero) and/or int8 (scale)")
    p.add_argument("--norm", default="0,1", help="NORM off and/or on")
    p.add_argument("--swiglu", default="0", help="SWIGLU off and/or on")
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--stages", type=int, default=6)
    p.add_argument("--masked", default="0", help="int4_ring.MASKED off and/or on")
    p.add_argument("--one-sum", default="0", help="int4_ring.ONE_SUM off and/or on")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("shared", compile_variant(a.child[0], a.child[1] == "1", a.child[2] == "1", a.n, a.k, a.stages,
                                        a.child[3] == "1", a.child[4] == "1"), flush=True)
        return 0
    env = dict(os.environ, MLIR_ENABLE_DUMP="1", TRITON_ALWAYS_COMPILE="1")
    env.pop("TRITON_INTERPRET", None)
    bad = False
    for codes, norm, swiglu, masked, one in ((c, n, g, m, o) for c in a.variants.split(",") for n in a.norm.split(",")
                                             for g in a.swiglu.split(",") for m in a.masked.split(",")
                                             for o in a.one_sum.split(",")):
        name = f"codes {codes}, norm {norm}, swiglu {swiglu}" + (", masked" if masked == "1" else "") \
            + (", one sum" if one == "1" else "")
        run = subprocess.run([sys.executable, __file__, "--child", codes, norm, swiglu, masked, one, "--n", str(a.n),
                              "--k", str(a.k), "--stages", str(a.stages)], env=env, capture_output=True, text=True)
        if run.returncode:
            print(f"error: compiling {name} failed:\n{run.stderr[-2000:]}", file=sys.stderr)
            return 2
        dumps = re.split(r"// -----// IR Dump", run.stderr + run.stdout)
        buffers, scratch = regions(next((d for d in dumps if "allocation.offset" in d), ""))
        if not buffers:
            print(f"error: no allocation offsets in the IR dump ({name})", file=sys.stderr)
            return 3
        shared = re.search(r"^shared (\d+)", run.stdout, re.M)
        print(f"{name}: {shared.group(1) if shared else '?'} bytes of shared memory")
        for buffer, (s, e) in sorted(buffers.items(), key=lambda kv: kv[1]):
            print(f"  {buffer:8s} [{s:6d}, {e:6d})")
        for op, s, e in scratch:
            hit = [n for n, (bs, be) in buffers.items() if s < be and bs < e]
            bad |= bool(hit)
            print(f"  scratch of {op} [{s:6d}, {e:6d})" + (f"  OVERLAPS {', '.join(hit)}" if hit else ""))
    print("a scratch overlaps a buffer" if bad else "no scratch overlaps a buffer")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
