#!/usr/bin/env bash
# The torch runtime's GPU check (see scripts/gpu_check.py): parity, speed beside
# transformers and the weight-read limit, NIXL READ of device memory. Under 8 minutes on
# one H200. Needs PyTorch with CUDA and this package importable (run from the repository
# root); transformers and nixl are used when importable. A second run can carry the nixl
# wheel: put it under .whl/ and pass WHEELS=.whl to install it into /tmp/site first.
#   scripts/gpu_check.sh [OUTPUT.md] [extra gpu_check.py args, e.g. --sections nixl]
set -euo pipefail
cd "$(dirname "$0")/.."
output="${1:-${OUT:-.}/gpu_check.md}"
shift || true
if [[ -n "${WHEELS:-}" ]]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
exec timeout 480 python3 scripts/gpu_check.py --device cuda --output "$output" "$@"
