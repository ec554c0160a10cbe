#!/usr/bin/env bash
# Issue 32's open GPU measurements as stages, each one device call of under ten minutes on one H200/H100.
# Here first (once): ../shared/device/prepare-wheels.sh        (megatron-core's wheel into .whl/, ignored by git)
# Then one device call per stage, carrying .whl, e.g. the command
#     bash benchmarks/gpu_round.sh fp8_tests
# Every log is teed under $OUT (it comes back even when the call runs out of time); the JSON lines of the
# benchmarks are in the logs (`grep RESULT`), the markdown tables at their ends.
#
#   fp8_tests   tests/gpu/test_fp8_gpu.py (every recipe, eager and compiled, tracks bf16; cached weights dropped
#               after each step; weight gradients through main_grad)                          ~5 min
#   fp8_llama   Llama-1B shape, 4 micro-batches of 2 x 2048: bf16, FP8 delayed, FP8 tensorwise, FP8 delayed in
#               every layer (Megatron-LM's default; ours keeps the first and last in bf16)        ~8 min
#   fp8_1p5b    GPT-2 1.5B, one micro-batch of 16 x 1024: bf16, FP8 delayed, FP8 tensorwise    ~6 min
#   fp8_profile kernel time by kind, Llama-1B FP8 delayed (beside BENCHMARKS.md's bf16 and tensorwise rows)  ~3 min
#   steady      GPT-2 124M, five runs back to back with Python's collector as it is, five with manual_gc  ~9 min
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?"stage: fp8_tests | fp8_llama | fp8_1p5b | fp8_profile | steady"}
out=${OUT:-/tmp/gpu_round}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$out/gpu.txt"
T="python benchmarks/train_throughput.py"
case "$stage" in
  fp8_tests)
    python -m pytest -q tests/gpu/test_fp8_gpu.py 2>&1 | tee "$out/fp8_tests.log" ;;
  fp8_llama)
    for fp8 in "" "--fp8 hybrid --fp8_recipe delayed" "--fp8 hybrid --fp8_recipe tensorwise" \
               "--fp8 hybrid --fp8_recipe delayed --fp8_all_layers"; do
      $T --sizes llama-1b --seq 2048 --global_batch 8 --num_micro 4 --modes megatron_compile --steps 8 --warmup 2 $fp8
    done 2>&1 | tee "$out/fp8_llama.log" ;;
  fp8_1p5b)
    for fp8 in "" "--fp8 hybrid --fp8_recipe delayed" "--fp8 hybrid --fp8_recipe tensorwise"; do
      $T --sizes 1.5b --num_micro 1 --modes megatron_compile --steps 8 --warmup 2 $fp8
    done 2>&1 | tee "$out/fp8_1p5b.log" ;;
  fp8_profile)
    python benchmarks/profile_step.py --size llama-1b --seq 2048 --global_batch 8 --num_micro 4 \
      --mode megatron_compile --steps 3 --warmup 2 --fp8 hybrid --fp8_recipe delayed 2>&1 | tee "$out/fp8_profile.log" ;;
  steady)
    # one untimed run fills the compile cache, so that no timed run pays a cold compile
    $T --sizes 124m --modes megatron_compile --steps 3 --warmup 1 > "$out/steady_warm.log" 2>&1
    for gc in "" "--manual_gc 0"; do
      for i in 1 2 3 4 5; do
        $T --sizes 124m --modes megatron_compile --steps 30 --warmup 3 $gc
      done
    done 2>&1 | tee "$out/steady.log"
    grep '^{' "$out/steady.log" | python -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin]
for variant in sorted({r["mode"] for r in rows}):
    tok = [r["tok_s"] for r in rows if r["mode"] == variant]
    print(f"{variant}: {tok} spread {(max(tok) - min(tok)) / max(tok):.1%}")
' | tee "$out/steady_summary.txt" ;;
  *)
    echo "unknown stage $stage" >&2; exit 2 ;;
esac
