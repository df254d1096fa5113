#!/usr/bin/env bash
# The GPU measurements, in one run of at most 10 minutes (sized for one NVIDIA H200), no network:
#
#   1. python -m benchmarks --sections generate   (the whole model's generate against transformers)
#   2. the speed section in bfloat16 against torch SDPA (implementation=None runs cuDNN there)
#   3. the speed section in float32 (None runs xla; cudnn refuses float32: a skipped row says so)
#   4. the train section (GPT-2's training step against transformers + torch.optim.AdamW)
#
# Usage, from the repository root, with JAX's CUDA build and torch's CUDA build installed:
#
#   benchmarks/gpu.sh [OUT_DIR]        # default: $OUT, else ./gpu-results
#
# Each step writes OUT_DIR/<step>.json (machine, config and rows, as --json does) and
# OUT_DIR/<step>.txt (the printed tables). Each runs under its own time limit, so one that
# hangs or compiles for too long leaves the others their time; the limits add up to 9.5
# minutes. The script stops before any step where JAX sees no GPU (the CPU runs take hours).
set -uo pipefail

out="${1:-${OUT:-gpu-results}}"
mkdir -p "$out"
python="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # random weights only: nothing to download
# JAX takes half the GPU's memory up front (its default: 75%), torch runs in the rest.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}"

{ nvidia-smi -L || echo "nvidia-smi: not found"; } | tee "$out/gpu.txt"
"$python" - <<'EOF' | tee -a "$out/gpu.txt" || exit 1
import jax, torch
print("jax", jax.__version__, jax.default_backend(), jax.devices())
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
if jax.default_backend() != "gpu" or not torch.cuda.is_available():
    raise SystemExit("gpu.sh: JAX's default backend and torch must both see the GPU")
EOF

status=0
# step NAME LIMIT_S PRECISION ARGS...: one python -m benchmarks run, its tables and JSON, under
# JAX_DEFAULT_MATMUL_PRECISION=PRECISION. float32 runs at "highest": torch keeps TF32 off, and
# the parity check before timing (1e-4) asks for full float32 (the H100 run of
# docs/performance.md ran so). bfloat16 keeps the default: it rounds more than any precision.
step() {
    local name="$1" limit="$2" precision="$3"
    shift 3
    echo "== $name (at most ${limit} s, matmul precision $precision): python -m benchmarks $*"
    JAX_DEFAULT_MATMUL_PRECISION="$precision" timeout "$limit" \
        "$python" -m benchmarks --no-progress --json "$out/$name.json" "$@" | tee "$out/$name.txt"
    local rc="${PIPESTATUS[0]}"
    [ "$rc" -eq 0 ] || { echo "== $name: exit $rc (124: over its limit)"; status=1; }
}

step generate 240 highest --sections generate
# GPT-2 small's layer at the shapes docs/performance.md reports from t1024, 5 timed calls each
step speed-bfloat16 120 default --sections speed --dtype bfloat16 --shapes b8t1024,b1t4096 \
    --repeats 5
step speed-float32 120 highest --sections speed --dtype float32 --shapes b8t1024,b1t4096 \
    --repeats 5
step train 90 highest --sections train --repeats 5
exit "$status"
