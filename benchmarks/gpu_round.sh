#!/usr/bin/env bash
# Issue 32's open GPU measurements as stages, each one device call of under ten minutes on one H200/H100 (the two_gpu_*
# stages on nvidia-h200-x2).
# Here first (once): ../shared/device/prepare-wheels.sh        (megatron-core's wheel into .whl/, ignored by git)
# Then one device call per stage, carrying .whl, e.g. the command
#     bash benchmarks/gpu_round.sh fp8_tests
# Every log is teed under $OUT (it comes back even when the call runs out of time); the JSON lines of the
# benchmarks are in the logs (`grep RESULT`), the markdown tables at their ends.
#
#   fp8_tests   tests/gpu/test_fp8_gpu.py (every recipe, eager and compiled, tracks bf16; cached weights dropped
#               after each step; weight gradients through main_grad; C++ wrapper against Python wrapper)  ~5 min
#   fp8_llama   Llama-1B shape, 4 micro-batches of 2 x 2048: bf16, FP8 delayed, FP8 tensorwise, FP8 delayed in
#               every layer (Megatron-LM's default; ours keeps the first and last in bf16)        ~8 min
#   fp8_llama_mb1  the same tokens a step in one micro-batch of 8 x 2048: bf16, FP8 delayed, FP8 tensorwise (the FP8
#               step's host work is per micro-batch and per linear: a quarter of the calls)        ~6 min
#   fp8_1p5b    GPT-2 1.5B, one micro-batch of 16 x 1024: bf16, FP8 delayed, FP8 tensorwise    ~6 min
#   fp8_profile kernel time by kind and the GPU's idle stretches charged to the host ranges before them
#               (--gaps), Llama-1B FP8 delayed and tensorwise; then bf16 and tensorwise at 8 x 512   ~6 min
#   fp8_wrappers  FP8 tensorwise under each Inductor wrapper, now that the FP8 layer graphs have static sizes
#               (the C++ wrapper's earlier 40 ms loss came with symbolic sizes): at 8 x 512 tokens, where the FP8 step
#               waits on the host (0.81x bf16 before), bf16 beside it; then delayed at 2 x 2048 under the C++ one  ~7 min
#   fp8_parity [RECIPE]  300 steps of Llama-1B, bf16 and FP8 (tensorwise unless named; RECIPE+output: with
#               fp8_output_layer), on ~10 MB of docstrings
#               built there (from the packages installed there, so both arms in one call): the parity again after
#               the forward's fast accumulation                                                   ~7 min
#   steady      GPT-2 124M, five runs back to back (200 timed steps each), with the host
#               and GPU telemetry that can explain a slow run (clocks and power each second, which CPU each
#               run was on, the load, the GPU's NUMA-local CPUs)                                  ~8 min
#   steady_gc   the same five with manual_gc (Megatron-LM's manual garbage collection)            ~8 min
#   steady_pin  the same five, each process pinned to the GPU's NUMA-local CPUs (taskset), as accelerate
#               launch --enable_cpu_affinity pins (half the CPUs where there is one NUMA node)    ~8 min
#   steady_graphs  the same five with CUDA graphs (accelerate's TorchDynamoPlugin(mode="reduce-overhead")): the host
#               launches a graph per layer instead of its kernels, so a slow host stretch need not reach the GPU  ~8 min
#   two_gpu_rows  (nvidia-h200-x2) check 5 at GPT-2 774M: one GPU; DP = 2 with the distributed optimizer at the
#               same global batch (16: each GPU half the one-GPU micro-batch) and at the same per-GPU batch (32);
#               TP = 2 + SP, without and with the full-iteration CUDA graph                           ~8 min
#   full_graph_tests  tests/gpu/test_full_graph_gpu.py's one-GPU cases (GPT-2 compiled, eager, with dropout; Llama
#               compiled), each trained with and without the full-iteration graph                 ~9 min
#   full_graph_tests_x2 (nvidia-h200-x2) full_graph_tests' one-GPU cases (FP8 ones included), one pytest a GPU
#               (~5 min); then fp8_graph_rows (Llama-1B FP8 delayed and tensorwise with the graph, ~4 min)
#   fp8_graph   (nvidia-h200-x2, or one GPU with the tests in turn) FP8 under the full-iteration graph: its GPU tests
#               (tensor-wise compiled, delayed compiled and eager, each against the eager step), then Llama-1B bf16,
#               FP8 tensorwise and FP8 delayed, each with the graph (delayed was host-bound without it)   ~9 min
#   fp8_output  (one H200) fp8_output_layer's GPU tests, then Llama-1B FP8 tensorwise with the output layer in FP8,
#               and with every layer too, with the graph (against fp8_graph_rows' 69,990 and bf16's 64,031)  ~8 min
#   dropout_tests (nvidia-h200-x2; one GPU runs the first half) compiled layers with dropout on (the tracker fork
#               outside dynamo, 2026-11-30): tests/gpu/test_dropout_compiled_gpu.py and the full graph's
#               gpt2_compiled_dropout on one GPU, then the two-GPU cases (tp2, and tp2_compiled_dropout's graph)  ~6 min
#   two_gpu_tp_graph (nvidia-h200-x2) TP = 2 at 774M with the full-iteration graph (GPU-bound, 47 of 138 ms in NCCL):
#               without SP (all-reduces: fewer, cheaper collectives, but the norms on the whole sequence), with SP,
#               and with SP under NCCL settings that may move 42 MiB faster (32 channels; the Simple protocol);
#               first benchmarks/two_stream_probe.py: two micro-batches' SP chains on two streams in one graph  ~8 min
#   two_gpu_full_graph (nvidia-h200-x2) its two-GPU cases (GPT-2 TP = 2 + SP with dropout, Llama TP = 2 + SP, DP = 2
#               with the distributed optimizer), then the DP = 2 row with the graph               ~9 min
#   two_gpu_overlap (nvidia-h200-x2) whether Inductor hides SP's collectives itself when each compiled layer runs two
#               halves of its batch (benchmarks/compiler_overlap_probe.py: forward and backward, its overlap scheduler
#               and reordering passes; the hand-made Domino forward won 1.33x in two_stream_probe), then the
#               TP = 2 + SP row with the graph that two_gpu_domino's rows are held against                  ~6 min
#   two_gpu_domino (nvidia-h200-x2) the same on the real model (benchmarks/domino_patch.py, an experiment): TP = 2 + SP at
#               774M with the graph: DeepSpeed Domino's way by hand (two halves, asynchronous collectives both
#               ways), then each compiled layer on two halves with its SP collectives visible to Inductor (its
#               reordering passes, its default order); `two_gpu_domino halves_sched visible` for the others. Each
#               row's warm-up losses against two_gpu_overlap's baseline row                               ~7 min
#   two_gpu_domino_profile [MODE] (nvidia-h200-x2) profiles of the TP = 2 + SP step with the graph, plain and with
#               the Domino mode (default hand): kernels by kind, NCCL's share, the GPU's gaps              ~6 min
#   two_gpu_graph_rest (nvidia-h200-x2) every two-GPU graph case (bit for bit the eager step since the capture-stream
#               fix, 2026-11-30), each arm capped at 180 s by the test harness, which then prints every rank's Python
#               stacks, then the DP = 2 row with the graph (159,349 tok/s before the fix)                       ~8 min
#   two_gpu_ce  (nvidia-h200-x2) SP's collectives on the copy engines (benchmarks/ce_collectives_patch.py, an experiment):
#               first benchmarks/async_tp_probe.py (its last rows: NCCL's gather and reduce-scatter alone against
#               symmetric memory's copy-engine ops), then TP = 2 + SP at 774M with the graph, the compiled linears'
#               collectives on the copy engines (against 124,382 tok/s with NCCL), then DeepSpeed Domino's layer by
#               hand with its collectives on the copy engines too (taking no SMs, they may now hide under the other
#               half's GEMMs where NCCL's did not); `two_gpu_ce nograph` runs both rows without the graph  ~8 min
#   two_gpu_ce_ab (nvidia-h200-x2) TP = 2 + SP at 774M with the graph in one call: NCCL, then Domino's layer with its
#               collectives on the copy engines (125,997 tok/s against 124,382 a session earlier)          ~4 min
#   two_gpu_generation (nvidia-h200-x2) issue 12's GPU rows never taken: megatron_generate at TP = 2 (CUDA-graph decode
#               and eager) and PP = 2 (eager), bf16, batches 1 and 32 (the one-GPU rows are in BENCHMARKS.md)  ~5 min
#   two_gpu_big_model (nvidia-h200-x2) issue 14's run never taken: a Llama-2-7B-shaped random bf16 checkpoint prepared
#               without weights at TP = 2 + SP, 5 steps, save_model, prepared again (benchmarks/big_model_gpu.py)  ~8 min
#   full_graph_hf  (one H200) check 3 where the host counted: 350M and 124M, the plugin with the full-iteration
#               graph beside HF + compile                                                          ~8 min
#   two_gpu_dp    (nvidia-h200-x2) where DP = 2 at global 16 loses to 2x one GPU, now that its step is GPU-bound: one GPU
#               at 8 sequences (each DP rank's share: the ceiling), then DP = 2 with NCCL held to 16 and to 8 CTAs
#               (NCCL_MAX_CTAS; its 24 channels take SMs from the backward's GEMMs while the gradients reduce)  ~6 min
#   two_gpu_tp    (nvidia-h200-x2) TP = 2 + SP at 774M where the host bounds it (sync wait 0, 2026-11-29): under
#               Inductor's Python wrapper (--cpp_wrapper off; the engine gives TP layers the C++ one since
#               2026-11-29), with tp_comm_overlap (torch's symmetric-memory ops), under CUDA graphs (reduce-overhead),
#               with CUDA_DEVICE_MAX_CONNECTIONS=1                                                 ~8 min
#   two_gpu_profiles (nvidia-h200-x2) profiles at 774M: TP = 2 + SP (with the host's ranges by self time: the
#               step is host-bound), DP = 2 (distributed optimizer, global 16), one GPU: where each two-GPU step
#               exceeds half the one-GPU step                                                      ~5 min
#   two_gpu_graphs (nvidia-h200-x2) why CUDA graphs (reduce-overhead) made TP = 2 + SP slower (52,884 tok/s against ~84k,
#               2026-11-29) where the step is host-bound and graphs should help: its profile (kernels by kind, the
#               GPU's gaps, the host's ranges) beside the default's                                  ~4 min
#   two_gpu_nccl  (nvidia-h200-x2) the GPUs' link: topology, NVLink state, NCCL's transport, collective bandwidth;
#               then whether overlapping TP's collectives with its GEMMs (torch's symmetric-memory fused ops) pays
#               at 774M's shapes (benchmarks/async_tp_probe.py)                                     ~2 min
#   two_gpu_nccl_env (nvidia-h200-x2) SP's collectives under NCCL's settings that shape a 2-GPU NVLink transfer
#               (channels, protocol, threads, buffer size), then the copy-engine probe: which, if any, moves 42 MiB
#               faster than NCCL's default (~0.12 ms); TP = 2 + SP at 774M is NCCL-bound between its GEMMs   ~3 min
#   two_gpu_tests (nvidia-h200-x2) every test in tests/gpu marked two_gpus (the backlog since issue 11), in
#               file order; pass file names after the stage to run a part                        ~10 min
# Every stage logs the GPU's power and clocks each second ($OUT/<stage>_dmon.log).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?"stage: fp8_tests | fp8_llama | fp8_llama_mb1 | fp8_1p5b | fp8_profile | fp8_wrappers | fp8_parity | steady | steady_gc | steady_pin | steady_graphs | two_gpu_rows | full_graph_tests | two_gpu_full_graph | full_graph_hf | two_gpu_dp | two_gpu_tp | two_gpu_profiles | two_gpu_graphs | two_gpu_nccl | two_gpu_nccl_env | full_graph_tests_x2 | fp8_graph | fp8_graph_rows | fp8_output | dropout_tests | two_gpu_tp_graph | two_gpu_overlap | two_gpu_domino | two_gpu_domino_profile | two_gpu_graph_rest | two_gpu_ce | two_gpu_ce_ab | two_gpu_generation | two_gpu_big_model | two_gpu_tests"}
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
# the GPU's power and clocks each second, every stage: a busy H200 runs at its 700 W cap with the SM clock ~12% down,
# which a timed run (GPU busy throughout) feels and a profiled one (host slowed by the profiler) may not
nvidia-smi dmon -s pc -o T > "$out/${stage}_dmon.log" 2>&1 &
dmon=$!
trap 'kill $dmon 2>/dev/null' EXIT
# the stages' own background jobs; a bare `wait` would wait for dmon too, which never ends (two calls hung to their
# cap on it, 2026-11-30)
wait_jobs() { local p; for p in $(jobs -p); do [ "$p" = "$dmon" ] || wait "$p"; done; }
T="python benchmarks/train_throughput.py"
case "$stage" in
  fp8_tests)
    python -m pytest -q tests/gpu/test_fp8_gpu.py 2>&1 | tee "$out/fp8_tests.log" ;;
  fp8_llama)
    for fp8 in "" "--fp8 hybrid --fp8_recipe delayed" "--fp8 hybrid --fp8_recipe tensorwise" \
               "--fp8 hybrid --fp8_recipe delayed --fp8_all_layers"; do
      $T --sizes llama-1b --seq 2048 --global_batch 8 --num_micro 4 --modes megatron_compile --steps 8 --warmup 2 $fp8
    done 2>&1 | tee "$out/fp8_llama.log" ;;
  fp8_llama_mb1)
    for fp8 in "" "--fp8 hybrid --fp8_recipe delayed" "--fp8 hybrid --fp8_recipe tensorwise"; do
      $T --sizes llama-1b --seq 2048 --global_batch 8 --num_micro 1 --modes megatron_compile --steps 8 --warmup 2 $fp8
    done 2>&1 | tee "$out/fp8_llama_mb1.log" ;;
  fp8_1p5b)
    for fp8 in "" "--fp8 hybrid --fp8_recipe delayed" "--fp8 hybrid --fp8_recipe tensorwise"; do
      $T --sizes 1.5b --num_micro 1 --modes megatron_compile --steps 8 --warmup 2 $fp8
    done 2>&1 | tee "$out/fp8_1p5b.log" ;;
  fp8_profile)
    for recipe in delayed tensorwise; do
      python benchmarks/profile_step.py --size llama-1b --seq 2048 --global_batch 8 --num_micro 4 \
        --mode megatron_compile --steps 3 --warmup 2 --gaps 25 --fp8 hybrid --fp8_recipe $recipe
    done 2>&1 | tee "$out/fp8_profile.log"
    # the parity run's shape (8 x 512 tokens a step), where FP8 tensorwise logged 0.81x bf16: the host's share
    # of the FP8 step at its largest, bf16 beside it
    for fp8 in "" "--fp8 hybrid --fp8_recipe tensorwise"; do
      python benchmarks/profile_step.py --size llama-1b --seq 512 --global_batch 8 --num_micro 1 \
        --mode megatron_compile --steps 3 --warmup 2 --gaps 25 $fp8
    done 2>&1 | tee "$out/fp8_profile_512.log" ;;
  fp8_wrappers)
    L="--sizes llama-1b --modes megatron_compile --steps 8 --warmup 2"
    for arm in "" "--fp8 hybrid --fp8_recipe tensorwise" "--fp8 hybrid --fp8_recipe tensorwise --cpp_wrapper on"; do
      $T $L --seq 512 --global_batch 8 --num_micro 1 $arm
    done 2>&1 | tee "$out/fp8_wrappers.log"
    $T $L --seq 2048 --global_batch 8 --num_micro 4 --fp8 hybrid --fp8_recipe delayed --cpp_wrapper on 2>&1 \
      | tee -a "$out/fp8_wrappers.log" ;;
  fp8_parity)
    recipe=${2:-tensorwise}
    mkdir -p "$out/parity"
    python benchmarks/docstring_corpus.py --out "$out/docstrings.txt" > "$out/fp8_parity_corpus.log" 2>&1
    python benchmarks/fp8_parity.py --sizes llama-1b --arms "bf16,$recipe" --train_file "$out/docstrings.txt" \
      --out "$out/parity" 2>&1 | tee "$out/fp8_parity.log"
    python benchmarks/fp8_parity.py --table "$out/parity" | tee -a "$out/fp8_parity.log"
    rm -rf "$out/parity/data" "$out/docstrings.txt" ;;
  two_gpu_rows)
    for arm in "" "--nproc 2 --distopt" "--nproc 2 --distopt --global_batch 32" "--nproc 2 --tp 2 --sp" \
               "--nproc 2 --tp 2 --sp --full_graph"; do
      $T --sizes 774m --modes megatron_compile --steps 10 --warmup 3 $arm
    done 2>&1 | tee "$out/two_gpu_rows.log" ;;
  full_graph_tests)
    # the full-iteration graph's one-GPU cases, each with and without the graph
    python -m pytest -v -rs --durations 0 tests/gpu/test_full_graph_gpu.py -k "not 2gpu" 2>&1 \
      | tee "$out/full_graph_tests.log" ;;
  full_graph_tests_x2)
    F=tests/gpu/test_full_graph_gpu.py::test_full_iteration_graph_trains_as_the_eager_step
    # each capped: a failed capture can leave a pooled test worker hanging (2026-11-30)
    CUDA_VISIBLE_DEVICES=0 timeout 320 python -m pytest -v -rs --durations 0 --basetemp /tmp/pt0 "$F[gpt2_compiled]" \
      "$F[llama_compiled]" "$F[gpt2_fp8_tensorwise_compiled]" "$F[gpt2_compiled_dropout_reseeded]" \
      > "$out/full_graph_tests_gpu0.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout 320 python -m pytest -v -rs --durations 0 --basetemp /tmp/pt1 "$F[gpt2_eager]" \
      "$F[gpt2_compiled_dropout]" "$F[llama_fp8_delayed_compiled]" "$F[gpt2_fp8_delayed_eager]" "$F[gpt2_fp8_tensorwise_eager]" \
      > "$out/full_graph_tests_gpu1.log" 2>&1
    wait_jobs
    bash "$0" fp8_graph_rows ;;
  fp8_graph)
    F=tests/gpu/test_full_graph_gpu.py::test_full_iteration_graph_trains_as_the_eager_step
    second=$( [ "$(nvidia-smi -L | wc -l)" -gt 1 ] && echo 1 || echo 0 )
    CUDA_VISIBLE_DEVICES=0 python -m pytest -v -rs --durations 0 --basetemp /tmp/pt0 "$F[gpt2_fp8_tensorwise_compiled]" \
      "$F[gpt2_fp8_delayed_eager]" "$F[gpt2_fp8_tensorwise_eager]" > "$out/fp8_graph_tests_gpu0.log" 2>&1 &
    [ "$second" = 0 ] && wait_jobs
    CUDA_VISIBLE_DEVICES=$second python -m pytest -v -rs --durations 0 --basetemp /tmp/pt1 \
      "$F[llama_fp8_delayed_compiled]" > "$out/fp8_graph_tests_gpu1.log" 2>&1
    wait_jobs
    bash "$0" fp8_graph_rows "" ;;
  fp8_graph_rows)
    # bf16 is GPU-bound at this shape with or without the graph (64k tok/s, 2026-11-30): pass "" to time it too
    for fp8 in "--fp8 hybrid --fp8_recipe delayed" "--fp8 hybrid --fp8_recipe tensorwise" ${2+"$2"}; do
      $T --sizes llama-1b --seq 2048 --global_batch 8 --num_micro 4 --modes megatron_compile --steps 8 --warmup 3 \
        --full_graph $fp8
    done 2>&1 | tee "$out/fp8_graph_rows.log" ;;
  fp8_output)
    # check 3's FP8 row with the output layer (37 ms of the bf16 step over the 128k vocabulary) in FP8 too, then with
    # every layer as well, each with the graph (GPU-bound); its GPU tests first
    timeout 200 python -m pytest -v -rs --durations 0 tests/gpu/test_fp8_gpu.py -k output_layer 2>&1 \
      | tee "$out/fp8_output.log"
    for extra in "--fp8_output_layer" "--fp8_output_layer --fp8_all_layers"; do
      $T --sizes llama-1b --seq 2048 --global_batch 8 --num_micro 4 --modes megatron_compile --steps 8 --warmup 3 \
        --full_graph --fp8 hybrid --fp8_recipe tensorwise $extra
    done 2>&1 | tee -a "$out/fp8_output.log" ;;
  dropout_tests)
    timeout 300 python -m pytest -v -rs --durations 0 -m "not two_gpus" tests/gpu/test_dropout_compiled_gpu.py \
      "tests/gpu/test_full_graph_gpu.py::test_full_iteration_graph_trains_as_the_eager_step[gpt2_compiled_dropout]" \
      2>&1 | tee "$out/dropout_tests.log"
    if [ "$(nvidia-smi -L | wc -l)" -gt 1 ]; then
      timeout 280 python -m pytest -v -rs --durations 0 -m two_gpus tests/gpu/test_dropout_compiled_gpu.py \
        "tests/gpu/test_full_graph_gpu.py::test_full_iteration_graph_trains_as_the_eager_step_2gpu[tp2_compiled_dropout]" \
        2>&1 | tee -a "$out/dropout_tests.log"
    fi ;;
  two_gpu_tp_graph)
    L="--sizes 774m --modes megatron_compile --steps 10 --warmup 3 --nproc 2 --tp 2 --full_graph"
    { timeout 180 torchrun --nproc-per-node 2 benchmarks/two_stream_probe.py
      $T $L
      $T $L --sp
      NCCL_MIN_NCHANNELS=32 $T $L --sp
      NCCL_PROTO=Simple $T $L --sp; } 2>&1 | tee "$out/two_gpu_tp_graph.log" ;;
  two_gpu_full_graph)
    # the full-iteration graph's two-GPU cases, then DP = 2 with it
    python -m pytest -v -rs --durations 0 tests/gpu/test_full_graph_gpu.py -k "2gpu" 2>&1 \
      | tee "$out/two_gpu_full_graph.log"
    $T --sizes 774m --modes megatron_compile --steps 10 --warmup 3 --nproc 2 --distopt --full_graph 2>&1 \
      | tee -a "$out/two_gpu_full_graph.log" ;;
  two_gpu_overlap)
    # one row in torchrun directly (not through the driver): a capped torchrun takes its workers down with it
    L="--one --size 774m --mode megatron_compile --steps 10 --warmup 3 --tp 2 --sp --full_graph"
    T="torchrun --nproc-per-node 2 benchmarks/train_throughput.py"
    timeout 360 torchrun --nproc-per-node 2 benchmarks/compiler_overlap_probe.py 2>&1 \
      | tee "$out/compiler_overlap_probe.log"
    timeout 170 $T $L 2>&1 | tee "$out/two_gpu_overlap_baseline.log" ;;
  two_gpu_domino)
    L="--one --size 774m --mode megatron_compile --steps 10 --warmup 3 --tp 2 --sp --full_graph"
    T="torchrun --nproc-per-node 2 benchmarks/train_throughput.py"
    # modes as arguments after the stage (what the probe favoured first), else three: DeepSpeed's way by hand, then
    # Inductor's with its reordering passes, then its default order; the rest (halves_sched, and visible, the
    # control: functional collectives on the whole batch) in a second call
    shift
    for mode in ${@:-hand halves_reorder halves}; do
      timeout 145 $T $L --domino $mode --cpp_wrapper off  # under the graph the wrapper costs no GPU time
    done 2>&1 | tee "$out/two_gpu_domino.log" ;;
  two_gpu_domino_profile)
    # check 5 asks the TP = 2 + SP row with a profile: the plain step's beside the Domino mode's (default: hand)
    P="benchmarks/profile_step.py --size 774m --mode megatron_compile --tp 2 --sp --full_graph --steps 3 --warmup 3 --gaps 25"
    { timeout 200 torchrun --nproc-per-node 2 $P
      timeout 200 torchrun --nproc-per-node 2 $P --domino "${2:-hand}" --cpp_wrapper off; } 2>&1 \
      | tee "$out/two_gpu_domino_profile.log" ;;
  two_gpu_graph_rest)
    F=tests/gpu/test_full_graph_gpu.py::test_full_iteration_graph_trains_as_the_eager_step_2gpu
    MP_TEST_TIMEOUT=180 timeout 390 python -m pytest -v -rs --durations 0 "$F" 2>&1 | tee "$out/two_gpu_graph_rest.log"
    timeout 150 torchrun --nproc-per-node 2 benchmarks/train_throughput.py --one --size 774m --mode megatron_compile \
      --steps 10 --warmup 3 --distopt --full_graph 2>&1 \
      | tee -a "$out/two_gpu_graph_rest.log" ;;
  two_gpu_ce)
    L="--one --size 774m --mode megatron_compile --steps 10 --warmup 3 --tp 2 --sp --sp_collectives ce"
    T="torchrun --nproc-per-node 2 benchmarks/train_throughput.py"
    G=$([ "${2:-}" = nograph ] && echo "" || echo "--full_graph")
    { timeout 120 torchrun --nproc-per-node 2 benchmarks/async_tp_probe.py
      timeout 170 $T $L $G
      timeout 170 $T $L $G --domino hand --cpp_wrapper off; } 2>&1 | tee "$out/two_gpu_ce.log" ;;
  two_gpu_ce_ab)
    L="--one --size 774m --mode megatron_compile --steps 10 --warmup 3 --tp 2 --sp --full_graph"
    T="torchrun --nproc-per-node 2 benchmarks/train_throughput.py"
    { timeout -k 10 150 $T $L
      timeout -k 10 120 $T $L --domino hand --sp_collectives ce --cpp_wrapper off; } 2>&1 | tee "$out/two_gpu_ce_ab.log" ;;
  two_gpu_generation)
    G="python benchmarks/generate_throughput.py --dtypes bf16 --batches 1,32 --repeat 2"
    { timeout -k 10 240 $G --nproc 2 --tp 2 --modes megatron,megatron_eager
      timeout -k 10 200 $G --nproc 2 --pp 2 --modes megatron_eager; } 2>&1 | tee "$out/two_gpu_generation.log" ;;
  two_gpu_big_model)
    df -h /tmp | tee "$out/two_gpu_big_model.log"
    timeout -k 10 540 python benchmarks/big_model_gpu.py --workdir /tmp/big 2>&1 | tee -a "$out/two_gpu_big_model.log" ;;
  full_graph_hf)
    # check 3 where the host counted (350M, 124M): the plugin with the full-iteration graph beside HF + compile
    for size in 350m 124m; do
      $T --sizes $size --modes megatron_compile,hf_compile --full_graph
    done 2>&1 | tee "$out/full_graph_hf.log" ;;
  two_gpu_dp)
    L="--sizes 774m --modes megatron_compile --steps 10 --warmup 3"
    { $T $L --global_batch 8
      NCCL_MAX_CTAS=16 $T $L --nproc 2 --distopt
      NCCL_MAX_CTAS=8 $T $L --nproc 2 --distopt; } 2>&1 | tee "$out/two_gpu_dp.log" ;;
  two_gpu_tp)
    L="--sizes 774m --modes megatron_compile --steps 10 --warmup 3 --nproc 2 --tp 2 --sp"
    { $T $L --cpp_wrapper off
      $T $L --tp_comm_overlap
      $T $L --compile_mode reduce-overhead
      CUDA_DEVICE_MAX_CONNECTIONS=1 $T $L; } 2>&1 | tee "$out/two_gpu_tp.log" ;;
  two_gpu_profiles)
    P="benchmarks/profile_step.py --size 774m --mode megatron_compile --steps 3 --warmup 3 --gaps 25"
    { torchrun --nproc-per-node 2 $P --tp 2 --sp --host_top 30
      torchrun --nproc-per-node 2 $P --distopt
      python $P; } 2>&1 | tee "$out/two_gpu_profiles.log" ;;
  two_gpu_graphs)
    P="benchmarks/profile_step.py --size 774m --mode megatron_compile --steps 3 --warmup 3 --gaps 25 --host_top 30 --tp 2 --sp"
    { torchrun --nproc-per-node 2 $P --compile_mode reduce-overhead
      torchrun --nproc-per-node 2 $P; } 2>&1 | tee "$out/two_gpu_graphs.log" ;;
  two_gpu_nccl)
    { nvidia-smi topo -m; nvidia-smi nvlink -s | head -40; env | grep -E "^(NCCL|TORCH_SYMM|NVSHMEM)" ; } \
      > "$out/two_gpu_nccl.log" 2>&1
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,TUNING torchrun --nproc-per-node 2 benchmarks/nccl_bandwidth.py \
      >> "$out/two_gpu_nccl.log" 2>&1
    torchrun --nproc-per-node 2 benchmarks/async_tp_probe.py 2>&1 | tee "$out/async_tp_probe.log" ;;
  two_gpu_nccl_env)
    for env in "" NCCL_MIN_NCHANNELS=32 NCCL_PROTO=Simple NCCL_PROTO=LL128 NCCL_NTHREADS=512 \
               NCCL_BUFFSIZE=16777216 "NCCL_MIN_NCHANNELS=32 NCCL_PROTO=Simple" NCCL_P2P_USE_CUDA_MEMCPY=1 \
               NCCL_MAX_NCHANNELS=8; do
      echo "== ${env:-default}"
      env $env torchrun --nproc-per-node 2 benchmarks/nccl_bandwidth.py 2>&1 | grep -E "MiB|rror"
    done 2>&1 | tee "$out/two_gpu_nccl_env.log"
    torchrun --nproc-per-node 2 benchmarks/async_tp_probe.py 2>&1 | tee "$out/async_tp_probe.log" ;;
  two_gpu_tests)
    shift
    python -m pytest -v -m two_gpus -rs --durations 0 "${@:-tests/gpu}" 2>&1 | tee "$out/two_gpu_tests.log" ;;
  steady|steady_gc|steady_pin|steady_graphs)
    extra="" ; pin=""
    [ "$stage" = steady_gc ] && extra="--manual_gc 0"
    [ "$stage" = steady_graphs ] && extra="--compile_mode reduce-overhead"
    bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-F' 'a-f' | sed 's/^0000//')
    local_cpus=$(cat "/sys/bus/pci/devices/$bus/local_cpulist" 2>/dev/null)
    { echo "GPU $bus, NUMA-local CPUs: ${local_cpus:-unknown}, this shell's: $(taskset -pc $$ 2>/dev/null)"
      lscpu | grep -E "^(Model name|CPU\(s\)|NUMA|Thread|CPU max MHz)"; nvidia-smi topo -m; } > "$out/${stage}_host.txt" 2>&1
    if [ "$stage" = steady_pin ]; then
      # the GPU's NUMA-local CPUs; where that is every CPU (one NUMA node) or unknown, half of them: a fixed set
      # either way, which is what is tested (a process that does not migrate, nor share its cores by chance)
      cpus=$(nproc --all)
      [ -z "$local_cpus" ] || [ "$local_cpus" = "0-$((cpus - 1))" ] && local_cpus="0-$((cpus / 2 - 1))"
      pin="taskset -c $local_cpus"
      echo "pinned to CPUs $local_cpus" | tee -a "$out/${stage}_host.txt"
    fi
    # no separate run to fill the compile cache: compiling happens in the warm-up steps, outside the timed window
    # (a recompile inside it would show in step_events), and five runs of ~80 s then fit one call. 200 timed steps
    # (~7 s): with 30 (~1 s) one host stall of six steps moved a run by 6% (steady_pin, 2026-11-29), and the GPU
    # reached its power cap (~700 W, clocks 1980 -> ~1750 MHz) only in the window's last third
    for i in 1 2 3 4 5; do
      echo "run $i starts $(date +%T), load $(cut -d' ' -f1-3 /proc/loadavg)"
      $pin $T --sizes 124m --modes megatron_compile --steps 200 --warmup 10 $extra
    done 2>&1 | tee "$out/$stage.log"
    grep '^{' "$out/$stage.log" | python -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin]
tok = [r["tok_s"] for r in rows]
print(rows[0]["mode"] + f": {tok} spread {(max(tok) - min(tok)) / max(tok):.1%}")
for r in rows:
    steps = sorted(r["step_ms"])
    waits = sorted(r.get("sync_wait_ms") or [0])
    print("  " + format(r["tok_s"], ">8,"), "tok/s, median step", steps[len(steps) // 2], "ms, median sync wait",
          waits[len(waits) // 2], "ms, host", r.get("host"), "events", r["step_events"])
' | tee "$out/${stage}_summary.txt" ;;
  *)
    echo "unknown stage $stage" >&2; exit 2 ;;
esac
