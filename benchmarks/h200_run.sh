#!/usr/bin/env bash
# The H200 runs behind BENCHMARKS.md's current tables (runs 9, 10 and 11, 2026-11-29), as the device
# session ran them (five calls: a, b, c1, c2, d). Usage: OUT=dir bash benchmarks/h200_run.sh [a|b|c1|c2|d]...
# Cold first calls use fresh Inductor/Triton cache directories; a second run on the same directory is warm.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"
t() { timeout "$1" "${@:2}" 2>&1 | grep -v -E "Warning|warn\(" ; }
bench7b() {  # cache-dir flags...
  local d=$1; shift
  TORCHINDUCTOR_CACHE_DIR=/tmp/$d/inductor TRITON_CACHE_DIR=/tmp/$d/triton \
    t 170 python3 bench.py --model llama-2-7b --modes graphs --batch-sizes 1 "$@" --json "$OUT/$d.json"
}
for part in "${@:-a b c1 c2 d}"; do case $part in
  a)  # run 9 (before the fused GEMVs): first call with the traced kernel and through the custom op
      # (then --opaque-gemv; the custom op is now the default and --traced-gemv the other way), cold then warm
      bench7b a1 --traced-gemv; bench7b a2; bench7b a2; bench7b a1 --traced-gemv ;;
  b)  # run 9: speculative decoding (draft = target in int4-g32, temperature 1, K=4); int4 g128
      t 420 python3 bench.py --model llama-2-7b --modes graphs --batch-sizes 1 --temperature 1 --speculate-k 4 \
        --draft-quantize int4-g32 --json "$OUT/spec.json"
      t 150 python3 bench.py --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int4-g128 --json "$OUT/int4g128.json" ;;
  c1) # run 10 (norm, SwiGLU and residual fused: commit 0dd0a51, where the traced kernel was the default):
      # GPU tests, then 7B bf16 batch 1 cold, traced and through the custom op
      t 240 python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_cuda.py tests/test_kernels.py
      bench7b c1 --traced-gemv --kernels; bench7b c2 ;;
  c2) # run 10: int8 7B and bf16 Llama-3.1-8B, batch 1, traced kernel
      t 150 python3 bench.py --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int8 --traced-gemv --json "$OUT/int8.json"
      t 160 python3 bench.py --model llama-3.1-8b --modes graphs --batch-sizes 1 --traced-gemv --json "$OUT/8b.json" ;;
  d)  # run 11 (current code: norm and residual fused, custom op): GPU tests, then 7B fused, unfused, int8
      t 150 python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_cuda.py tests/test_kernels.py
      bench7b d1; bench7b d2 --unfused; bench7b d3 --quantize int8 ;;
esac; done
