#!/usr/bin/env bash
# One call on the lent GPU machine (see README "GPU machine"): environment facts, the tests that
# run there (GPU parity, kt-kernel parity, kernels, rules, checkpoints; llamafactory is absent
# there), then the CPU expert op benchmark. Everything lands in $OUT.
#   carry: .ktk (kt_kernel/ with its amx .so + kt_kernel.libs/, unpacked from the cp312 wheel), .whl (gguf)
set -uo pipefail
OUT=${OUT:-/tmp/kt-ft-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/.ktk" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (gguf, which kt_kernel imports)
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
} 2>&1 | tee "$OUT/env.txt"
PARTS=${PARTS:-tests,op,step}  # also: overlap, placement, probe, qprobe
# env: SEQ, THREADS; placement: CAPS, PLACEMENTS, PLACEMENT_LAYERS, PLACEMENT_SYSTEMS (peft-gpu; kt-ft: without it),
# PROFILE_DIR; step: STEP_LAYERS, SYSTEMS, BACKENDS, STEP_PRESETS; KT_FT_BENCH_REPLAN=0 / KT_FT_BENCH_TRACE=1
# pass through to the bench workers (kt_ft/bench_step.py)
# TESTS: other test files / node ids, TEST_K: a pytest -k expression (e.g. TEST_K=cuda)
TESTS=${TESTS:-tests/test_kernels.py tests/test_parity.py tests/test_gpu.py tests/test_kt_kernel.py tests/test_rules.py tests/test_checkpoint.py tests/test_families.py tests/test_gpt_oss.py tests/test_resident.py tests/test_beside.py tests/test_streamed.py tests/test_placement.py tests/test_grouped_device.py tests/test_loading.py tests/test_load_memory.py}
# shellcheck disable=SC2086
[[ $PARTS == *tests* ]] && timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rs \
  ${TEST_K:+-k "$TEST_K"} $TESTS 2>&1 | tee "$OUT/pytest.log"
# issue 8: tokens/s against the GPU memory cap for all-CPU, all-streamed, auto and all-GPU, predicted beside measured
[[ ${PROFILE:-1} == 1 ]] && export KT_FT_BENCH_PROFILE=${PROFILE_DIR:-$OUT/prof}  # PROFILE=0: no profiled step
[[ $PARTS == *placement* ]] && timeout "${PLACEMENT_TIMEOUT:-580}" python3 -m kt_ft.cli bench --preset "${PRESET:-qwen3-30b-a3b}" \
  --parts placement --layers "${PLACEMENT_LAYERS:-4}" --seq "${SEQ:-2048}" --threads "$THREADS" --caps "${CAPS:-24,38,80}" \
  --placements "${PLACEMENTS:-cpu,auto,stream}" --systems "${PLACEMENT_SYSTEMS:-peft-gpu}" \
  --json "$OUT/placement.json" --plot "$OUT/placement.png" 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|run/s\]$" | tee "$OUT/placement.log"
[[ $PARTS == *op* ]] && timeout "${BENCH_TIMEOUT:-420}" python3 -m kt_ft.cli bench --preset "${PRESET:-qwen3-30b-a3b}" --parts op \
  --tokens "${TOKENS:-512,2048,4096}" --threads "$THREADS" --repeat 2 --json "$OUT/bench.json" 2>&1 \
  | tr '\r' '\n' | grep -v "it/s\]$\|case/s\]$" | tee "$OUT/bench.log"
for preset in ${STEP_PRESETS:-qwen3-30b-a3b}; do
  [[ $PARTS == *step* ]] && timeout "${STEP_TIMEOUT:-420}" python3 -m kt_ft.cli bench --preset "$preset" --parts step \
    --layers "${STEP_LAYERS:-2,4}" --seq "${SEQ:-2048}" --threads "$THREADS" --json "$OUT/step-$preset.json" \
    --systems "${SYSTEMS:-kt-ft,kt-ft-stream,kt-ft-auto,peft-gpu,offload}" ${BACKENDS:+--backends "$BACKENDS"} 2>&1 \
    | tr '\r' '\n' | grep -v "it/s\]$\|system/s\]$" | tee "$OUT/step-$preset.log"
done
# issue 7: per-expert GEMM loop vs batched / prepacked formulations of the op's big products
[[ ",$PARTS," == *,probe,* ]] && timeout "${PROBE_TIMEOUT:-240}" python3 scripts/bmm_probe.py --tokens "${PROBE_TOKENS:-2048,4096}" \
  --threads "$THREADS" 2>&1 | tee "$OUT/bmm_probe.log"
[[ ",$PARTS," == *,qprobe,* ]] && timeout "${PROBE_TIMEOUT:-240}" python3 scripts/q_probe.py --threads "$THREADS" 2>&1 \
  | tee "$OUT/q_probe.log"
# shared experts beside the CPU op (kt_ft/moe/beside.py): the same kt-ft step with the overlap off / on
for ov in 0 1; do
  [[ $PARTS == *overlap* ]] && KT_FT_OVERLAP_SHARED=$ov timeout "${STEP_TIMEOUT:-420}" python3 -m kt_ft.cli bench \
    --preset "${OVERLAP_PRESET:-deepseek-v2-lite}" --parts step --systems kt-ft --layers "${OVERLAP_LAYERS:-3}" \
    --seq "${SEQ:-2048}" --threads "$THREADS" --json "$OUT/overlap-$ov.json" 2>&1 \
    | tr '\r' '\n' | grep -v "it/s\]$\|system/s\]$" | tee "$OUT/overlap-$ov.log"
done
# profiles (KT_FT_BENCH_PROFILE; KT_FT_BENCH_TRACE=1 adds timelines) as one file: $OUT returns at most 8
if [[ -d $OUT/prof ]]; then tar -czf "$OUT/prof.tgz" -C "$OUT" prof && rm -rf "$OUT/prof"; fi
exit 0
