#!/usr/bin/env bash
# defines: `make interop` — fourbit against Hugging Face transformers (tests/interop/interop_test.py).
# Uses the python3 on PATH when it already imports torch and transformers (the GPU machine, no
# network needed); otherwise installs CPU torch + transformers into a venv under the build
# directory (PyTorch's CPU wheel index when reachable, else PyPI). Not part of `make test`.
# The log goes to bench/results/interop-<host>.log.
set -euo pipefail
build=${1:-build}
py=${PYTHON:-python3}
need='import torch, transformers, numpy, safetensors'
if ! "$py" -c "$need" 2>/dev/null; then
  venv="$build/interop-venv"
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "$need" 2>/dev/null; then
    echo "interop: installing torch (CPU) and transformers into $venv"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q torch --index-url https://download.pytorch.org/whl/cpu 2>/dev/null \
      || "$venv/bin/pip" install -q torch
    "$venv/bin/pip" install -q transformers safetensors numpy
  fi
  py="$venv/bin/python"
fi
exec "$py" tests/interop/interop_test.py --fourbit "$build/fourbit" --work "$build/interop" \
  --log "bench/results/interop-$(hostname -s).log"
