#!/usr/bin/env bash
# Installs exactly what fourbit's build, tests, demo and benchmarks need on Debian/Ubuntu.
# Idempotent: packages already present are skipped, so a second run is quick.
set -euo pipefail

debs=(
  build-essential cmake ninja-build pkg-config git
  libgtest-dev libgmock-dev libbenchmark-dev   # tests, micro-benchmarks
  libcli11-dev libtomlplusplus-dev nlohmann-json3-dev libfmt-dev   # CLI, configs, JSON, formatting
  libopenblas-dev libomp-dev                   # sgemm baseline in bench/, OpenMP
  gnuplot-nox                                  # `fourbit plot`
  python3 python3-pip
)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Python test oracles: ml_dtypes is the independent reference for the scalar codecs; safetensors
# reads fourbit's exports in tests/hf/modelopt_export_test.py.
py=${PYTHON:-python3}
if ! "$py" -c 'import ml_dtypes, numpy, safetensors' 2>/dev/null; then
  echo "install-deps: pip install ml_dtypes numpy safetensors"
  "$py" -m pip install -q ml_dtypes numpy safetensors 2>/dev/null \
    || "$py" -m pip install -q --break-system-packages ml_dtypes numpy safetensors
fi
echo "install-deps: ok"
