#!/usr/bin/env bash
# Install NVIDIA genai-perf (and the perf_analyzer binary it drives) into its own venv,
# outside the repo: genai-perf pins its dependencies, so it must not share .venv.
#
#   scripts/install-genai-perf.sh [VENV]        # default /tmp/genai-perf-venv
#
# Idempotent: a venv whose genai-perf and perf_analyzer already run is left as it is.
# perf_analyzer (tritonclient 2.51 wheel) runs without a GPU but needs Debian's libb64-0d
# (installed with apt-get when running as root and missing) and libcudart from the
# nvidia-cuda-runtime-cu12 wheel. Afterwards:
#   export PATH="$VENV/bin:$PATH" LD_LIBRARY_PATH="$("$VENV/bin/python" -c 'import nvidia.cuda_runtime as m, os; print(os.path.join(m.__path__[0], "lib"))')"
# (`triton-disagg bench soak` finds this venv by itself.)
set -euo pipefail

VENV="${1:-/tmp/genai-perf-venv}"
PYTHON="${PYTHON:-python3}"
GENAI_PERF_VERSION="0.0.16"
TRITONCLIENT_VERSION="2.51.0"

cudart_dir() {
    "$VENV/bin/python" -c 'import nvidia.cuda_runtime as m, os; print(os.path.join(m.__path__[0], "lib"))'
}

works() {
    [ -x "$VENV/bin/genai-perf" ] && [ -x "$VENV/bin/perf_analyzer" ] || return 1
    "$VENV/bin/genai-perf" --version >/dev/null 2>&1 || return 1
    LD_LIBRARY_PATH="$(cudart_dir 2>/dev/null)" "$VENV/bin/perf_analyzer" --version >/dev/null 2>&1
}

if ! ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d'; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "==> installing libb64-0d (perf_analyzer needs libb64.so.0d)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libb64-0d
    else
        echo "install-genai-perf: libb64.so.0d is missing; as root run: apt-get update && apt-get install -y libb64-0d" >&2
        exit 1
    fi
fi

if works; then
    echo "genai-perf already installed in $VENV"
    exit 0
fi

echo "==> creating $VENV and installing genai-perf $GENAI_PERF_VERSION (a few minutes)"
[ -x "$VENV/bin/pip" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --progress-bar off -q --upgrade pip
"$VENV/bin/pip" install --progress-bar off -q "genai-perf==$GENAI_PERF_VERSION" \
    "tritonclient[all]==$TRITONCLIENT_VERSION" nvidia-cuda-runtime-cu12

if ! works; then
    echo "install-genai-perf: installed, but genai-perf or perf_analyzer does not run from $VENV" >&2
    exit 1
fi
echo "genai-perf installed in $VENV"
