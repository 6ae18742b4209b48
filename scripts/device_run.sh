#!/usr/bin/env bash
# One call on the lent GPU machine (docs/benchmarks.md): environment facts, the tests that
# run there (GPU parity, kt-kernel parity, kernels, rules, checkpoints; llamafactory is absent
# there), then the CPU expert op benchmark. Everything lands in $OUT.
#   carry: .ktk (kt_kernel/ with its amx .so + kt_kernel.libs/, unpacked from the cp312 wheel), .whl (gguf)
set -uo pipefail
OUT=${OUT:-/tmp/kt-ft-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/.ktk" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PARTS=${PARTS:-tests,op,step}  # also: e2e, gemm, gen, gpuprobe, hostprobe, nxprobe, placement, probe, qprobe, scaling
if [[ ",$PARTS," == *,e2e,* || ",$PARTS," == *,gen,* ]]; then
  # the product path: LLaMA-Factory 0.9.5's stack and a kt-ft wheel (its .pth start-up hook) installed
  # for real into the machine's python (carry .whl: `pip download` list in docs/benchmarks.md)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
  export DISABLE_VERSION_CHECK=1
  # the peer (system kt-peer): transformers-kt + accelerate-kt (carry .peer: their wheels without the
  # serving payload) installed apart, and kt-kernel's metadata (LF checks its version; the package is .ktk)
  if ls .peer/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peer .peer/*.whl || exit 1
    mkdir -p /tmp/peer/kt_kernel-0.7.2.dist-info
    printf 'Metadata-Version: 2.1\nName: kt-kernel\nVersion: 0.7.2\n' >/tmp/peer/kt_kernel-0.7.2.dist-info/METADATA
    PEER_SITE=/tmp/peer
  fi
elif ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (gguf, which kt_kernel imports)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
THREADS=${THREADS:-$(nproc)}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\)|Core\(s\)|Socket"
  grep -o -w "amx_bf16\|avx512_bf16\|avx512f" /proc/cpuinfo | sort | uniq -c
  python3 -c "import torch, transformers, peft, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"
  python3 -c "import kt_kernel; print('kt_kernel variant', kt_kernel.__cpu_variant__)"
  df -h /tmp | tail -1
} 2>&1 | tee "$OUT/env.txt"
# env: SEQ, THREADS; placement: CAPS, PLACEMENTS, PLACEMENT_LAYERS, PLACEMENT_SYSTEMS (peft-gpu; kt-ft: without it),
# PROFILE_DIR; step: STEP_LAYERS, SYSTEMS, BACKENDS, STEP_PRESETS; REPLAN=0 / TRACE=1: kt-ft bench's
# --no-replan / --trace for the step and placement parts (their workers: kt_ft/integrations/bench/step.py)
# TESTS: other test files / node ids, TEST_K: a pytest -k expression (e.g. TEST_K=cuda)
TESTS=${TESTS:-tests/test_kernels.py tests/test_parity.py tests/test_gpu.py tests/test_kt_kernel.py tests/test_rules.py tests/test_checkpoint.py tests/test_families.py tests/test_gpt_oss.py tests/test_resident.py tests/test_beside.py tests/test_streamed.py tests/test_placement.py tests/test_placement_runtime.py tests/test_grouped_device.py tests/test_graphed.py tests/test_loading.py tests/test_load_memory.py}
# shellcheck disable=SC2086
[[ $PARTS == *tests* ]] && timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rs \
  ${TEST_K:+-k "$TEST_K"} $TESTS 2>&1 | tee "$OUT/pytest.log"
# issue 8: tokens/s against the GPU memory cap for all-CPU, all-streamed, auto and all-GPU, predicted beside measured
BENCH_FLAGS=()  # the step and placement parts' diagnostics
[[ ${PROFILE:-1} == 1 ]] && BENCH_FLAGS+=(--profile "${PROFILE_DIR:-$OUT/prof}")  # PROFILE=0: no profiled step
[[ ${TRACE:-0} == 1 ]] && BENCH_FLAGS+=(--trace)
[[ ${REPLAN:-1} == 0 ]] && BENCH_FLAGS+=(--no-replan)
[[ $PARTS == *placement* ]] && timeout "${PLACEMENT_TIMEOUT:-580}" python3 -m kt_ft bench --preset "${PRESET:-qwen3-30b-a3b}" \
  --parts placement --layers "${PLACEMENT_LAYERS:-4}" --seq "${SEQ:-2048}" --threads "$THREADS" --caps "${CAPS:-24,38,80}" \
  --placements "${PLACEMENTS:-cpu,auto,stream}" --systems "${PLACEMENT_SYSTEMS:-peft-gpu}" \
  --json "$OUT/placement.json" --plot "$OUT/placement.png" ${BENCH_FLAGS[@]+"${BENCH_FLAGS[@]}"} 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|run/s\]$" | tee "$OUT/placement.log"
# op: OP_PRESETS (default PRESET), FORMATS (bf16, fp8, int8, int4, mxfp4), BACKENDS (default: all that run)
for preset in ${OP_PRESETS:-${PRESET:-qwen3-30b-a3b}}; do
  [[ $PARTS == *op* ]] && timeout "${BENCH_TIMEOUT:-420}" python3 -m kt_ft bench --preset "$preset" --parts op \
    --tokens "${TOKENS:-512,2048,4096}" --threads "$THREADS" --repeat 2 --formats "${FORMATS:-bf16}" \
    ${BACKENDS:+--backends "$BACKENDS"} --json "$OUT/bench-$preset.json" 2>&1 \
    | tr '\r' '\n' | grep -v "it/s\]$\|case/s\]$" | tee "$OUT/bench-$preset.log"
done
for preset in ${STEP_PRESETS:-qwen3-30b-a3b}; do
  [[ $PARTS == *step* ]] && timeout "${STEP_TIMEOUT:-420}" python3 -m kt_ft bench --preset "$preset" --parts step \
    --layers "${STEP_LAYERS:-2,4}" --seq "${SEQ:-2048}" --threads "$THREADS" --json "$OUT/step-$preset.json" \
    --systems "${SYSTEMS:-kt-ft,kt-ft-stream,kt-ft-auto,peft-gpu,offload}" ${BACKENDS:+--backends "$BACKENDS"} \
    ${BENCH_FLAGS[@]+"${BENCH_FLAGS[@]}"} 2>&1 \
    | tr '\r' '\n' | grep -v "it/s\]$\|system/s\]$" | tee "$OUT/step-$preset.log"
done
# the product path: `llamafactory-cli train` once per system on a random model of a real config
# (E2E_PRESETS, E2E_LAYERS: a count, empty = full depth; E2E_SYSTEMS, where `+fp8` etc. runs a system on
# the model's `kt-ft quantize` copy; E2E_STEPS; E2E_ROUNDS: passes over the systems, alternating order;
# E2E_LENGTHS=varied: examples of varied lengths; E2E_PROFILE=1: one step of each run under torch.profiler,
# tables under $OUT/e2e-prof.tgz, with TRACE=1 its gzipped Chrome trace too)
[[ ${E2E_PROFILE:-0} == 1 ]] && export KT_FT_PROFILE=/tmp/e2e-prof$([[ ${TRACE:-0} == 1 ]] && echo ,trace)
for preset in ${E2E_PRESETS:-deepseek-v2-lite}; do
  [[ ",$PARTS," == *,e2e,* ]] || break
  timeout "${E2E_TIMEOUT:-570}" python3 -m kt_ft bench --parts e2e --preset "$preset" ${E2E_LAYERS:+--layers "$E2E_LAYERS"} \
    --threads "$THREADS" --e2e-steps "${E2E_STEPS:-5}" --workdir "/tmp/e2e-$preset" --json "$OUT/e2e-$preset.json" \
    ${E2E_SYSTEMS:+--e2e-systems "$E2E_SYSTEMS"} ${PEER_SITE:+--peer-site "$PEER_SITE"} \
    ${E2E_LENGTHS:+--e2e-lengths "$E2E_LENGTHS"} ${E2E_ROUNDS:+--e2e-rounds "$E2E_ROUNDS"} 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$" | tee "$OUT/e2e-$preset.log"
  mkdir -p "$OUT/e2e-logs" && for f in /tmp/e2e-"$preset"/runs/*/train.log; do
    d=$(dirname "$f"); cp "$f" "$OUT/e2e-logs/$preset-$(basename "$d").log"
    [[ -f $d/host_memory.csv ]] && cp "$d/host_memory.csv" "$OUT/e2e-logs/$preset-$(basename "$d")-host.csv"; done
  tar -czf "$OUT/e2e-logs-$preset.tgz" -C "$OUT" e2e-logs && rm -rf "$OUT/e2e-logs"
  # the disk holds one full-size model (and its quantized copy) at a time; E2E_KEEP_MODEL=1 keeps it for a
  # second call of this script in the same command (e.g. the same systems under another setting)
  [[ ${E2E_KEEP_MODEL:-0} == 1 ]] || rm -rf "/tmp/e2e-$preset"/model*
done
[[ -d /tmp/e2e-prof ]] && tar -czf "$OUT/e2e-prof.tgz" -C /tmp e2e-prof
# generation through LF's do_predict (GEN_PRESET at GEN_LAYERS, empty = full depth; GEN_SYSTEM): the merged
# copy goes to /dev/shm when it has room (a full-size model and its merged copy do not fit the disk together)
if [[ ",$PARTS," == *,gen,* ]]; then
  df -h /tmp /dev/shm | tee "$OUT/gen-df.txt"
  shm=$(df --output=avail -B1G /dev/shm | tail -1)
  timeout "${GEN_TIMEOUT:-570}" python3 -m kt_ft bench --parts gen --preset "${GEN_PRESET:-deepseek-v2-lite}" \
    ${GEN_LAYERS:+--layers "$GEN_LAYERS"} --gen-system "${GEN_SYSTEM:-kt-auto}" --threads "$THREADS" \
    --workdir /tmp/gen-run --json "$OUT/gen.json" ${GEN_ARGS:-} \
    $( ((shm > 40)) && echo --gen-merged-dir /dev/shm/kt-gen-merged) 2>&1 | tr '\r' '\n' \
    | grep -v "it/s\]$\|s/it\]$" | tee "$OUT/gen.log"
  for f in /tmp/gen-run/gen/*/log.txt; do cp "$f" "$OUT/gen-$(basename "$(dirname "$f")").log"; done
  rm -rf /tmp/gen-run /dev/shm/kt-gen-merged
fi
# the probes (kt_ft/integrations/bench/probes/: what the bench does not measure), one PARTS name each
# issue 7: per-expert GEMM loop vs batched / prepacked formulations of the op's big products
[[ ",$PARTS," == *,probe,* ]] && timeout "${PROBE_TIMEOUT:-240}" python3 -m kt_ft.integrations.bench.probes.bmm_probe --tokens "${PROBE_TOKENS:-2048,4096}" \
  --threads "$THREADS" 2>&1 | tee "$OUT/bmm_probe.log"
# each native GEMM path against torch's bf16 / fp32 matmul at the op's per-expert shapes (probes/native_gemm_probe.py)
[[ ",$PARTS," == *,gemm,* ]] && timeout "${PROBE_TIMEOUT:-240}" python3 -m kt_ft.integrations.bench.probes.native_gemm_probe 5 "$THREADS" 2>&1 \
  | tee "$OUT/native_gemm_probe.log"
# the native grouped GEMMs at the op's own call against the thread count (probes/grouped_scaling_probe.py)
[[ ",$PARTS," == *,scaling,* ]] && timeout "${PROBE_TIMEOUT:-240}" python3 -m kt_ft.integrations.bench.probes.grouped_scaling_probe \
  "${SCALING_THREADS:-1,2,4,8,14,16}" 2>&1 | tee "$OUT/scaling_probe.log"
# one layer's expert work on the GPU, kt-ft's fused grouped experts against transformers' grouped_mm
# experts: GPU time and kernels (probes/expert_gpu_probe.py; GPU_PROBE_PRESETS, GPU_PROBE_TOKENS)
for preset in ${GPU_PROBE_PRESETS:-qwen3-30b-a3b deepseek-v2-lite}; do
  [[ ",$PARTS," == *,gpuprobe,* ]] && timeout "${PROBE_TIMEOUT:-240}" python3 -m kt_ft.integrations.bench.probes.expert_gpu_probe "$preset" \
    "${GPU_PROBE_TOKENS:-2048}" 2>&1 | tee "$OUT/gpu_probe-$preset.log"
done
# the same layer's host time a pass under reentrant checkpointing (probes/expert_host_probe.py): what a
# host-bound step runs at
for preset in ${HOST_PROBE_PRESETS:-qwen3-30b-a3b deepseek-v2-lite}; do
  [[ ",$PARTS," == *,hostprobe,* ]] && timeout "${PROBE_TIMEOUT:-240}" python3 -m kt_ft.integrations.bench.probes.expert_host_probe "$preset" \
    "${GPU_PROBE_TOKENS:-2048}" 2>&1 | tee "$OUT/host_probe-$preset.log"
done
# the non-expert work's host time a step: PEFT / transformers as shipped against kt-ft's fused LoRA linears
# and RMSNorm (probes/nonexpert_host_probe.py)
[[ ",$PARTS," == *,nxprobe,* ]] && timeout "${PROBE_TIMEOUT:-240}" python3 -m kt_ft.integrations.bench.probes.nonexpert_host_probe 2>&1 \
  | tee "$OUT/nonexpert_probe.log"
[[ ",$PARTS," == *,qprobe,* ]] && timeout "${PROBE_TIMEOUT:-240}" python3 -m kt_ft.integrations.bench.probes.q_probe --threads "$THREADS" 2>&1 \
  | tee "$OUT/q_probe.log"
# profiles (kt-ft bench --profile; TRACE=1 adds timelines) as one file: $OUT returns at most 8
if [[ -d $OUT/prof ]]; then tar -czf "$OUT/prof.tgz" -C "$OUT" prof && rm -rf "$OUT/prof"; fi
exit 0
