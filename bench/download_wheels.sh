#!/usr/bin/env bash
# Download the wheels the GPU machine lacks for bench/trl_grpo.py (TRL's GRPOTrainer) into <repo>/.whl.
#
# The GPU machine (see /work/.library/device/KINDS.md) runs Python 3.12 on x86-64 with torch 2.11,
# transformers 5.x, accelerate, huggingface_hub, pandas, pyarrow, xxhash, fsspec, tqdm, pyyaml, jinja2,
# psutil ... already installed, and has no internet. What it lacks for `import trl` + GRPOTrainer is:
#   trl, datasets, and datasets' dill + multiprocess.
# peft (the LoRA bench, issue 44) is pinned here too: the image has a peft of its own (version unchecked), and all
# of peft 0.21.2's requirements (accelerate, psutil, huggingface_hub, safetensors, tqdm, packaging, pyyaml, numpy,
# transformers, torch) are in the image.
# Each wheel is fetched with --no-deps for that interpreter/platform; on the device install them with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
# (see bench/README.md).
#
# Usage: bash bench/download_wheels.sh            # from anywhere; writes <repo>/.whl
#        WITH_PYARROW=1 bash bench/download_wheels.sh   # also carry pyarrow (~45 MB) if the device's is < 24
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$REPO/.whl"
PY="${PYTHON:-python3}"
mkdir -p "$DEST"

# /.whl is in .gitignore; the device README also suggests .git/info/exclude. Check, don't edit.
if ! git -C "$REPO" check-ignore -q "$DEST/probe.whl" 2>/dev/null; then
  echo "warning: $DEST is not git-ignored; add '/.whl' to .gitignore" >&2
fi

PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

# Pinned: TRL 1.16.0 as the issue asks; datasets 5.2.0 (newest; needs huggingface_hub>=1.31, which the
# device has: 1.33) and the dill/multiprocess versions its metadata allows (dill<0.4.2, multiprocess<0.70.20).
PKGS=(
  trl==1.16.0
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
  # LoRA bench (issue 44): trl_grpo.py --lora-rank (TRL's peft_config, plain mode's get_peft_model).
  peft==0.21.2
)
if [[ "${WITH_PYARROW:-0}" == 1 ]]; then
  PKGS+=(pyarrow==26.0.1)
fi

for p in "${PKGS[@]}"; do
  name="${p%%==*}"
  # Keep exactly one version of each package (two versions break the --no-deps install).
  if ls "$DEST" | grep -qiE "^${name//-/_}-[0-9]"; then
    if ! ls "$DEST" | grep -qiE "^${name//-/_}-${p##*==}-"; then
      echo "removing other versions of $name" >&2
      find "$DEST" -maxdepth 1 -iname "${name//-/_}-[0-9]*.whl" -delete
    fi
  fi
  "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$DEST" "$p"
done

echo "wheels in $DEST:"
ls -l "$DEST"/*.whl | awk '{printf "  %8.1f KiB  %s\n", $5/1024, $NF}'
du -ch "$DEST"/*.whl | tail -1
