#!/usr/bin/env bash
# One idempotent set-up for a fresh machine: the torch venv (libtorch for the tch crates and the
# Python packages the parity tests use). Fast when everything is already present.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
torch_version="2.11.0"
py="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$py" -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torch,sys; sys.exit(0 if torch.__version__.split('+')[0]=='$torch_version' else 1)" 2>/dev/null; then
  echo "[setup] installing torch==$torch_version into $venv (one time, ~1 min)"
  "$venv/bin/pip" install -q --no-cache-dir --disable-pip-version-check "torch==$torch_version"
fi
# The CUDA runtime headers in torch's wheels lack crt/ (shipped separately); the torch-ext shim
# needs them to compile its CUDA-graph entry points.
crt_version="13.0.*"
if ! "$venv/bin/python" -c "import os,sys,torch; d=os.path.dirname(os.path.dirname(torch.__file__)); sys.exit(0 if os.path.exists(os.path.join(d,'nvidia','cu13','include','crt','host_config.h')) else 1)" 2>/dev/null; then
  echo "[setup] installing nvidia-cuda-crt==$crt_version (CUDA headers for the torch-ext shim)"
  "$venv/bin/pip" install -q --no-cache-dir --disable-pip-version-check "nvidia-cuda-crt==$crt_version"
fi
req="$root/scripts/requirements-test.txt"
stamp="$venv/.verl-requirements.sha256"
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing test requirements ($req)"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$req"
  echo "$want" > "$stamp"
fi
