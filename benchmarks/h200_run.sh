#!/usr/bin/env bash
# The H200 runs behind BENCHMARKS.md's current tables: GPU tests first, then bench.py per
# configuration, each record appended to $OUT/*.json. Usage: OUT=dir bash benchmarks/h200_run.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"
t() { timeout "$1" "${@:2}" 2>&1 | grep -v -E "Warning|warn\(" ; }
t 150 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_kernels.py
t 200 python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_cuda.py tests/test_kernels.py
t 170 python3 bench.py --model llama-2-7b --modes graphs --batch-sizes 1,8 --json "$OUT/bf16.json" | tail -4
t 120 python3 bench.py --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int8 --json "$OUT/int8.json" | tail -3
t 120 python3 bench.py --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int4-g32 --json "$OUT/int4.json" | tail -3
t 120 python3 bench.py --model llama-3.1-8b --modes graphs --batch-sizes 1 --json "$OUT/8b.json" | tail -3
