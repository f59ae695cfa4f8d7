#!/usr/bin/env bash
# One lease of a GPU, in one call (a lease has 15 minutes of device time):
#   1. the fp8 test modules on the GPU's own fp8 kernels (a CPU cannot show how a
#      GPU converts to fp8 or which dots XLA gives fp8 GEMMs; delayed scaling's
#      `scales_in_gemm` products run only there);
#   2. `gpu_fp8_fallback.py`: the cases that once failed there, under three XLA
#      flag sets, with their optimised HLO;
#   3. fp8 training steps timed beside hand-cast bfloat16 at the GPT-2-small-like
#      roofline size (RESULTS.md, "GPU results"; set GPT_VARIANTS for others);
#   4. fp8 timed beside hand-cast bfloat16 where the roofline says it pays: one
#      Llama-3-8B-sized block at seq 4096 with cuDNN's flash attention (0.78x by
#      the roofline with launches; delayed scaling 0.73x, with `scales_in_gemm`
#      0.72x);
#   5. the step time telemetry adds there (its one-pass form, which a CPU does not
#      run).
# Each part has its own time limit, so a slow one leaves the others' output;
# everything is written under $OUT (or ./gpu-out). Run from the repository root:
#
#     bash benchmarks/gpu_check.sh            # about 10 minutes
set -uo pipefail
out="${OUT:-gpu-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
py="${PYTHON:-python3}"

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
    --format=csv | tee "$out/machine.txt"
"$py" -c "import jax, jaxlib, equinox, optax; print('jax', jax.__version__, \
'jaxlib', jaxlib.__version__, 'equinox', equinox.__version__, 'optax', \
optax.__version__, jax.devices())" | tee -a "$out/machine.txt"

timeout "${TESTS_S:-120}" "$py" -m pytest -q -rfE -p no:cacheprovider -n 4 \
    tests/test_fp8.py tests/test_fp8_hostile.py tests/test_fp8_delayed.py 2>&1 \
    | tail -40 | tee "$out/tests.log"

timeout "${FALLBACK_S:-130}" "$py" benchmarks/gpu_fp8_fallback.py --hlo /tmp/fp8-hlo \
    2>&1 | grep -v "^W0000\|^I0000" | tee "$out/fallback.log"
tar -czf "$out/fallback-hlo.tar.gz" -C /tmp fp8-hlo

# Three variants take about 110 s (the first fp8 one pays XLA's fp8 autotuning).
timeout "${GPT_S:-150}" "$py" benchmarks/run.py --preset gpu --models gpt \
    --config depth=4,batch=8 --steps 12 \
    --variants "${GPT_VARIANTS:-hand_bf16,filter_amp_fp8,filter_amp_fp8_paying}" \
    --json "$out/gpt.json" --markdown "$out/gpt.md" 2>&1 | tee "$out/gpt.log"

timeout "${LLAMA_S:-200}" "$py" benchmarks/run.py --preset gpu --models llama \
    --config depth=1,attention=cudnn --steps 12 \
    --variants "${LLAMA_VARIANTS:-hand_bf16,filter_amp_fp8,filter_amp_fp8_delayed_weights,filter_amp_fp8_delayed_gemm}" \
    --json "$out/llama.json" --markdown "$out/llama.md" 2>&1 | tee "$out/llama.log"

timeout "${TELEMETRY_S:-120}" "$py" benchmarks/telemetry_overhead.py --preset gpu \
    --models gpt --config depth=4,batch=8 --steps 10 --repeats 3 2>&1 \
    | tee "$out/telemetry.log"

