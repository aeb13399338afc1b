#!/usr/bin/env bash
# The torch runtime's GPU check (see scripts/gpu_check.py), the one script a session with a
# lent GPU runs: parity (float32 exact; bf16 over the decode steps, cuDNN allowed and off),
# the SDPA backend each pass ran, speed beside transformers and the weight-read limit, NIXL
# READ of device memory, device memory (placement, freeing, pool size, out of memory), the
# KV handoff through staging and through each KV strategy's connector. Under 8 minutes on one
# H200 (timeout 470 s). Needs PyTorch with CUDA and this package importable (run from the
# repository root); transformers and nixl are used when importable, their rows say
# "skipped" with the reason when not (the device tool's image has neither tritonserver nor
# NIXL; no section needs tritonserver). A run can carry the nixl wheel: put it under .whl/
# and pass WHEELS=.whl to install it into /tmp/site first.
#
# Each section's table is appended to OUTPUT.md as soon as it ends (a section that fails is
# its traceback in place; the others still run; exit status 1), so a kill at the time limit
# loses only the section running. The device tool brings back what is under $OUT:
#   scripts/gpu_check.sh [OUTPUT.md] [extra gpu_check.py args, e.g. --sections parity,memory]
set -euo pipefail
cd "$(dirname "$0")/.."
output="${1:-${OUT:-.}/gpu_check.md}"
shift || true
if [[ -n "${WHEELS:-}" ]]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' >&2
exec timeout 470 python3 scripts/gpu_check.py --device cuda --output "$output" "$@"
