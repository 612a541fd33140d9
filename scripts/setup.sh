#!/usr/bin/env bash
# One idempotent set-up for a fresh machine: the torch venv (libtorch for the tch crates and the
# Python packages the parity tests use). Fast when everything is already present.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
torch_version="2.11.0"
py="${PYTHON:-python3}"

# Free space under a path in GiB (the filesystem holding it, or its nearest existing parent).
free_gib() {
  local d="$1"
  while [ ! -e "$d" ]; do d="$(dirname "$d")"; done
  df -Pk "$d" | awk 'NR==2 { printf "%.1f", $4 / 1048576 }'
}
# Stops before a download that cannot fit: pip's own error comes only after minutes of download
# ("[Errno 28] No space left on device"), and a half-installed venv is left behind.
# VERL_SKIP_DISK_CHECK=1 skips it.
need_space() {
  local path="$1" gib="$2" what="$3" have
  [ "${VERL_SKIP_DISK_CHECK:-0}" = "1" ] && return 0
  have="$(free_gib "$path")"
  if awk -v h="$have" -v n="$gib" 'BEGIN { exit !(h < n) }'; then
    echo "[setup] error: $what needs about $gib GiB free at $path; the filesystem has $have GiB free" >&2
    echo "[setup] free some space (or set VERL_SKIP_DISK_CHECK=1 to try anyway)" >&2
    exit 1
  fi
}

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$py" -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torch,sys; sys.exit(0 if torch.__version__.split('+')[0]=='$torch_version' else 1)" 2>/dev/null; then
  # The wheels with their CUDA libraries take ~5.7 GiB installed, plus the largest wheel while it
  # unpacks; the build after it (target/) takes ~5 GiB more (4.7 GiB after a whole `make test`).
  need_space "$venv" 7 "installing torch==$torch_version"
  need_space "${TMPDIR:-/tmp}" 1.5 "unpacking torch's wheels (TMPDIR)"
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
  "$venv/bin/pip" install -q --no-cache-dir --disable-pip-version-check -r "$req"
  echo "$want" > "$stamp"
fi
# The first build of the workspace (debug for the tests, release for the quickstart) writes ~6 GiB.
if [ ! -d "$root/target" ]; then
  need_space "$root" 6 "the first cargo build (target/)"
fi
# `setup.sh --tests` (make test): headless Chromium from the distribution, which renders `verl ab`'s
# report in its end-to-end test.
if [ "${1:-}" = "--tests" ] && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  echo "[setup] installing chromium (headless browser for the report test; one time, ~1 min)"
  if ! { $sudo apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
      || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q --no-install-recommends chromium >/dev/null; }; }; then
    echo "[setup] error: could not install chromium with apt-get (the report test needs it)" >&2
    exit 1
  fi
fi
