#!/usr/bin/env bash
# One device call (issue 40): the models, the LLM decode (SmolLM-135M and Llama-3.2-1B shapes), compute-sanitizer over the
# small models and over the conformance and tiled kernels. Logs to /tmp/o as they go; $OUT gets main.log live and
# a tarball of /tmp/o at the end.
set -u
R=$(pwd)
mkdir -p /tmp/o
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
{ nvcc --version | tail -2; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"; nproc; } > /tmp/o/env.log 2>&1
pack() { tar czf "$OUT/logs.tgz" -C /tmp/o --exclude='*.onnx' --exclude='*.gguf' --exclude='*.npy' --exclude='*.npz' . 2>/dev/null; }
t0=$(date +%s)
OUT=/tmp/o/a timeout -k 5 340 scripts/gpu-models --out /tmp/o/a --skip matmul --models-args "--torch-compile --dynamic --budget 140" \
  --llm-args "--types Q8_0,F16" --llm-limit 75
echo "== gpu-models done at $(( $(date +%s) - t0 )) s"; pack
OUT=/tmp/o/b timeout -k 5 145 scripts/gpu-models --out /tmp/o/b --skip "nvidia-smi models sanitizer matmul" \
  --llm-args "--shape llama1b --types Q8_0 --torch-compile --compile-reserve 40" --llm-limit 140
echo "== llama1b done at $(( $(date +%s) - t0 )) s"; pack
export PYTHONPATH="$(ls -d "$R"/packages/*/src | tr '\n' ':')$PYTHONPATH"
KILN_GPU_CHECK_SMALL=1 timeout -k 5 75 compute-sanitizer --tool memcheck --error-exitcode 3 python3 packages/runtime-cuda/tools/gpu_check.py info conformance tiled \
  > /tmp/o/memcheck.full 2>&1; echo "memcheck rc $?" | tee -a /tmp/o/memcheck.full
grep -E "^FAIL|ERROR SUMMARY|^device|failed" /tmp/o/memcheck.full | tail -8
echo "== all done at $(( $(date +%s) - t0 )) s"; pack
