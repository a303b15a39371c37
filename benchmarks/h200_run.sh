#!/usr/bin/env bash
# The H200 runs behind BENCHMARKS.md's tables (runs 9-11 of session 3: calls a, b, c1, c2, d; runs 12-15
# of session 4: calls e, f, g, h, i; runs 16-20 of session 5: calls j, k, l, m, n;
# runs 21-23 of session 6: calls p, q, r; 2026-11-29/30; runs 24- of session 7: calls s, ...; 2026-12-01), as the
# device sessions ran them, each part on the code of its own commit.
# Usage: OUT=dir bash benchmarks/h200_run.sh [a|b|c1|c2|d|e|f|g|h|i|j|k|l|m|n|p|q|r|s|...|x]...
# Cold first calls use fresh Inductor/Triton cache directories; a second run on the same directory is warm.
# (kernels.py is cuda_kernels.py since session 28; the parts before it keep the name they ran with.)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"
# bench.py with Python's stacks printed every 40 s (a run that hangs shows where)
watch='import faulthandler, runpy, sys; faulthandler.dump_traceback_later(40, repeat=True); sys.argv[0] = "bench.py"; runpy.run_path("bench.py", run_name="__main__")'
# ... or, after 75 s, the outermost 60 frames of the main thread (less the repeats of a recursion), then exit
outer='import os, runpy, signal, sys, traceback
def dump(sig, frame):
    frames = traceback.extract_stack(frame)
    start = next((i for i, f in enumerate(frames) if f.name == "__str__"), len(frames))
    print(f"-- {len(frames)} frames; the 45 before the first __str__ (frame {start}):", file=sys.stderr)
    for f in frames[max(0, start - 45):start + 1]:
        print("  " + f.filename.split("site-packages/")[-1], f.lineno, f.name, f.line, file=sys.stderr)
    print(f"-- innermost:", file=sys.stderr)
    for f in frames[-4:]:
        print(f"  {f.filename}:{f.lineno} {f.name}: {f.line}", file=sys.stderr)
    sys.stderr.flush(); os._exit(3)
signal.signal(signal.SIGALRM, dump); signal.alarm(int(os.environ.get("ALARM_S", 75))); sys.argv[0] = "bench.py"; runpy.run_path("bench.py", run_name="__main__")'
t() { timeout "$1" "${@:2}" 2>&1 | grep -v -E "Warning|warn\(" ; }
bench7b() {  # cache-dir flags...
  local d=$1; shift
  TORCHINDUCTOR_CACHE_DIR=/tmp/$d/inductor TRITON_CACHE_DIR=/tmp/$d/triton \
    t 170 python3 bench.py --model llama-2-7b --modes graphs --batch-sizes 1 "$@" --json "$OUT/$d.json"
}
gpu_tests() { t "$1" python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_cuda.py tests/test_kernels.py | tail -30; }
variants() {  # name:"flags" ... -> one cold 7B batch-1 bench per entry
  for v in "$@"; do
    d=${v%%:*}; f=${v#*:}
    echo "== $d [$f]"
    # shellcheck disable=SC2086
    bench7b "$d" $f | grep -E "graphs  |_kernel|triton_" | head -14
  done
}
same_cache_benches() {  # part limit-s name:"flags" ... -> 7B batch-1 graphs, --repeat 2, one process each, one after
  # another on one Inductor/Triton cache (/tmp/part; each model's first cold), records in $OUT/h200-part.json,
  # each log in /tmp/name.log: its exit status and result lines
  local part=$1 limit=$2; shift 2
  for v in "$@"; do
    d=${v%%:*}; f=${v#*:}; echo "== $d [$f] $(date +%T)"
    # shellcheck disable=SC2086
    TORCHINDUCTOR_CACHE_DIR=/tmp/$part/inductor TRITON_CACHE_DIR=/tmp/$part/triton timeout -k 5 "$limit" python3 \
      bench.py --model llama-2-7b --modes graphs --batch-sizes 1 --repeat 2 $f --json "$OUT/h200-$part.json" \
      > "/tmp/$d.log" 2>&1; echo "rc $?"; grep -E "graphs  |Error|error" "/tmp/$d.log" | head -5
  done
}
logged_variants() {  # limit-s lines name:"flags" ... -> one cold 7B batch-1 bench per entry, its whole output in
  # $OUT/name.log; shows the exit status and the result lines (lines 0), or the log's last `lines` lines.
  # With JSON=file set: every record in that one file (bench.py appends) and the logs in /tmp (the device tool
  # returns at most 8 files)
  local limit=$1 lines=$2; shift 2
  for v in "$@"; do
    d=${v%%:*}; f=${v#*:}; echo "== $d [$f]"
    local log="$OUT/$d.log"; [ -n "${JSON:-}" ] && log="/tmp/$d.log"
    # shellcheck disable=SC2086
    TORCHINDUCTOR_CACHE_DIR=/tmp/$d/inductor TRITON_CACHE_DIR=/tmp/$d/triton timeout -k 5 "$limit" python3 bench.py \
      --model llama-2-7b --modes graphs --batch-sizes 1 $f --json "${JSON:-$OUT/$d.json}" > "$log" 2>&1
    echo "rc $?"
    if [ "$lines" = 0 ]; then grep -E "graphs  |Error|error" "$log" | head -5
    else grep -v -E "Warning|warn\(" "$log" | tail -"$lines"; fi
  done
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
  e)  # run 12 (commit 30933a0, the attention kernel with a separate merge kernel): GPU tests, 7B with and
      # without the attention kernel, int8, 8B, batch 8
      gpu_tests 230
      variants e1:"--kernels" e2:"--unfused-attention" e3:"--quantize int8" e4:"--model llama-3.1-8b" e5:"--batch-sizes 8" ;;
  f)  # run 13 (SwiGLU in the w13 GEMV, RoPE tables read by the kernel): A/Bs of SwiGLU and of the slices
      gpu_tests 200
      variants f1:"--kernels" f2:"--unfused-swiglu" f3:"--attention-splits 1" f4:"--attention-splits 2" \
               f5:"--attention-splits 8" f6:"--quantize int8" ;;
  g)  # run 14 (slices merged in-kernel): GPU tests, 7B, then the int8 GEMV formulations
      gpu_tests 200
      variants g1:"--kernels"
      t 330 python3 benchmarks/int8_variants.py --budget-s 290 --json "$OUT/int8_variants.json" | tail -40 ;;
  h)  # GEMV launches with the fusions in place (-> kernels.config)
      t 280 python3 benchmarks/gemv.py --model llama-2-7b --kinds bf16,int8 --rows 1 --fused --tune --json "$OUT/tune_fused.json" ;;
  i)  # run 15 (final code of session 4): GPU tests, 7B bf16 cold, 8B, batch 8, int8, int4; then 7B warm
      gpu_tests 200
      variants i1:"--kernels" i2:"--model llama-3.1-8b" i3:"--batch-sizes 8" i4:"--quantize int8" \
               i5:"--quantize int4-g128" i6:"--quantize int4-g32"
      bench7b i1 | tail -1 ;;
  j)  # run 16 (attention hardening; int8-words branch merged for the A/B): GPU tests, 7B b1 and b8 profiles,
      # int8 words on/off, then the 8B fused tuning
      gpu_tests 200
      variants j1:"--kernels" j2:"--batch-sizes 8 --kernels" j3:"--quantize int8" j4:"--quantize int8 --int8-words off"
      t 340 python3 benchmarks/gemv.py --model llama-3.1-8b --kinds bf16 --rows 1 --fused --tune --json "$OUT/tune8b.json" ;;
  k)  # run 17 (PDL, 8B launches): GPU tests, PDL on/off for 7B and 8B, batch-8 attention slices, int8
      gpu_tests 200
      variants k1:"--kernels" k2:"--no-pdl" k3:"--model llama-3.1-8b" k4:"--model llama-3.1-8b --no-pdl" \
               k5:"--batch-sizes 8" k6:"--batch-sizes 8 --attention-splits 4" k7:"--batch-sizes 8 --attention-splits 8" \
               k8:"--quantize int8" ;;
  l)  # run 18: the attention kernel's launches alone; several-row GEMV formulations
      t 150 python3 benchmarks/attention.py --batch-sizes 8,1 --positions 108 --json "$OUT/attention.json"
      t 560 python3 benchmarks/multirow.py --budget-s 300 --json "$OUT/multirow.json" | tail -80 ;;
  m)  # run 19 (attention launch rule, _rows_kernel with PDL): GPU tests, 7B, batch 8 with and without it, 8B,
      # int8, int4; then 7B warm
      gpu_tests 220
      variants m1:"--kernels" m2:"--batch-sizes 8 --kernels" m3:"--batch-sizes 8 --gemv-max-rows 1" \
               m4:"--model llama-3.1-8b" m5:"--quantize int8" m6:"--quantize int4-g32" m7:"--quantize int4-g128"
      bench7b m1 | tail -1 ;;
  n)  # run 20: several rows alone (PDL on), then batch 8 with PDL off, _rows_kernel and cuBLAS
      t 60 python3 benchmarks/gemv.py --model llama-2-7b --kinds bf16 --rows 8 --json "$OUT/gemv8.json"
      t 60 python3 benchmarks/gemv.py --model llama-2-7b --kinds bf16 --rows 8 --fused --json "$OUT/gemv8f.json"
      variants n1:"--batch-sizes 8 --no-pdl --kernels" n2:"--batch-sizes 8 --no-pdl --gemv-max-rows 1" ;;
  p)  # run 21 (session 5's final code, commit 216bf60): GPU tests, 7B batch 1 and 8, several rows tuned, int4 variants
      gpu_tests 200
      variants p1:"--batch-sizes 1,8"
      t 170 python3 benchmarks/gemv.py --model llama-2-7b --kinds bf16 --rows 8 --fused --tune --layers w13,wqkv,wo,w2 \
        --json "$OUT/tune8.json"
      t 300 python3 benchmarks/int4_variants.py --budget-s 280 --json "$OUT/int4v.json" | tail -40 ;;
  q)  # run 22 (w2 at several rows re-tuned): the several-row GPU tests, 7B batch 1 and 8 cold then warm, 8B,
      # int8, int4
      t 120 python3 -m pytest -q -m cuda -p no:logging -p no:warnings tests/test_cuda.py tests/test_kernels.py \
        -k "fused or rows or one_graph" | tail -5
      variants q1:"--batch-sizes 1,8" q1:"--batch-sizes 1,8" q2:"--model llama-3.1-8b" q3:"--quantize int8" \
               q4:"--quantize int4-g32" q5:"--quantize int4-g128" ;;
  r)  # run 23 (the session's final code): GPU tests, 7B batch 1 and 8
      gpu_tests 240
      variants r1:"--batch-sizes 1,8" ;;
  s)  # run 24 (int8 one-row GEMVs in float16 pairs, kernels.INT8_HALF): the kernel tests, the int8 launches
      # tuned with the fusions (and the float32 arithmetic at its tuned launches for the A/B), 7B int8 and bf16.
      # (Run 24 predates kernels.use_half: float16 pairs ran on every one-row int8 GEMV, which
      # --half-everywhere now asks for; s1's bench, on later code, would take use_half's choice.)
      t 150 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_kernels.py | tail -5
      t 300 python3 benchmarks/gemv.py --model llama-2-7b --kinds int8 --rows 1 --fused --tune --half-everywhere \
        --json "$OUT/tune_half.json"
      t 60 python3 benchmarks/gemv.py --model llama-2-7b --kinds int8 --rows 1 --fused --int8-float32 --json "$OUT/f32.json"
      variants s1:"--quantize int8" s2:"--quantize int8 --int8-float32" s3:"" ;;
  t)  # run 25 (float16 pairs only where they won in run 24, kernels.use_half, at their tuned launches): GPU
      # tests, the int8 GEMVs at their launches, 7B int8 (and with float32 arithmetic), bf16, int8 warm
      gpu_tests 240
      t 60 python3 benchmarks/gemv.py --model llama-2-7b --kinds int8 --rows 1 --fused --json "$OUT/gemv_int8.json"
      variants t1:"--quantize int8" t2:"--quantize int8 --int8-float32" t3:"" t1:"--quantize int8" ;;
  u)  # run 26 (the one-row loop without masks but in its last block): GPU tests, float16 pairs tuned on wo and
      # down, the GEMVs at their launches (int8, bf16), 7B int8 (and with float32 arithmetic), bf16
      gpu_tests 240
      t 120 python3 benchmarks/gemv.py --model llama-2-7b --kinds int8 --rows 1 --fused --tune --half-everywhere \
        --layers wo,w2 --json "$OUT/tune_narrow.json"
      t 90 python3 benchmarks/gemv.py --model llama-2-7b --kinds int8,bf16 --rows 1 --fused --json "$OUT/gemv1.json"
      variants u1:"--quantize int8" u2:"--quantize int8 --int8-float32" u3:"" ;;
  v)  # run 27: the int8 launches of wqkv (float16 pairs) and of wo and down (float32) on a finer grid
      t 200 python3 benchmarks/gemv.py --model llama-2-7b --kinds int8 --rows 1 --fused --tune --layers wqkv \
        --grid 8:512,8:1024,8:2048,16:512,16:1024,16:2048,32:512,32:1024 --warps 4,8 --stages 2,3,4 --json "$OUT/tune_wqkv.json"
      t 250 python3 benchmarks/gemv.py --model llama-2-7b --kinds int8 --rows 1 --fused --tune --layers wo,w2 \
        --grid 1:2048,1:4096,2:1024,2:2048,2:4096,4:512,4:1024,4:2048,8:512,8:1024 --warps 2,4,8 --stages 2,3,4 \
        --json "$OUT/tune_narrow.json" ;;
  w)  # run 28 (wqkv's launch from run 27): 7B int8, bf16, int8 again
      variants w1:"--quantize int8" w2:"" w1:"--quantize int8" ;;
  x)  # run 29 (session 8: the int4 one-row kernel, kernels.int4_gemv; float16 pairs scaled by the first
      # block's rms): the kernel tests of both on the GPU, the int4 model test, int4 GEMV launches tuned at
      # group 32 (and group 128 at its first launches). (Its first attempt failed to compile on Triton 3.6.)
      t 150 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_kernels.py -k "int4 or half or range" | tail -8
      t 100 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_cuda.py -k "int4 or quantized" | tail -8
      t 300 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --tune --warps 4 --stages 2,3 \
        --json "$OUT/tune_int4.json"
      t 60 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 128 --json "$OUT/int4_g128.json" ;;
  y)  # run 30 (int4 words of 8 columns, PREFETCH, launches from run 29): int4 kernel tests, int4 launches
      # tuned at group 32 (PREFETCH, 8 warps); 7B int4 g32 (ours, then tinygemm), int8, bf16. (Then the
      # kernel was on by default and --int4-tinygemm turned it off; now it is off and --int4-gemv turns it
      # on. y1 printed nothing within 170 s: BENCHMARKS.md, session 8.)
      t 100 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_kernels.py -k "int4" | tail -4
      t 260 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --tune --json "$OUT/tune_int4.json"
      variants y1:"--quantize int4-g32" y2:"--quantize int4-g32 --int4-tinygemm" y3:"--quantize int8" y4:"" ;;
  z)  # run 31 (int4 launches from run 30; the int8 kernel back to run 28's code): 7B int4 g32 (ours: the
      # default then; --int4-gemv now), int8, the GPU tests, int4 g128 (ours). z1 and z3 printed nothing
      # within 170 s.
      bench7b z1 --quantize int4-g32 2>&1 | tail -25
      variants z2:"--quantize int8"
      gpu_tests 150
      t 60 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_kernels.py -k "int4" | tail -3
      variants z3:"--quantize int4-g128" ;;
  za) # run 32 (session 9: the 7B int4 bench with kernels.int4_gemv, which did not finish in runs 30-31;
      # --int4-gemv turned it on then, the default since and dropped after run 37):
      # the int4 GPU tests; then eager and graphed 7B int4 g32 with the kernel, output unfiltered into
      # $OUT/za-*.log, Python's stacks every 40 s (faulthandler), recompiles logged
      t 150 python3 -m pytest -q -x -p no:warnings --tb=short --durations=5 tests/test_cuda.py -k "int4 or quantized" | tail -15
      for m in eager graphs; do
        echo "== za-$m"; s=$(date +%s)
        TORCH_LOGS=recompiles TORCHINDUCTOR_CACHE_DIR=/tmp/za/inductor TRITON_CACHE_DIR=/tmp/za/triton \
          timeout -k 5 "$([ $m = eager ] && echo 140 || echo 250)" python3 -c "$watch" --model llama-2-7b --modes $m \
          --batch-sizes 1 --quantize int4-g32 --int4-gemv --new-tokens 64 --json "$OUT/za-$m.json" > "$OUT/za-$m.log" 2>&1
        echo "rc $? after $(( $(date +%s) - s )) s"; grep -v -E "Warning|warn\(" "$OUT/za-$m.log" | grep -v "^ *$" | head -12
        grep -n "most recent call first" "$OUT/za-$m.log" | tail -1
      done ;;
  zb) # run 33: where za's graphed compile spends its time: at 75 s, the Python frames of the main thread that
      # lead into torch/_inductor/ir.py's __str__ recursion (faulthandler's 100 frames did not get past it)
      TORCHINDUCTOR_CACHE_DIR=/tmp/zb/inductor TRITON_CACHE_DIR=/tmp/zb/triton timeout -k 5 150 python3 -c "$outer" \
        --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int4-g32 --int4-gemv --new-tokens 64 \
        > "$OUT/zb.log" 2>&1; echo "rc $?"; grep -v -E "Warning|warn\(" "$OUT/zb.log" | tail -60 ;;
  zc) # run 34 (generate.register_fallbacks: za-zb's compile was Inductor formatting the str() of a 32-layer
      # IR for a log line, torch 2.11): 7B int4 g32 with kernels.int4_gemv, bf16, int4 g128 with it,
      # int4 g32 through tinygemm; cold caches, each one process
      for v in zc1:"--quantize int4-g32 --int4-gemv" zc2:"" zc3:"--quantize int4-g128 --int4-gemv" \
               zc4:"--quantize int4-g32"; do
        d=${v%%:*}; f=${v#*:}; echo "== $d [$f]"; s=$(date +%s)
        # shellcheck disable=SC2086
        TORCHINDUCTOR_CACHE_DIR=/tmp/$d/inductor TRITON_CACHE_DIR=/tmp/$d/triton timeout -k 5 200 python3 -c "$watch" \
          --model llama-2-7b --modes graphs --batch-sizes 1 $f --json "$OUT/$d.json" > "$OUT/$d.log" 2>&1
        echo "rc $? after $(( $(date +%s) - s )) s"; grep -E "graphs  |Error|error" "$OUT/$d.log" | head -5
      done ;;
  zd) # run 35 (kernels.int4_gemv in integers, dp4a, x in one or two int8 parts per group: GRAPHDECODE_INT4_DP4A):
      # the int4 kernel tests, 7B int4 g32 with each (at the float16 pairs' launches), then the launches of
      # the integer forms tuned at group 32 (GRAPHDECODE_INT4_DP4A=2, two parts, and --dp4a 2 exist no more)
      t 150 python3 -m pytest -q -x -p no:warnings --tb=short tests/test_kernels.py -k "int4" | tail -4
      for v in 1 2; do
        echo "== zd$v [GRAPHDECODE_INT4_DP4A=$v]"
        GRAPHDECODE_INT4_DP4A=$v TORCHINDUCTOR_CACHE_DIR=/tmp/zd$v/inductor TRITON_CACHE_DIR=/tmp/zd$v/triton \
          timeout -k 5 150 python3 bench.py --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int4-g32 \
          --json "$OUT/zd$v.json" > "$OUT/zd$v.log" 2>&1; echo "rc $?"; grep -E "graphs  |Error|error" "$OUT/zd$v.log" | head -5
      done
      t 330 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --dp4a 1,2 --tune --grid 32:8,32:16,64:8 \
        --warps 4,8 --prefetch 0,1 --json "$OUT/tune_dp4a.json" ;;
  ze) # run 36 (int4 one-row arithmetic by shape, kernels.int4_dp4a: integers below 8192 columns at run 35's
      # launches, float16 pairs for the down projection): 7B int4 g32 and g128 (auto), g32 in float16
      # pairs alone, bf16; then the GPU tests
      logged_variants 150 0 ze1:"--quantize int4-g32" ze2:"--quantize int4-g128" ze3:"--quantize int4-g32 --int4-dp4a 0" ze4:""
      gpu_tests 280 ;;
  zf) # run 37 (the float16-pair path's scale-and-zero words expanded at the load again, as in run 34):
      # 7B int4 g32 by shape and in float16 pairs alone; the int4 GPU tests
      logged_variants 150 0 zf1:"--quantize int4-g32" zf2:"--quantize int4-g32 --int4-dp4a 0"
      t 150 python3 -m pytest -q -p no:warnings --tb=short tests/test_cuda.py tests/test_kernels.py -k "int4" | tail -3 ;;
  zg) # run 38 (session 10: x in int8 once, kernels.int4_quantize_x, read by int4_gemv(xq=...)): the 7B GEMVs in
      # integers with and without it, tuned; then the GPU tests (the dp4a definition test's GPU form first runs here)
      t 300 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --dp4a 1 --xq --tune \
        --grid 32:16,16:32,64:8,32:8 --warps 4,8 --prefetch 0 --json "$OUT/gemv-int4-xq.json"
      gpu_tests 240 ;;
  zh) # run 39 (the int4 loop pipelined by Triton, tl.range(num_stages=PIPELINE): cp.async into shared memory,
      # PIPELINE the launch's stages, 1 = off as before): the 7B GEMVs in integers, with and without x in int8 first, tuned
      t 420 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --dp4a 1 --xq --tune \
        --grid 32:16,16:32,32:8 --warps 4,8 --stages 1,2,3,4 --prefetch 0 --json "$OUT/gemv-int4-pipe.json" ;;
  zi) # run 40: zh's pipelined launches with every timing printed (zh's filter hid any failures); the 7B int4 step
      # in integers everywhere with the new launches (gate/up 16 rows of 2048 columns, down in integers at 16 of 2048),
      # g32 and g128; then every test of test_cuda.py and test_kernels.py on the GPU (not only -m cuda)
      t 150 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --layers wqkv,w2 --dp4a 1 --tune \
        --grid 32:16,16:32 --warps 8 --stages 1,2,3,4 --prefetch 0
      logged_variants 150 0 zi1:"--quantize int4-g32 --int4-dp4a 1" zi2:"--quantize int4-g128 --int4-dp4a 1"
      t 240 python3 -m pytest -q -p no:warnings --tb=short tests/test_cuda.py tests/test_kernels.py | tail -8 ;;
  zj) # run 41 (session 10's final code = session 9's kernels, commit 6a7fb6d's kernels.py): the 7B int4 g32 step with
      # its costliest kernels (bench.py --kernels), g128 on the final code; then every test of test_cuda.py and
      # test_kernels.py on the GPU
      logged_variants 170 24 zj1:"--quantize int4-g32 --kernels" zj2:"--quantize int4-g128"
      t 330 python3 -m pytest -q -p no:warnings --tb=short tests/test_cuda.py tests/test_kernels.py | tail -8 ;;
  zk) # run 42 (final code): larger tiles a program than any grid so far (more bytes in flight a thread), int4 g32 in integers
      t 300 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --dp4a 1 --tune \
        --grid 32:32,64:16,16:64,32:64,64:32 --warps 4,8 --prefetch 0 --json "$OUT/gemv-int4-big.json" ;;
  zl) # run 43 (session 10's kernel; prepared then, run in session 11): the int4 GEMV's loads alone
      # (benchmarks/int4_stream.py: words, words and scale-and-zero words, the words as a 2D tile) against the
      # kernel, at int4_config's launches and 4 or 8 warps
      t 200 python3 benchmarks/int4_stream.py --model llama-2-7b --warps 4,8 --json "$OUT/int4-stream.json" ;;
  zm) # run 44 (session 11: the int4 words loaded as a 2D tile [rows, groups x words] and reshaped, so that a warp reads
      # one row's contiguous bytes; the 3D load had put a warp's 32 threads on 32 rows): the probe (its kernel column is
      # the new load), the 7B step at g32, g128 and bf16; then the one-row int4 launches retuned in integers
      t 200 python3 benchmarks/int4_stream.py --model llama-2-7b --json "$OUT/int4-stream.json"
      logged_variants 150 0 zm1:"--quantize int4-g32" zm2:"--quantize int4-g128" zm3:""
      t 300 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32,128 --dp4a 1 --tune \
        --grid 8:32,16:16,16:32,16:64,32:16,32:32,64:16 --warps 4,8 --prefetch 0 --json "$OUT/gemv-int4-flat.json" ;;
  zn) # run 45 (run 44's retune: the down projection in integers at 8 rows of 2048 columns, 8 warps, no prefetch):
      # the down projection's launches in both arithmetics and gate/up's in integers, tuned; the 7B int4 step by shape
      # (auto: the down projection in float16 pairs) and in integers everywhere, g32 and g128
      t 200 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32,128 --layers w2 --dp4a 0,1 --tune \
        --grid 8:16,8:32,8:64,16:16,16:32,16:64 --warps 4,8 --prefetch 0,1 --json "$OUT/gemv-int4-w2.json"
      t 100 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32,128 --layers w13 --dp4a 1 --tune \
        --grid 16:8,32:8,16:16,16:32,32:32 --warps 4,8 --prefetch 0 --json "$OUT/gemv-int4-w13.json"
      # (zn4's JSON and log did not come back from run 45: past the call's limit on files; its line was printed)
      logged_variants 150 0 zn1:"--quantize int4-g32" zn2:"--quantize int4-g32 --int4-dp4a 1" \
        zn3:"--quantize int4-g128" zn4:"--quantize int4-g128 --int4-dp4a 1" ;;
  zo) # run 46 (session 11's final code: the 2D int4 load, integers on every shape, launches of runs 44-45): the 7B
      # int4 step at g32 with its costliest kernels and at g128, int8; then every test of test_cuda.py and test_kernels.py
      logged_variants 170 24 zo1:"--quantize int4-g32 --kernels"
      logged_variants 150 0 zo2:"--quantize int4-g128" zo3:"--quantize int8"
      t 330 python3 -m pytest -q -p no:warnings --tb=short tests/test_cuda.py tests/test_kernels.py | tail -8 ;;
  zp) # run 47 (run 46's code): where the g32 step's time goes without PDL's overlap (each kernel alone), the probe at the
      # new launches, and wqkv / wo at group 32 over a wider grid
      logged_variants 170 24 zp1:"--quantize int4-g32 --kernels --no-pdl"
      t 120 python3 benchmarks/int4_stream.py --model llama-2-7b --json "$OUT/int4-stream.json"
      t 150 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --layers wqkv,wo --dp4a 1 --tune \
        --grid 16:32,32:16,32:32,64:16,16:64,32:64,64:32 --warps 4,8 --prefetch 0 --json "$OUT/gemv-int4-qkvo.json" ;;
  zq) # run 48 (wqkv, fused with the norm, at 4 warps at group 32: 9.5 against 11.8 µs in runs 44 and 47): wqkv at
      # group 128 in 4 or 8 warps; the 7B int4 step at g32 and g128; the int4 GPU tests
      t 60 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32,128 --layers wqkv --dp4a 1 --tune \
        --grid 32:8,32:16,32:32 --warps 4,8 --prefetch 0 --json "$OUT/gemv-int4-qkv.json"
      logged_variants 150 0 zq1:"--quantize int4-g32" zq2:"--quantize int4-g128"
      t 150 python3 -m pytest -q -p no:warnings --tb=short tests/test_cuda.py tests/test_kernels.py -k "int4" | tail -3 ;;
  zr) # run 50 (session 12: int4 scales and zeros on quantize.py's grid; model.INT4_CODES): the GEMVs with float16
      # scales against 8-bit codes at int4_config's launches; the 7B step in bf16, and at g32 without and with codes
      # (one JSON for the benches, their logs left on the machine: the device tool returns at most 8 files)
      t 100 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32,128 --dp4a 1 --codes 0,1 \
        --json "$OUT/gemv-int4-codes.json"
      JSON=$OUT/h200-codes.json logged_variants 120 0 zr0:"" zr1:"--quantize int4-g32 --int4-codes 0" \
        zr2:"--quantize int4-g32 --int4-codes 1" ;;
  zs) # run 51 (run 50's code, as run): the codes' launches for gate/up and down at groups 32 and 128; every GPU test
      # with codes everywhere (GRAPHDECODE_INT4_CODES=1; cut off at 320 s, ~70% in, no failure so far)
      t 250 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32,128 --layers w13,w2 --dp4a 1 --codes 1 \
        --tune --grid 8:32,16:32,32:16,32:32,16:64,8:64 --warps 4,8 --prefetch 0 --json "$OUT/gemv-int4-codes-tune.json"
      GRAPHDECODE_INT4_CODES=1 t 320 python3 -m pytest -q -p no:warnings --tb=short tests/test_cuda.py tests/test_kernels.py \
        | tail -8 ;;
  zu) # run 53 (model.int4_codes: codes at group 32, and the down projection's codes launch at 16 rows, from run 51):
      # the 7B int4 step at g32 and g128 (codes by the rule), then every GPU test
      JSON=$OUT/h200-codes.json logged_variants 110 0 zu1:"--quantize int4-g32" zu2:"--quantize int4-g128"
      set -o pipefail; timeout 400 python3 -m pytest -q -p no:warnings --tb=short tests/test_cuda.py tests/test_kernels.py \
        2>&1 | tee "$OUT/tests.log" | tail -5 ;;
  zv) # run 54 (run 53's code): the 14 GPU tests last in order (run 53's 400 s ended after 225 of 228)
      ids=$(python3 -m pytest -q --co -p no:warnings tests/test_cuda.py tests/test_kernels.py 2>/dev/null | grep "::" | tail -14)
      # shellcheck disable=SC2086
      t 300 python3 -m pytest -q -p no:warnings --tb=short $ids | tail -5 ;;
  zw) # run 55 (run 53's code): the codes' launches for wqkv and wo at group 32 (they stay: 8.3 against 8.4 µs, 4.2 and
      # 4.2); a repeat of the default 7B int4 g32 step
      t 150 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --layers wqkv,wo --dp4a 1 --codes 1 --tune \
        --grid 16:32,32:16,32:32,16:64,8:64,32:64 --warps 4,8 --prefetch 0 --json "$OUT/gemv-int4-codes-qkvo.json"
      JSON=$OUT/h200-zw.json logged_variants 110 0 zw1:"--quantize int4-g32" ;;
  zx) # run 56 (commit ecc4897): group 64, float16 scales against codes, the GEMVs and the 7B step
      t 60 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 64 --dp4a 1 --codes 0,1 \
        --json "$OUT/gemv-int4-codes-g64.json"
      JSON=$OUT/h200-g64.json logged_variants 75 0 zx1:"--quantize int4-g64 --int4-codes 0" \
        zx2:"--quantize int4-g64 --int4-codes 1" ;;
  zy) # run 57 (session 13): x in int8 between decode's int4 kernels (kernels.INT4_XQ): the new kernels' tests,
      # the GEMVs with x in int8 per 8, 16, 32 columns against x in bf16, and the 7B step at group 32
      t 150 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_kernels.py \
        -k "int8 or quantize_x or attention_matches" | tail -6
      t 120 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --dp4a 1 --codes 1 --xq 0,8,16,32 \
        --json "$OUT/gemv-int4-xq.json" | grep -v "^$"
      JSON=$OUT/h200-xq.json logged_variants 90 0 zy1:"--quantize int4-g32 --int4-xq 16" \
        zy2:"--quantize int4-g32 --int4-xq 32" zy3:"--quantize int4-g32 --int4-xq 0" ;;
  zz) # run 58 (session 13, commit e63173d's gemv_int4.py): x in int8 per 16 columns, reading it alone and with the
      # output written too, tuned
      t 60 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_kernels.py \
        -k "reads_and_writes" | tail -4
      t 420 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --dp4a 1 --codes 1 --xq 0,16 \
        --xq-write 0,1 --tune --grid 8:64,16:64,16:32,32:32,16:16,32:16,8:32,16:128 --warps 4,8 --prefetch 0 \
        --json "$OUT/gemv-int4-xq-tuned.json" | grep -v "^$" ;;
  z0) # run 59 (session 13): the attention kernel hands an int4 wo its output in int8; the GPU tests of what changed,
      # then the 7B step at group 32 with it (auto) and without (0), and at group 128
      t 330 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_cuda.py tests/test_kernels.py \
        -k "int4 or int8 or quantize or attention or one_graph" | tail -8
      JSON=$OUT/h200-wo-xq.json logged_variants 90 0 z01:"--quantize int4-g32" z02:"--quantize int4-g32 --int4-xq 0" \
        z03:"--quantize int4-g128" ;;
  z1) # run 60 (session 13): the new kernels' tests; group 128 with and without x in int8 for wo
      t 100 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_kernels.py \
        -k "reads_x or quantize_x or attention_matches or x_in_int8" | tail -3
      JSON=$OUT/h200-g128-xq.json logged_variants 90 0 z11:"--quantize int4-g128 --int4-xq 0" z12:"--quantize int4-g128" ;;
  z2) # run 62 (session 14, commit 7d3a375 = session 13's final code): the 7B int4 g32 step; the attention kernel
      # alone at batch 1; every GPU test, test_cuda.py and test_kernels.py in two processes side by side
      JSON=$OUT/h200-z2.json logged_variants 100 0 z21:"--quantize int4-g32"
      t 80 python3 benchmarks/attention.py --batch-sizes 1 --positions 108,200 --json "$OUT/attention-z2.json" | grep -v "^$"
      timeout 380 python3 -m pytest -q -p no:warnings --tb=short tests/test_cuda.py > "$OUT/tests-cuda.log" 2>&1 &
      timeout 380 python3 -m pytest -q -p no:warnings --tb=short tests/test_kernels.py > "$OUT/tests-kernels.log" 2>&1
      wait; tail -4 "$OUT/tests-cuda.log"; tail -4 "$OUT/tests-kernels.log" ;;
  z3) # run 63 (session 14): the attention kernel's slices even (GRAPHDECODE_ATTENTION_ALIGN=0) or a multiple of
      # the loop step (1, as before), over slices, loop steps and warps at batch 1; then the 7B int4 g32 step with
      # each (one shared cache directory after the first: first-call times are warm). The switch and attention.py's
      # --align were an uncommitted scratch change, taken out after this run (even slices lost)
      t 150 python3 benchmarks/attention.py --batch-sizes 1 --positions 50,108,150,200 --splits 2,4,8 \
        --block-l 32,64,128 --warps 4,8 --align 0,1 --json "$OUT/attention-z3.json" | tail -2
      for v in z31:1: z32:0:"--attention-block-l 64" z33:0:"--attention-splits 8" z34:0: z35:0:"--attention-block-l 64 --attention-splits 8"; do
        d=${v%%:*}; r=${v#*:}; al=${r%%:*}; f=${r#*:}; echo "== $d align=$al [$f]"
        # shellcheck disable=SC2086
        GRAPHDECODE_ATTENTION_ALIGN=$al TORCHINDUCTOR_CACHE_DIR=/tmp/z3/inductor TRITON_CACHE_DIR=/tmp/z3/triton \
          timeout -k 5 90 python3 bench.py --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int4-g32 $f \
          --json "$OUT/h200-z3.json" > "/tmp/$d.log" 2>&1; echo "rc $?"; grep -E "graphs  |Error|error" "/tmp/$d.log" | head -3
      done ;;
  z4) # run 64 (session 14): the wo test's graphed case after each case's own compile (test fix); the 7B int4 g32
      # step's kernels (--kernels, PDL on: overlapping times); the step with slices a multiple of 64-position loop
      # steps at 8 warps (run 63's best at batch 1) against the default, in one cache directory
      t 150 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_cuda.py -k "wo_reads" | tail -3
      for v in z41:"--kernels" z42:"--attention-block-l 64" z43:"" z44:"--attention-block-l 64"; do
        d=${v%%:*}; f=${v#*:}; echo "== $d [$f]"
        # shellcheck disable=SC2086
        TORCHINDUCTOR_CACHE_DIR=/tmp/z4/inductor TRITON_CACHE_DIR=/tmp/z4/triton timeout -k 5 90 python3 bench.py \
          --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int4-g32 $f --json "$OUT/h200-z4.json" \
          > "/tmp/$d.log" 2>&1; echo "rc $?"; grep -E "graphs  |Error|error" "/tmp/$d.log" | head -3
      done
      grep -v -E "Warning|warn\(" /tmp/z41.log | grep -A40 "kernels of 4" | head -45 ;;
  z5) # run 65 (session 14, commit a29e875: 64 positions a loop step at 8 warps): the attention kernel tests; the 7B
      # step in bf16, int8, int4 g32 and g128, batch 1, cold caches, one process each
      t 100 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_kernels.py -k "attention" | tail -3
      JSON=$OUT/h200-z5.json logged_variants 100 0 z51:"" z52:"--quantize int8" z53:"--quantize int4-g32" \
        z54:"--quantize int4-g128" ;;
  z6) # run 66 (session 14, commit 9397a91; reverted after this run, so it needs that commit): the int4 GEMVs
      # without x in int8 given (wqkv, w13, w2) in persistent programs that round x once each
      # (GRAPHDECODE_INT4_PERSISTENT): the 7B int4 g32 step at 264 and 396 programs (one cache directory);
      # then the GEMVs alone with and without
      for v in z61:264 z62:396; do
        d=${v%%:*}; n=${v#*:}; echo "== $d GRAPHDECODE_INT4_PERSISTENT=$n"
        GRAPHDECODE_INT4_PERSISTENT=$n TORCHINDUCTOR_CACHE_DIR=/tmp/z6/inductor TRITON_CACHE_DIR=/tmp/z6/triton \
          timeout -k 5 80 python3 bench.py --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int4-g32 \
          --json "$OUT/h200-z6.json" > "/tmp/$d.log" 2>&1; echo "rc $?"; grep -E "graphs  |Error|error" "/tmp/$d.log" | head -3
      done
      TRITON_CACHE_DIR=/tmp/z6/triton t 100 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 \
        --layers w13,w2,wqkv --dp4a 1 --codes 1 --persistent 0,264,396 --json "$OUT/gemv-int4-persistent.json" \
        | grep -v "^$" ;;
  z7) # prepared in session 14, not yet run: the int4 GEMVs with two blocks of weights loaded before the PDL wait
      # (launch prefetch 2: kernels._int4_gemv_kernel EARLY; offline, sm_90: w13 80 -> 94 registers, wqkv
      # 152 -> 162, w2 95 -> 118): its kernel tests, then tuned beside the default launches (a winner goes into
      # INT4_LAUNCHES, then the 7B step)
      t 90 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_kernels.py \
        -k "int4_gemv_matches_float64 or prefetch" | tail -3
      t 300 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32,128 --layers wqkv,w13,w2 --dp4a 1 \
        --codes 1 --tune --grid 8:16,16:16,32:16,8:32,16:32,16:64 --warps 4,8 --prefetch 0,2 \
        --json "$OUT/gemv-int4-early.json" | grep -v "^$" ;;
  z8) # run 67 (session 15; needs commit 636e968, the L2 prefetch's code, removed after run 69): the attention kernel prefetching the next GEMVs' weights into L2 (kernels.L2_PREFETCH):
      # its GPU tests; the 7B step at batch 1, int4 g32 at 0, 9 (wo alone), 18 and 28 MB a layer, then bf16 at 0 and
      # 28 MB, each dtype in one cache directory (first calls after the first warm)
      t 150 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_cuda.py -k "l2_prefetch or pdl_chain" | tail -3
      for v in z81:"--quantize int4-g32 --l2-prefetch 0" z82:"--quantize int4-g32 --l2-prefetch 9" \
               z83:"--quantize int4-g32 --l2-prefetch 18" z84:"--quantize int4-g32 --l2-prefetch 28" \
               z85:"--l2-prefetch 0" z86:"--l2-prefetch 28"; do
        d=${v%%:*}; f=${v#*:}; c=/tmp/z8-$([[ $f == *int4* ]] && echo q || echo b); echo "== $d [$f]"
        # shellcheck disable=SC2086
        TORCHINDUCTOR_CACHE_DIR=$c/inductor TRITON_CACHE_DIR=$c/triton timeout -k 5 100 python3 bench.py \
          --model llama-2-7b --modes graphs --batch-sizes 1 $f --json "$OUT/h200-z8.json" > "/tmp/$d.log" 2>&1
        echo "rc $?"; grep -E "graphs  |Error|error" "/tmp/$d.log" | head -3
      done ;;
  z9) # run 68 (session 15; needs commit f60f65e): as z8 with one bulk prefetch a range from each program's first thread (run 67 issued
      # one of 4 KB a thread: every asm whose operands differ between threads runs thread by thread, and the step
      # lost 2% with two ranges, 4.6% with four); int4 g32 at 0, 9, 18, 28, 40 MB, bf16 at 0 and 28
      t 150 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_cuda.py -k "l2_prefetch or pdl_chain" | tail -3
      for v in z91:"--quantize int4-g32 --l2-prefetch 0" z92:"--quantize int4-g32 --l2-prefetch 9" \
               z93:"--quantize int4-g32 --l2-prefetch 18" z94:"--quantize int4-g32 --l2-prefetch 28" \
               z95:"--quantize int4-g32 --l2-prefetch 40" z96:"--l2-prefetch 0" z97:"--l2-prefetch 28"; do
        d=${v%%:*}; f=${v#*:}; c=/tmp/z9-$([[ $f == *int4* ]] && echo q || echo b); echo "== $d [$f]"
        # shellcheck disable=SC2086
        TORCHINDUCTOR_CACHE_DIR=$c/inductor TRITON_CACHE_DIR=$c/triton timeout -k 5 100 python3 bench.py \
          --model llama-2-7b --modes graphs --batch-sizes 1 $f --json "$OUT/h200-z9.json" > "/tmp/$d.log" 2>&1
        echo "rc $?"; grep -E "graphs  |Error|error" "/tmp/$d.log" | head -3
      done ;;
  z10) # run 69 (session 15; needs commit 4552797): the prefetch at each attention program's end (GRAPHDECODE_L2_PREFETCH_AT=end, an
      # experiment: after its own loads and stores) at 9 and 18 MB against none, int4 g32, one cache directory; then
      # z7's kernel tests and its tuning at group 32 only (launch prefetch 2: two weight blocks before the PDL wait)
      for v in z101:"0" z102:"9" z103:"18"; do
        d=${v%%:*}; mb=${v#*:}; echo "== $d [--l2-prefetch $mb, at the end]"
        GRAPHDECODE_L2_PREFETCH_AT=end TORCHINDUCTOR_CACHE_DIR=/tmp/z10/inductor TRITON_CACHE_DIR=/tmp/z10/triton \
          timeout -k 5 100 python3 bench.py --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int4-g32 \
          --l2-prefetch "$mb" --json "$OUT/h200-z10.json" > "/tmp/$d.log" 2>&1
        echo "rc $?"; grep -E "graphs  |Error|error" "/tmp/$d.log" | head -3
      done
      t 90 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_kernels.py \
        -k "int4_gemv_matches_float64 or prefetch" | tail -3
      t 210 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --layers wqkv,w13,w2 --dp4a 1 \
        --codes 1 --tune --grid 8:16,16:16,32:16,8:32,16:32,16:64 --warps 4,8 --prefetch 0,2 \
        --json "$OUT/gemv-int4-early.json" | grep -v "^$" ;;
  z11) # run 70 (session 16, on commit 8e2d9d1, reverted after it: 660.1 tok/s, a loss; prepared in session 15):
      # gate/up's launch with codes at group 32 at 4 warps, prefetch 2 (run 69's best, 15.4 against 15.9 us alone):
      # INT4_LAUNCHES["gate/up"]'s fourth entry (16, 1024, 4, 2), int4_config taking a launch's optional fourth
      # entry as its prefetch. The 7B int4 g32 step and bf16 beside it, cold caches; then the GPU tests of the
      # quantized decode (the tiny model's gate/up takes it; run 70 printed 20 passes and no summary: cut by the limit)
      JSON=$OUT/h200-z11.json logged_variants 90 0 z111:"--quantize int4-g32" z112:""
      t 100 python3 -m pytest -q -p no:logging -p no:warnings --tb=short tests/test_cuda.py -k "quantized or int4 or pdl" | tail -3
      # whether a GEMV reads faster from L2 at all (run 67-69's open question): the GEMVs on weights that stay in L2
      t 60 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --layers wo,w2 --dp4a 1 --codes 1 --xq 0,16 \
        --l2-hot --json "$OUT/gemv-int4-l2-hot.json" | grep -v "^$" ;;
  z12) # run 71 (session 16): where the int4 g32 step goes, by ablation (a scratch change to model.py, an earlier
      # form of commit c8086c8 with its constants made in __init__, taken out after this run: GRAPHDECODE_ABLATE=part
      # skips one part of every layer's decode, for timing only).
      # wqkv: a constant qkv; cache: the attention kernel over a cache of length 0 (4 slices, as the default's);
      # attention: no attention kernel (wo reads constant int8 x); wo: the layer's output is its input;
      # w13: w2 reads a constant; ffn: neither w13 nor w2. Cold caches, one process each
      JSON=$OUT/h200-z12.json logged_variants 90 0 z121:"--quantize int4-g32"
      for a in wqkv:"" cache:"--attention-splits 4" attention:"" wo:"" w13:"" ffn:""; do
        GRAPHDECODE_ABLATE=${a%%:*} JSON=$OUT/h200-z12.json logged_variants 90 0 "z12-${a%%:*}":"--quantize int4-g32 ${a#*:}"
      done ;;
  z13) # run 72 (session 16, commit c8086c8, reverted after it; the device copy had model.py uncommitted, and
      # scratch_model_clean.py, the committed model.py, beside it): run 71's ablations that failed there (its constants were left on the meta device) or
      # fell back (wo on a strided view of qkv), with the constants made in setup_caches; then model.py back to the
      # committed code (scratch_model_clean.py, carried) and the GPU tests, test_cuda.py and test_kernels.py side by side
      for a in wqkv attention w13; do
        GRAPHDECODE_ABLATE=$a JSON=$OUT/h200-z13.json logged_variants 90 0 "z13-$a":"--quantize int4-g32"
      done
      cp scratch_model_clean.py model.py
      timeout 370 python3 -m pytest -q -p no:warnings --tb=short -m cuda tests/test_cuda.py > "$OUT/tests-cuda.log" 2>&1 &
      timeout 370 python3 -m pytest -q -p no:warnings --tb=short -m cuda tests/test_kernels.py > "$OUT/tests-kernels.log" 2>&1
      wait; tail -4 "$OUT/tests-cuda.log"; tail -4 "$OUT/tests-kernels.log" ;;
  z14) # run 73 (session 16): runs 71-72 put the attention kernel at ~5.8 us a layer in the int4 g32 step, nearly
      # all of it fixed cost (over a cache of length 0 it saved 0.34 us a layer). Its slices: the default (4 at
      # bench.py's 224 positions), 1 (no merge: one program a KV head runs the whole cache), 2; cold caches
      JSON=$OUT/h200-z14.json logged_variants 90 0 z141:"--quantize int4-g32" z142:"--quantize int4-g32 --attention-splits 1" \
        z143:"--quantize int4-g32 --attention-splits 2" z144:"--quantize int4-g32 --attention-splits 1 --attention-block-l 128" ;;
  z15) # run 74 (session 16; its JSON then went to one file, which kept only the --l2-hot pass; the cycled pass is in
      # BENCHMARKS.md from the printed output): the int4 g32 GEMVs with codes from L2 (--l2-hot) and cycled past it: does the
      # kernel or the memory bound each (run 70: w2 7.0 us from L2, where its bytes take 5.9 from HBM at the ceiling)
      for h in "" "--l2-hot"; do
        # shellcheck disable=SC2086
        t 100 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --dp4a 1 --codes 1 --xq 0,16 $h \
          --json "$OUT/gemv-int4-z15${h:+-l2-hot}.json" | grep -v "^$"
      done ;;
  z16) # runs 75-76 (session 16): Nsight Compute on the w2 GEMV alone (int4 g32, codes, x in bf16): occupancy,
      # then (boost clocks) stall reasons and instruction mix; benchmarks/ncu-w2-h200.txt
      t 200 ncu --target-processes all -k regex:_int4_gemv_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
        --section SchedulerStats python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --layers w2 --dp4a 1 \
        --codes 1 --xq 0 > "$OUT/ncu-w2.txt"
      t 200 ncu --clock-control none --print-details all -k regex:_int4_gemv_kernel --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section InstructionStats python3 benchmarks/gemv_int4.py \
        --model llama-2-7b --groupsizes 32 --layers w2 --dp4a 1 --codes 1 --xq 0 > "$OUT/ncu-w2-stalls.txt" ;;
  z17) # run 77 (session 16; its JSON then went to one file, which kept only the last cap): the int4 g32 GEMVs with a register cap (GRAPHDECODE_INT4_MAXNREG, a scratch switch in
      # int4_gemv's launch, taken out after this run): ncu put w2 at 116 registers a thread, 2 programs an SM
      for m in "" 128 96 80; do echo "== maxnreg ${m:-none}"
        GRAPHDECODE_INT4_MAXNREG=$m t 55 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --dp4a 1 \
          --codes 1 --xq 0 --layers w2,w13 --tune --grid 8:32,16:32,16:64,8:64 --warps 4,8 --prefetch 0 \
          --json "$OUT/gemv-int4-z17-${m:-none}.json" | grep -v "^$" | grep -E "g32|Error|error"
      done ;;
  z18) # run 78 (session 17; prepared in session 16), on the 3-line change below, reverted after it: lost (7B step 583.4 at
      # 2 stages, 614.3 at 3, against 674.1). Triton's loop pipelining of the int4 GEMV again
      # (session 10's run 39 lost with it, before the 2D load). Runs 75-76's ncu put w2 at 16 warps an SM, stalled
      # mostly on loads (long scoreboard), and its SASS loads each block's weights with plain LDG at the top of the
      # loop. First make the loop of _int4_gemv_kernel without PREFETCH `for b in tl.range(EARLY, full,
      # num_stages=PIPE)`, with `PIPE: tl.constexpr = None` last in its signature and int4_gemv's launch passing
      # PIPE=int(os.environ["GRAPHDECODE_INT4_PIPELINE"]) if that is set, else None. Offline (Triton 3.6, sm_90),
      # PIPE 2 and 3 load the loop's weights with cp.async (LDGSTS.BYPASS.128) at 111 registers (95 without), no
      # spills; the interpreter's int4_gemv tests pass with PIPE=2. Then: the GEMVs alone, and the 7B step
      for p in "" 2 3; do echo "== pipeline ${p:-none}"
        GRAPHDECODE_INT4_PIPELINE=$p t 60 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --dp4a 1 \
          --codes 1 --xq 0,16 --json "$OUT/gemv-int4-z18-${p:-none}.json" | grep -E "g32|Error|error"
      done
      for p in 2 3 ""; do
        GRAPHDECODE_INT4_PIPELINE=$p JSON=$OUT/h200-z18.json logged_variants 90 0 "z18-${p:-none}":"--quantize int4-g32"
      done ;;
  z19) # run 79 (session 17): a probe of split K for the int4 g32 GEMVs (gemv_int4.py --split-k: each shape as S slices of K
      # side by side, the products of a split-K launch without its merge), after z18's loop pipelining lost
      for s in 1 2 4; do echo "== split-k $s"
        t 150 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --dp4a 1 --codes 1 --xq 0 \
          --layers w13,w2 --split-k $s --tune --grid 16:16,16:32,32:8,32:16,64:8,64:16 --warps 4,8 --prefetch 0 \
          --json "$OUT/gemv-int4-z19-$s.json" | grep -E "g32|Error|error"
      done ;;
  z20) # run 80 (session 17): the int4 g32 GEMVs with each block's weights loaded one step ahead (launch prefetch 1, register
      # double buffering; not timed in integers since session 11's 2D load), split K 1 and 2 (the probe above)
      for s in 1 2; do echo "== split-k $s"
        t 200 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --dp4a 1 --codes 1 --xq 0 \
          --layers wqkv,w13,w2 --split-k $s --tune --grid 8:32,16:16,16:32,16:64,32:16 --warps 4,8 --prefetch 0,1 \
          --json "$OUT/gemv-int4-z20-$s.json" | grep -E "g32|Error|error"
      done ;;
  z21) # run 81 (session 17), on commit 652008d (K split in halves for gate/up: kernels.int4_split and the kernel's SPLIT;
      # reverted in 267f881 after this run): the GEMV with the rule and without, a small tuning of the split launch,
      # the 7B step both ways, then the GPU tests (41 passed). Lost: w13 17.7 us split against 15.8, the step 631.4 tok/s
      # against 663.7
      for s in "" 1; do echo "== gemvs, split ${s:-auto}"
        t 80 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --dp4a 1 --codes 1 --xq 0 \
          --layers w13 ${s:+--split-k $s} --json "$OUT/gemv-int4-z21-${s:-auto}.json" | grep -E "g32|Error|error"
      done
      echo "== split 2 tuned"
      t 100 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --dp4a 1 --codes 1 --xq 0 --layers w13 \
        --split-k 2 --tune --grid 8:16,16:16,16:32,32:16 --warps 4,8 --prefetch 0 --json "$OUT/gemv-int4-z21-tune.json" \
        | grep -E "g32|Error|error"
      JSON=$OUT/h200-z21.json logged_variants 90 0 z21-auto:"--quantize int4-g32" z21-1:"--quantize int4-g32 --int4-split-k 1"
      echo "== GPU tests"; gpu_tests 240 ;;
  z22) # run 82 (session 17; benchmarks/boundaries-h200.json): what kernel boundaries cost apart from arithmetic: the int4 g32 step's weight bytes
      # streamed by summing kernels, one launch a GEMV (with and without PDL) or one persistent launch a step
      t 200 python3 benchmarks/boundaries.py --json "$OUT/boundaries-z22.json"
      t 100 python3 benchmarks/boundaries.py --program-kb 32 --programs-per-sm 2 --json "$OUT/boundaries-z22-32k.json" ;;
  z23) # run 83 (session 17): tiles shaped like the GEMVs' (a block of rows, 128 words of each a step; rows padded to
      # 128 words, 10% more bytes), in a row-major layout as the int4 GEMV reads, and tiled (each step's tile contiguous)
      t 100 python3 benchmarks/boundaries.py --tiles --json "$OUT/boundaries-z23.json" ;;
  z24) # run 84 (session 17): chained streaming programs of 64 and 128 KB with 1, 2 or all of their blocks loaded
      # before the PDL wait: is it the programs' size or the share they load before the wait
      t 60 python3 benchmarks/boundaries.py --early 1,2,4 --programs-per-sm 0 --json "$OUT/boundaries-z24-64k.json"
      t 60 python3 benchmarks/boundaries.py --program-kb 128 --early 1,2,4,8 --programs-per-sm 0 \
        --json "$OUT/boundaries-z24-128k.json" ;;
  z25) # prepared in session 17, not run (no device time left); needs commit a0ee0b9's kernels.py (taken out again after it):
      # each int4 GEMV program asks L2 for all of its own weights before its
      # PDL wait (GRAPHDECODE_INT4_L2_OWN=1, a scratch switch: cp.async.bulk.prefetch.L2 of its rows' words and codes),
      # after runs 82-84 found streaming at the ceiling when a program's bytes are all requested before its wait
      GRAPHDECODE_INT4_L2_OWN=1 JSON=$OUT/h200-z25.json logged_variants 75 0 z25-own:"--quantize int4-g32"
      JSON=$OUT/h200-z25.json logged_variants 75 0 z25-none:"--quantize int4-g32" ;;
  z26) # prepared in session 17, not run (no device time left): runs 82-84's chained streaming programs that hold their
      # early blocks in registers until after the PDL wait (--hold: each word takes the previous GEMV's value there,
      # as a GEMV's products wait for x), then do N dependent integer steps a sum (--work: a GEMV's arithmetic,
      # holding the slot). Does holding and computing after the wait cost what the int4 GEMVs lose (77% vs 106%)?
      t 80 python3 benchmarks/boundaries.py --hold --early 1,4 --work 0,16,64,256 --programs-per-sm 0 \
        --json "$OUT/boundaries-z26-64k.json"
      t 60 python3 benchmarks/boundaries.py --program-kb 128 --hold --early 8 --work 0,16,64 --programs-per-sm 0 \
        --json "$OUT/boundaries-z26-128k.json" ;;
  z27) # session 18: z26 found that programs holding all their early bytes in registers, and computing after the
      # wait, still stream at 97% (64 KB, 4 blocks early). So: int4 GEMV launches that take all of K in one block,
      # all loaded before the PDL wait, in the 7B step (GRAPHDECODE_INT4_LAUNCH, a scratch switch: rows,columns,warps)
      JSON=$OUT/h200-z27.json logged_variants 75 0 z27-none:"--quantize int4-g32"
      for l in "gate/up=8,4096,8" "gate/up=4,4096,4" "wide=8,4096,8" "wide=16,4096,8" "long=4,16384,8" "long=8,16384,8" \
               "gate/up=8,4096,8;wide=8,4096,8;long=4,16384,8" "gate/up=4,4096,4;wide=8,4096,4;long=4,16384,4"; do
        GRAPHDECODE_INT4_LAUNCH="$l" JSON=$OUT/h200-z27.json logged_variants 75 0 "z27-${l//[^a-z0-9]/_}":"--quantize int4-g32"
      done ;;
  z28) # session 18, after z27 lost (all of K in one block: 383-591 tok/s against 672.5): the probe's best shape,
      # 32-36 KB programs with half their bytes in the first block (100.3% in run 82), and the GEMVs alone at
      # those launches, to tell a slow kernel from a slow chain
      t 150 python3 benchmarks/gemv_int4.py --model llama-2-7b --groupsizes 32 --dp4a 1 --codes 1 --xq 0 \
        --layers wqkv,w13,w2 --tune --grid 4:64,8:16,8:32,8:64,16:16,16:32,16:64 --warps 4,8 --prefetch 0 \
        --json "$OUT/gemv-z28.json" | grep -v "^ *$" | tail -60
      JSON=$OUT/h200-z28.json logged_variants 75 0 z28-none:"--quantize int4-g32"
      for l in "gate/up=8,2048,8" "gate/up=8,2048,4" "wide=16,2048,8" "long=8,4096,8" \
               "gate/up=8,2048,8;wide=16,2048,8;long=8,4096,8"; do
        GRAPHDECODE_INT4_LAUNCH="$l" JSON=$OUT/h200-z28.json logged_variants 75 0 "z28-${l//[^a-z0-9]/_}":"--quantize int4-g32"
      done ;;
  z29) # session 18: the int4 g32 GEMV in Gluon, each program's words and codes copied into shared memory by TMA
      # before its PDL wait, then computed in kernels.int4_gemv's small blocks (x in int8): checked against
      # kernels.int4_gemv, then the step's chain of 128 GEMVs against kernels.int4_gemv's
      t 400 python3 benchmarks/gluon_gemv.py --rows 8,16 --warps 4,8 --json "$OUT/gluon-z29.json" ;;
  z31) # each shape alone (its 32 layers chained)
      t 300 python3 benchmarks/gluon_gemv.py --rows 8,16 --warps 4 --by-shape --json "$OUT/gluon-z31.json" ;;
  z32) # the Gluon kernel with its products left out (--load-only): its TMA copies, waits and shared-memory reads alone
      t 200 python3 benchmarks/gluon_gemv.py --rows 16 --warps 4 --each 0,1 --by-shape --load-only --json "$OUT/gluon-z32.json" ;;
  z33) # (run 92, on the warm machine after z32) more warps, more rows
      t 150 python3 benchmarks/gluon_gemv.py --rows 16,32 --warps 8 --each 0 --by-shape --json "$OUT/gluon-z33.json" ;;
  z34) # (run 93) 32 rows at 4 and 2 warps
      t 100 python3 benchmarks/gluon_gemv.py --rows 32 --warps 4,2 --each 0 --by-shape --json "$OUT/gluon-z34.json" ;;
  z35) # prepared in session 18 and never run (no device time left); session 19 ran z36, which covers it: --fast 1
      # (_x_fast/_products_fast: fewer instructions after the wait; offline, 16 rows, 4 warps: w13 2160 -> 1984 a
      # thread, wqkv 1192 -> 1024, w2 2952 -> 2128) and --fast 2 (also each chunk's x loaded a chunk ahead, the units
      # before the PDL wait, the residual right after it), each checked against kernels.int4_gemv before it is timed
      t 300 python3 benchmarks/gluon_gemv.py --rows 16 --warps 4 --each 0,1 --fast 0,1,2 --by-shape \
        --json "$OUT/gluon-z35.json"
      t 200 python3 benchmarks/gluon_gemv.py --rows 8 --warps 2 --fast 2 --by-shape --json "$OUT/gluon-z35-8.json" ;;
  z36) # run 94 (session 19; replaces z35, which never ran): --fast 2 and 3 (3: all of x copied into shared memory by
      # cp.async once, right after the PDL wait, and read there by each chunk: one L2 round trip, not one a chunk),
      # one mbarrier a program or a box, against run 88-93's form (--fast 0) and the copies alone (--load-only);
      # with FAST the boxes are issued chunk by chunk, gate and up together (the order the products take them);
      # --fast 4: as 3, but x in bf16 where decode has it so (all but wo), rounded to int8 by each program, as the
      # Triton kernel does it (the form that could replace kernels.int4_gemv in decode as it stands)
      t 330 python3 benchmarks/gluon_gemv.py --rows 16 --warps 4 --each 0,1 --fast 0,2,3,4 --by-shape --load-only \
        --json "$OUT/gluon-z36.json"
      t 240 python3 benchmarks/gluon_gemv.py --rows 8 --warps 2,4 --each 0,1 --fast 3,4 --by-shape \
        --json "$OUT/gluon-z36-8.json" ;;
  z37) # run 95 (session 19): run 94's best form (--fast 2, one mbarrier a box: 1229.9 against the Triton kernel's
      # 1241.6 us a step) at more warps an SM: 8 rows a program (w2: 4 programs an SM, not 2) and 8 warps a program
      t 300 python3 benchmarks/gluon_gemv.py --rows 8,16 --warps 4,8 --each 1 --fast 2 --by-shape \
        --json "$OUT/gluon-z37.json" ;;
  z38) # run 96 (session 19): the ring kernel (persistent programs, a ring of boxes in shared memory, each box's copy
      # issued --ring boxes ahead of its products, the first ones before the PDL wait; x staged in shared memory,
      # --fast 3 in int8, 4 in bf16 where decode has it), against the Triton kernel in the same run
      t 260 python3 benchmarks/gluon_gemv.py --rows 16 --warps 4,8 --ring 8,16 --per-sm 1 --fast 3,4 --ring-only \
        --by-shape --json "$OUT/gluon-z38.json"
      t 150 python3 benchmarks/gluon_gemv.py --rows 16 --warps 4,8 --ring 8 --per-sm 2 --fast 3 --ring-only \
        --json "$OUT/gluon-z38-2.json"
      t 150 python3 benchmarks/gluon_gemv.py --rows 8 --warps 4 --ring 16,24 --per-sm 1,2 --fast 3 --ring-only \
        --json "$OUT/gluon-z38-8.json" ;;
  z39) # run 97 (session 19): z38's first command again (its by-shape table ended in a naming bug before the chains),
      # and the ring at 3 and 4 programs an SM (run 96: 2 an SM beat 1 an SM)
      t 200 python3 benchmarks/gluon_gemv.py --rows 16 --warps 4,8 --ring 8 --per-sm 1 --fast 3,4 --ring-only \
        --by-shape --json "$OUT/gluon-z39.json"
      t 200 python3 benchmarks/gluon_gemv.py --rows 16 --warps 4 --ring 4,6 --per-sm 3,4 --fast 3,4 --ring-only \
        --by-shape --json "$OUT/gluon-z39-34.json" ;;
  z40) # run 98 (session 19): run 97's best ring (6 boxes, 3 or 4 programs an SM: 1139.9 and 1156.9 us a step with x
      # in int8, against the Triton kernel's 1243.4) with x in bf16 (--fast 4) rounded four chunks at a time (run 97
      # waited on L2 and a barrier at every chunk: 1434.7), and its neighbours at 5 and 7 boxes; --mix: the ring for
      # w13 and w2 only, the Triton kernel for wqkv and wo (which the ring lost by shape)
      t 200 python3 benchmarks/gluon_gemv.py --rows 16 --warps 4 --ring 6 --per-sm 3,4 --fast 3,4 --ring-only \
        --by-shape --mix --json "$OUT/gluon-z40.json"
      t 150 python3 benchmarks/gluon_gemv.py --rows 16 --warps 4 --ring 5,7 --per-sm 3 --fast 3,4 --ring-only \
        --json "$OUT/gluon-z40-57.json" ;;
  z41) # run 99 (session 19): the ring in decode's data flow with x in int8 throughout (--int8-flow): wo, w13 and w2
      # write their y in int8 for the GEMV after them (each tile one group of 16), wqkv is the Triton kernel reading
      # w2's; with and without those epilogues (to set against the plain ring chain timed in the same run: run 98's
      # 1128.2 had the ring for wqkv too), the int8 y checked against int4_quantize_x first
      t 240 python3 benchmarks/gluon_gemv.py --rows 16 --warps 4 --ring 6 --per-sm 3,4 --fast 3 --ring-only \
        --int8-flow --json "$OUT/gluon-z41.json" ;;
  z42) # run 100 (session 20): z41 with the epilogue's sums in each thread (one layout change, the next norm weight
      # loaded with the tile's units), and wqkv also as the ring reading w2's int8 y
      t 240 python3 benchmarks/gluon_gemv.py --rows 16 --warps 4 --ring 6 --per-sm 3 --fast 3 --ring-only \
        --int8-flow --json "$OUT/gluon-z42.json" ;;
  z44) # then the chain of GEMVs in the int8 flow with x's shared memory for a power of 2 of chunks (as measured
      # so far; w2 at 84 KB a program, 2 an SM) and for its chunks alone (w2 75 KB, 3 an SM; int4_ring.py edited
      # here by sed, on the device's copy only); then the GPU tests
      for v in pow2 exact; do
        echo "== x staging: $v"
        [ $v = exact ] && sed -i 's/^    CHUNKS4: gl.constexpr = 4 if CHUNKS <= 4 .*/    CHUNKS4: gl.constexpr = CHUNKS/' int4_ring.py
        grep -n "CHUNKS4: gl" int4_ring.py
        t 120 python3 benchmarks/gluon_gemv.py --rows 16 --warps 4 --ring 6 --per-sm 3 --ring-only --int8-flow \
          --json "$OUT/gluon-z44-$v.json" | grep -E "us a step|differs"
      done
      git checkout int4_ring.py 2>/dev/null || sed -i 's/^    CHUNKS4: gl.constexpr = CHUNKS$/    CHUNKS4: gl.constexpr = 4 if CHUNKS <= 4 else 8 if CHUNKS <= 8 else 16 if CHUNKS <= 16 else 32/' int4_ring.py
      gpu_tests 280 ;;
  z46) # run 101 (session 20, commit 673871b): int4_ring.py in decode (model.TransformerBlock.forward_int8), most
      # needed first: the 7B int4 g32 step with the int8 flow, the ring's GPU tests and the int4 model tests, bf16,
      # then without the ring; cold caches, one process each. (The ring was on by default then, and --int4-no-ring
      # turned it off; the flags below are today's for the same three runs, but since session 21 the ring's flow also
      # runs the attention kernel at 32 positions a loop step: run 101's code is commit 673871b's.)
      JSON=$OUT/h200-z46.json logged_variants 170 0 z461:"--quantize int4-g32 --int4-ring"
      t 150 python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_kernels.py tests/test_cuda.py \
        -k "ring or int8_flow or quantized or int4_wo" | tail -8
      JSON=$OUT/h200-z46.json logged_variants 170 0 z462:"" z463:"--quantize int4-g32 --no-int4-ring" ;;
  z47) # session 20, after run 101 (int4_ring.py off by default): its GPU tests with it turned on in each
      t 150 python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_kernels.py tests/test_cuda.py \
        -k "ring or int8_flow" | tail -8 ;;
  z48) # run 102 (session 21; --int4-ring-no-wqkv needs commit 5026ada, taken out after): the 7B int4 g32 step with the ring for wo, w13 and w2 only (--int4-ring-no-wqkv: wqkv
      # by kernels.int4_gemv reading the ring's int8 x, so that the attention kernel follows a Triton kernel), the
      # ring everywhere, and neither; cold caches, one process each; then the ring's GPU tests (z47's, and the new case)
      JSON=$OUT/h200-z48.json logged_variants 170 0 z481:"--quantize int4-g32 --int4-ring --int4-ring-no-wqkv" \
        z482:"--quantize int4-g32 --int4-ring" z483:"--quantize int4-g32 --no-int4-ring"
      t 150 python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_kernels.py tests/test_cuda.py \
        -k "ring or int8_flow" | tail -8 ;;
  z49) # run 103 (session 21; the runs without the ring now say --no-int4-ring, on by default since run 106): bf16, then the int4 g32 step's kernels with PDL off (--no-pdl --kernels: each
      # kernel's own time), the ring (int8 flow) against kernels.int4_gemv; then the whole GPU suite
      JSON=$OUT/h200-z49.json logged_variants 170 0 z491:""
      for v in z492:"--quantize int4-g32 --int4-ring --no-pdl --kernels" z493:"--quantize int4-g32 --no-int4-ring --no-pdl --kernels"; do
        d=${v%%:*}; f=${v#*:}; echo "== $d [$f]"
        # shellcheck disable=SC2086
        TORCHINDUCTOR_CACHE_DIR=/tmp/$d/inductor TRITON_CACHE_DIR=/tmp/$d/triton t 170 python3 bench.py \
          --model llama-2-7b --modes graphs --batch-sizes 1 $f --json "$OUT/h200-z49.json" | grep -v "^ *$" | tail -22
      done
      gpu_tests 300 ;;
  z50) # run 104 (session 21): the attention kernel at 8 warps and 64 positions a step takes 254 registers a thread
      # (offline, Triton 3.6, sm_90): all 64K of an SM's, so no GEMV program can share its SM, and the GEMV after it
      # cannot start its weights' copies (PDL) on SMs it holds. At 4 warps (32 positions) 128 registers, at 8
      # warps and 32 positions 146. The 7B int4 g32 step with the ring (int8 flow) and with the Triton kernel
      # at each, and 8 slices of the cache (256 programs) at 4 warps
      JSON=$OUT/h200-z50.json logged_variants 170 0 z501:"--quantize int4-g32 --int4-ring --attention-warps 4" \
        z502:"--quantize int4-g32 --int4-ring --attention-block-l 32" z503:"--quantize int4-g32 --no-int4-ring --attention-warps 4" \
        z504:"--quantize int4-g32 --int4-ring" z505:"--quantize int4-g32 --no-int4-ring" \
        z506:"--quantize int4-g32 --no-int4-ring --attention-block-l 32" \
        z507:"--quantize int4-g32 --int4-ring --attention-warps 4 --attention-splits 8" \
        z508:"--quantize int4-g32 --no-int4-ring --attention-warps 4 --attention-splits 8" ;;
  z51) # run 105 (session 21): run 104's best (the ring with the attention kernel at 8 warps, 32 positions a step:
      # 688.6 against 676.1 tok/s) again, its neighbours (16 positions; 8 slices), the ring at the default again
      JSON=$OUT/h200-z51.json logged_variants 170 0 z511:"--quantize int4-g32 --int4-ring --attention-block-l 32" \
        z512:"--quantize int4-g32 --int4-ring --attention-block-l 16" \
        z513:"--quantize int4-g32 --int4-ring --attention-block-l 32 --attention-warps 8 --attention-splits 8" \
        z514:"--quantize int4-g32 --int4-ring" z515:"--quantize int4-g32 --no-int4-ring --attention-block-l 16" ;;
  z52) # run 106 (session 21): int4_ring.py on by default, the attention kernel at 32 positions a step in its flow
      # (int4_ring.ATTENTION_BLOCK_L): the 7B step at int4 g32 (default, and --no-int4-ring), g128 and bf16; then
      # the whole GPU suite
      JSON=$OUT/h200-z52.json logged_variants 170 0 z521:"--quantize int4-g32" z522:"--quantize int4-g32 --no-int4-ring" \
        z523:"--quantize int4-g128" z524:""
      gpu_tests 300 ;;
  z53) # run 107 (session 21): the attention kernel in the ring's flow (8 warps, 32 positions: 146 registers, 37K a
      # program; 3 ring programs take 30K) with its registers capped (offline: 128 -> 126 and no spill, 63K with the
      # ring's; 104 -> 8 bytes of stack, 57K), against no cap
      JSON=$OUT/h200-z53.json logged_variants 100 0 z531:"--quantize int4-g32 --attention-maxnreg 128" \
        z532:"--quantize int4-g32" z533:"--quantize int4-g32 --attention-maxnreg 104" ;;
  z54) # run 108 (session 22): the step without its attention kernel (benchmarks/attention_bound.py: y a view of qkv,
      # no kernel; timing only), against the default step in the same run; then each ring GEMV asking L2 for the
      # next GEMV's first 8, 16, 32 MB as it ends (--int4-ring-prefetch-mb; 8 also as it issues its last box); the
      # attention kernel asking for w13's first 16 MB, alone and with the ring's 16; then the ring's and the
      # attention kernel's GPU tests
      echo "== z541 [attention_bound.py --quantize int4-g32]"
      TORCHINDUCTOR_CACHE_DIR=/tmp/z541/inductor TRITON_CACHE_DIR=/tmp/z541/triton timeout -k 5 170 python3 \
        benchmarks/attention_bound.py --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int4-g32 \
        --json "$OUT/h200-z54.json" > /tmp/z541.log 2>&1; echo "rc $?"; grep -E "graphs  |Error|error" /tmp/z541.log | head -5
      JSON=$OUT/h200-z54.json logged_variants 170 0 z542:"--quantize int4-g32" \
        z543:"--quantize int4-g32 --int4-ring-prefetch-mb 8" z544:"--quantize int4-g32 --int4-ring-prefetch-mb 16" \
        z545:"--quantize int4-g32 --int4-ring-prefetch-mb 8 --int4-ring-prefetch-early" \
        z546:"--quantize int4-g32 --int4-ring-prefetch-mb 32" z547:"--quantize int4-g32 --attention-prefetch-mb 16" \
        z548:"--quantize int4-g32 --int4-ring-prefetch-mb 16 --attention-prefetch-mb 16"
      t 200 python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_kernels.py -k "ring or attention" | tail -15 ;;
  z54b) # run 109 (session 22): z54's attention_bound.py again (its stand-in now taking `then`, run 108's keyword), then
      # the default step, in one call
      echo "== z541b"; TORCHINDUCTOR_CACHE_DIR=/tmp/z541/inductor TRITON_CACHE_DIR=/tmp/z541/triton timeout -k 5 170 \
        python3 benchmarks/attention_bound.py --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int4-g32 \
        --json "$OUT/h200-z54b.json" 2>&1 | grep -E "graphs  |Error"
      echo "== z542b default"; TORCHINDUCTOR_CACHE_DIR=/tmp/z542/inductor TRITON_CACHE_DIR=/tmp/z542/triton timeout -k 5 \
        170 python3 bench.py --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int4-g32 \
        --json "$OUT/h200-z54b.json" 2>&1 | grep -E "graphs  |Error" ;;
  z55) # run 110 (session 22): the attention kernel's cache slices in the ring's flow (the rule: 4 at bench.py's 224
      # positions; 32 positions a loop step): 1 slice (no merge, 32 programs), 2 slices, 2 slices at 64 positions
      JSON=$OUT/h200-z55.json logged_variants 170 0 z551:"--quantize int4-g32 --attention-splits 1" \
        z552:"--quantize int4-g32 --attention-splits 2" z553:"--quantize int4-g32 --attention-splits 2 --attention-block-l 64" \
        z554:"--quantize int4-g32" ;;
  z56) # run 111 (session 23): kernels._attention_one_kernel (one query head a KV head, [positions, D] tiles, 64
      # registers at 4 warps offline) against the grouped kernel in the ring's flow; its floor (attention_bound.py
      # --floor: the kernel at position 0, no cached positions); one warm inductor cache for all (same graph)
      for v in z561:"" z562:"--attention-one 1" floor:"" \
               z565:"--attention-one 1 --attention-splits 1 --attention-block-l 256 --attention-warps 8" \
               z563:"--attention-one 1 --attention-warps 8" z564:"--attention-one 1 --attention-block-l 64" \
               z566:""; do
        d=${v%%:*}; f=${v#*:}; prog=bench.py; [ "$d" = floor ] && prog="benchmarks/attention_bound.py --floor"
        echo "== $d [$f] $(date +%T)"
        # shellcheck disable=SC2086
        TORCHINDUCTOR_CACHE_DIR=/tmp/z56/inductor TRITON_CACHE_DIR=/tmp/z56/triton timeout -k 5 150 python3 $prog \
          --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int4-g32 $f --json "$OUT/h200-z56.json" \
          > "/tmp/$d.log" 2>&1; echo "rc $?"; grep -E "graphs  |Error|error" "/tmp/$d.log" | head -5
      done ;;
  z57) # run 112 (session 23): _attention_one_kernel with slices active only where they have cached positions (one:
      # no merge), its block of positions and warps; the grouped kernel (z571, z577) on either side
      for v in z571:"" z572:"--attention-one 1 --attention-block-l 64" z573:"--attention-one 1 --attention-block-l 32" \
               z574:"--attention-one 1 --attention-block-l 64 --attention-warps 8" \
               z575:"--attention-one 1 --attention-block-l 128 --attention-warps 8" \
               z576:"--attention-one 1 --attention-block-l 32 --attention-splits 8" z577:""; do
        d=${v%%:*}; f=${v#*:}; echo "== $d [$f] $(date +%T)"
        # shellcheck disable=SC2086
        TORCHINDUCTOR_CACHE_DIR=/tmp/z56/inductor TRITON_CACHE_DIR=/tmp/z56/triton timeout -k 5 150 python3 bench.py \
          --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int4-g32 $f --json "$OUT/h200-z57.json" \
          > "/tmp/$d.log" 2>&1; echo "rc $?"; grep -E "graphs  |Error|error" "/tmp/$d.log" | head -5
      done ;;
  z58) # run 113 (session 23): _attention_one_kernel on by default (64 positions a step, 4 warps) against the grouped
      # kernel (--attention-one 0): int4 g32 at batch 1, bf16 at batches 1 and 8, int4 g32 at batch 8
      for v in z581:"--quantize int4-g32" z582:"--quantize int4-g32 --attention-one 0" z583:"--batch-sizes 1,8" \
               z584:"--batch-sizes 1,8 --attention-one 0" z585:"--quantize int4-g32 --batch-sizes 8" \
               z586:"--quantize int4-g32 --batch-sizes 8 --attention-one 0"; do
        d=${v%%:*}; f=${v#*:}; echo "== $d [$f] $(date +%T)"
        # shellcheck disable=SC2086
        TORCHINDUCTOR_CACHE_DIR=/tmp/z58/inductor TRITON_CACHE_DIR=/tmp/z58/triton timeout -k 5 170 python3 bench.py \
          --model llama-2-7b --modes graphs --batch-sizes 1 $f --json "$OUT/h200-z58.json" \
          > "/tmp/$d.log" 2>&1; echo "rc $?"; grep -E "graphs  |Error|error" "/tmp/$d.log" | head -5
      done ;;
  z59) # run 114 (session 23): the speed table again with _attention_one_kernel on (int8, int4 g128, int4 g32, batch 1)
      for v in z591:"--quantize int8" z592:"--quantize int4-g128" z593:"--quantize int4-g32"; do
        d=${v%%:*}; f=${v#*:}; echo "== $d [$f] $(date +%T)"
        # shellcheck disable=SC2086
        TORCHINDUCTOR_CACHE_DIR=/tmp/z59/inductor TRITON_CACHE_DIR=/tmp/z59/triton timeout -k 5 170 python3 bench.py \
          --model llama-2-7b --modes graphs --batch-sizes 1 $f --json "$OUT/h200-z59.json" \
          > "/tmp/$d.log" 2>&1; echo "rc $?"; grep -E "graphs  |Error|error" "/tmp/$d.log" | head -5
      done ;;
  z60) # session 24, run 115, on commit 7ed90b6 (the settings lost and were removed after it; this call needs that
      # commit): int4_ring.WAIT (wo waits on the attention kernel's count of programs done
      # instead of on its end) and WAIT_QKV (the attention kernel so on wqkv's); w2 resets the counts. GPU tests first
      # (a deadlock ends in the timeout), then the step without, with each, with both, twice for the plain and both;
      # z606: the kernels of a few steps with both, to see that no copy of the counts crept into the step
      timeout -k 5 240 python3 -m pytest -q -x tests/test_kernels.py tests/test_cuda.py \
        -k "ring_flags or counts_its_programs or ring_waits" 2>&1 | tail -3
      for v in z601:"" z602:"--int4-ring-wait" z603:"--int4-ring-wait-qkv" z604:"--int4-ring-wait --int4-ring-wait-qkv" \
               z605:"" z607:"--int4-ring-wait --int4-ring-wait-qkv" \
               z606:"--int4-ring-wait --int4-ring-wait-qkv --kernels"; do
        d=${v%%:*}; f=${v#*:}; echo "== $d [$f] $(date +%T)"
        # shellcheck disable=SC2086
        TORCHINDUCTOR_CACHE_DIR=/tmp/z60/inductor TRITON_CACHE_DIR=/tmp/z60/triton timeout -k 5 150 python3 bench.py \
          --model llama-2-7b --modes graphs --batch-sizes 1 --quantize int4-g32 $f --json "$OUT/h200-z60.json" \
          > "/tmp/$d.log" 2>&1; echo "rc $?"; grep -E "graphs  |Error|error" "/tmp/$d.log" | head -5
      done
      grep -A40 "kernels of 4 decode steps" /tmp/z606.log | head -45 ;;
  z74) # session 30, last: bf16 and int4 g32 on a third machine (bench.py now records MASKED and ONE_SUM), then
      # ring_launch.py's new flags: both off against DEFAULT (both on), by hand-captured graph
      same_cache_benches z74 120 z741:"" z742:"--quantize int4-g32"
      TRITON_CACHE_DIR=/tmp/z74/triton t 100 python3 benchmarks/ring_launch.py --launches "nomasked;noonesum|DEFAULT" \
        --json "$OUT/ring-flags-h200.json" | grep -v "^ *_warn" ;;
  z73) # session 30: the speed table on one machine, as z61: bf16, int4 g32, int8, int4 g128, bf16, int4 g32
      same_cache_benches z73 150 z731:"" z732:"--quantize int4-g32" z733:"--quantize int8" z734:"--quantize int4-g128" z735:"" \
        z736:"--quantize int4-g32" ;;
  z72) # session 30: every GPU test with MASKED and ONE_SUM on by default (and ONE_SUM's one-byte path made equal to
      # int16 codes with zeros 0)
      gpu_tests 560 ;;
  z71) # session 30: MASKED and ONE_SUM on by default: bf16 then int4 g32 through bench.py, one machine
      for v in z711:"" z712:"--quantize int4-g32"; do
        d=${v%%:*}; f=${v#*:}; echo "== $d [$f] $(date +%T)"
        # shellcheck disable=SC2086
        bench7b "$d" --repeat 2 $f | grep -E "graphs  |rror"
      done ;;
  z70) # (history: ran when both were off by default; ring_launch.py's DEFAULT is now both on) session 30: int4_ring.MASKED (z69's) and ONE_SUM (a tile's rows summed across lanes once: 20 shuffles and adds
      # a thread and tile fewer): their tests, then the whole step A/B/C/D twice in one process, and graphs A/D
      t 170 python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_kernels.py \
        -k "masked or reading_x_in_int8 or writes_its_output" | tail -8
      TORCHINDUCTOR_CACHE_DIR=/tmp/z70/inductor TRITON_CACHE_DIR=/tmp/z70/triton t 400 python3 benchmarks/ring_launch.py \
        --launches "DEFAULT|masked|onesum|masked;onesum|DEFAULT|masked|onesum|masked;onesum" \
        --graphs "DEFAULT|masked;onesum" --json "$OUT/ring-onesum-h200.json" ;;
  z69) # session 29: int4_ring.MASKED (_dot_masked: 8 of the 165 instructions of a chunk step's block fewer, the same
      # numbers): its test, then the whole step A/B in one process, manual ABAB and graphs AB (ring_launch.py)
      t 150 python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_kernels.py -k masked | tail -6
      TORCHINDUCTOR_CACHE_DIR=/tmp/z69/inductor TRITON_CACHE_DIR=/tmp/z69/triton t 200 python3 benchmarks/ring_launch.py \
        --launches "DEFAULT|masked|DEFAULT|masked" --graphs "DEFAULT|masked" --json "$OUT/ring-masked-h200.json" ;;
  z68) # session 29: every GPU test on the code after the 4-bit codes were taken out again (runs 144-145 above: they
      # did not pay), with one-byte codes now taken with the norm
      gpu_tests 320 ;;
  z67) # (history: needs commit 026ea3a; its options are gone) session 29, run 145: 4-bit codes with units a chunk (32 groups), read into shared memory a tile at a time:
      # the layout under the GPU's Triton, the ring's kernel tests and the model-level test, then the 7B step with 4-bit
      # codes, with 8-bit codes, and bf16 on the same machine
      t 120 python3 benchmarks/ring_smem.py --variants nibble,int16 --norm 0,1 --swiglu 0,1 --k 2816 --stages 5 \
        | grep -E "^codes|overlap|rror"
      t 240 python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_kernels.py -k int4_ring \
        | tail -15
      t 150 python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_cuda.py -k int8_flow | tail -8
      for v in z671:"--quantize int4-g32-c4" z672:"--quantize int4-g32" z673:""; do
        d=${v%%:*}; f=${v#*:}; echo "== $d [$f] $(date +%T)"
        # shellcheck disable=SC2086
        TORCHINDUCTOR_CACHE_DIR=/tmp/z67/inductor TRITON_CACHE_DIR=/tmp/z67/triton timeout -k 5 150 python3 bench.py \
          --model llama-2-7b --modes graphs --batch-sizes 1 --repeat 2 $f --json "$OUT/h200-z67.json" \
          > "/tmp/$d.log" 2>&1; echo "rc $?"; grep -E "graphs  |Error|error" "/tmp/$d.log" | head -5
      done ;;
  z65) # (history: needs commit 521d8a7; its options are gone) session 29, run 144: 4-bit codes with units a block of 8 groups, each chunk step's units
      # gathered from global memory a step ahead ([BN, 32] loads): the kernel tests (its own test's stride check was
      # wrong: codes moved to the GPU lose their padding), the model-level test, then the 7B step (674.5 tok/s, against
      # ~723 for int16 codes) and bf16
      t 240 python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_kernels.py -k int4_ring \
        | tail -15
      t 150 python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_cuda.py -k int8_flow | tail -8
      for v in z651:"--quantize int4-g32-c4b8" z652:""; do
        d=${v%%:*}; f=${v#*:}; echo "== $d [$f] $(date +%T)"
        # shellcheck disable=SC2086
        TORCHINDUCTOR_CACHE_DIR=/tmp/z65/inductor TRITON_CACHE_DIR=/tmp/z65/triton timeout -k 5 150 python3 bench.py \
          --model llama-2-7b --modes graphs --batch-sizes 1 --repeat 2 $f --json "$OUT/h200-z65.json" \
          > "/tmp/$d.log" 2>&1; echo "rc $?"; grep -E "graphs  |Error|error|ring" "/tmp/$d.log" | head -5
      done ;;
  z64) # prepared in session 28, run in session 29 as run 143 (ring_smem.py failed under Triton 3.6: fixed since): the fix of
      # one-byte codes with the norm (int4_ring._x_stage), its test (21 passed, BYTE_CODES_WITH_NORM on), then every ring layer
      # with one-byte codes timed (graphs 767.4 tok/s, int16 723.5), then bf16 (282.5) for the ratio. First the layout (3.6)
      t 120 python3 benchmarks/ring_smem.py --variants int16,int8 --norm 0,1 --swiglu 0,1 | tail -40
      t 200 python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_kernels.py -k int4_ring | tail -4
      TORCHINDUCTOR_CACHE_DIR=/tmp/z64/inductor TRITON_CACHE_DIR=/tmp/z64/triton t 400 python3 benchmarks/ring_codes.py \
        --graphs --all-layers --repeat 2 --cycles 2 --json "$OUT/ring-codes-h200.json"
      TORCHINDUCTOR_CACHE_DIR=/tmp/z64/inductor TRITON_CACHE_DIR=/tmp/z64/triton t 100 python3 bench.py \
        --model llama-2-7b --modes graphs --batch-sizes 1 --repeat 2 --json "$OUT/h200-z64.json" | grep "graphs  " ;;
  z63) # session 28, runs 141 (every ring layer: the norm's GEMVs gave wrong numbers) and 142 (wo and w2 only): one
      # code byte a group in the ring (int4_ring.code_bytes): its kernel tests, then the timing probe (manual and
      # graphs, zeros dropped: time only), then bf16 on the same machine for the ratio
      t 200 python3 -m pytest -q -m cuda -p no:logging -p no:warnings --tb=short tests/test_kernels.py -k int4_ring | tail -4
      TORCHINDUCTOR_CACHE_DIR=/tmp/z63/inductor TRITON_CACHE_DIR=/tmp/z63/triton t 300 python3 benchmarks/ring_codes.py \
        --graphs --repeat 2 --json "$OUT/ring-codes-h200.json"
      TORCHINDUCTOR_CACHE_DIR=/tmp/z63/inductor TRITON_CACHE_DIR=/tmp/z63/triton t 100 python3 bench.py \
        --model llama-2-7b --modes graphs --batch-sizes 1 --repeat 2 --json "$OUT/h200-z63.json" | grep "graphs  " ;;
  z61) # session 28, run 140 (was planned after session 27): the speed table on ONE machine with generate.prime_capture: bf16, int4
      # g32, int8, int4 g128, bf16 and int4 g32 again (machine spread is +-5-10 tok/s, so the ratio needs one machine)
      same_cache_benches z61 150 z611:"" z612:"--quantize int4-g32" z613:"--quantize int8" z614:"--quantize int4-g128" z615:"" \
        z616:"--quantize int4-g32" ;;
  z30) # then one mbarrier a box (--each 1): each chunk computed as soon as it lands
      t 400 python3 benchmarks/gluon_gemv.py --rows 8,16 --warps 4 --each 0,1 --json "$OUT/gluon-z30.json" ;;
esac; done
