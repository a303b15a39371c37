#!/usr/bin/env bash
# The H200 runs behind BENCHMARKS.md's current tables (runs 9 and 10, 2026-11-29), as the device
# session ran them (four calls: a, b, c1, c2). Usage: OUT=dir bash benchmarks/h200_run.sh [a|b|c1|c2]...
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
for part in "${@:-a b c1 c2}"; do case $part in
  a)  # run 9 (before the fused GEMVs): first call with and without the opaque custom op, cold then warm
      bench7b a1; bench7b a2 --opaque-gemv; bench7b a2 --opaque-gemv; bench7b a1 ;;
  b)  # run 9: speculative decoding (draft = target in int4-g32, temperature 1, K=4); int4 g128
      t 420 python3 bench.py --model llama-2-7b --modes graphs --batch-sizes 1 --temperature 1 --speculate-k 4 \
        --draft-quantize int4-g32 --json "$OUT/spec.json"
      t 150 python3 bench.py --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int4-g128 --json "$OUT/int4g128.json" ;;
  c1) # run 10 (fused GEMVs): GPU tests, then 7B bf16 batch 1 cold, with and without the opaque op
      t 240 python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_cuda.py tests/test_kernels.py
      bench7b c1 --kernels; bench7b c2 --opaque-gemv ;;
  c2) # run 10: int8 7B and bf16 Llama-3.1-8B, batch 1
      t 150 python3 bench.py --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int8 --json "$OUT/int8.json"
      t 160 python3 bench.py --model llama-3.1-8b --modes graphs --batch-sizes 1 --json "$OUT/8b.json" ;;
esac; done
