#!/usr/bin/env bash
# The GPU runs behind BENCHMARKS.md's tables, on one H200, each part in one process per configuration.
# Records (bench.py's JSON) go to $OUT (default benchmarks/records). Parts, in any order:
#   tests    pytest -m cuda, the kernel tests on the GPU, and bench.py's smoke check (--check-graphs)
#   decode   Llama-2-7B bf16 B=1,8, int8 and int4 g32 B=1, and bf16 B=1 --no-kernels (records: decode.json)
#   gains    benchmarks/kernel_gains.py: the reference path, then each kernel, then all
#   models   Llama-3.1-8B and SmolLM2-135M shapes, bf16 B=1
#   profile  benchmarks/step_profile.py: what each kernel adds to the batch-1 step, Llama-3.2-1B and SmolLM2-135M
#   serving  benchmarks/serving.py: the engine (Llama-2-7B shape at 64 and 128 rows, three prefill budgets at
#            64; SmolLM2's shape: its bucket-1 step against Generator's); benchmarks/serving.py: bucket pools and
#            padding by hand, K-step rounds
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/records}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
B="--modes graphs --repeat 2"
bench() { python3 bench.py "$@" --json "$OUT/decode.json"; }
for part in "$@"; do
  echo "== $part $(date -u +%H:%M:%S)"
  case $part in
    tests) python3 -m pytest -q -x -m cuda tests
           python3 -m pytest -q -x tests/test_kernels.py
           python3 bench.py --model smollm2-135m --modes graphs --batch-sizes 1,8 --new-tokens 32 --check-graphs ;;
    decode) bench --model llama-2-7b $B --batch-sizes 1,8
            bench --model llama-2-7b $B --batch-sizes 1 --quantize int8
            bench --model llama-2-7b $B --batch-sizes 1 --quantize int4-g32
            bench --model llama-2-7b $B --batch-sizes 1 --no-kernels ;;
    gains) for q in "" "--quantize int8" "--quantize int4-g32"; do
             python3 benchmarks/kernel_gains.py --model llama-2-7b $q --json "$OUT/gains.json"
           done ;;
    models) bench --model llama-3.1-8b $B --batch-sizes 1
            bench --model smollm2-135m $B --batch-sizes 1 ;;
    profile) for m in llama-3.2-1b smollm2-135m; do python3 benchmarks/step_profile.py --model $m --trace "$OUT/profile-$m.json"; done ;;
    serving) S="--requests 256 --modes graphs --json $OUT/serving.json"
             python3 benchmarks/serving.py --model llama-2-7b $S --max-batch 64 --prefill-budget 512,1024,2048 --alone 0
             python3 benchmarks/serving.py --model llama-2-7b $S --max-batch 128 --alone 0  # (256 rows: 128 GiB of KV)
             python3 benchmarks/serving.py --model smollm2-135m $S --max-batch 64 --alone 8
             python3 benchmarks/serving.py --model llama-2-7b --parts pools,padding,steps --json "$OUT/serving.json"
             python3 benchmarks/serving.py --model smollm2-135m --parts steps --json "$OUT/serving.json" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
