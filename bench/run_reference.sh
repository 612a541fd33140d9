#!/usr/bin/env bash
# Run the Python reference (plain HF + TRL GRPOTrainer) on the GPU machine, from the repo root:
#   bash bench/run_reference.sh ARCH [extra trl_grpo.py flags...]
# Needs the wheels from bench/download_wheels.sh in .whl (name `.whl` in the device call's `carry`).
# Writes $OUT/ref_<ARCH>.jsonl (one JSON line per system) and $OUT/<mode>_<ARCH>.log; prints a table at the end.
# MODES="plain trl" (default) picks which Python systems run; verl-rs runs first when .bin/gpu/verl exists.
set -uo pipefail
ARCH="${1:?usage: bash bench/run_reference.sh ARCH [flags]}"; shift
OUTDIR="${OUT:-/tmp/bench_out}"; mkdir -p "$OUTDIR"
# The target path must contain 'site-packages': dill (used by datasets to fingerprint a Dataset) pickles any
# module whose file lies outside such a path by value, and fails on pyarrow's types (seen with /tmp/site).
# SKIP_INSTALL=1 skips the install (for a CPU try-out where PYTHONPATH already holds trl & co).
PY="${PYTHON:-python3}"
SITE=/tmp/site-packages
if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "wheel install failed" >&2; exit 1; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
"$PY" - <<'PY'
import importlib, torch
for m in ("torch", "transformers", "accelerate", "datasets", "trl", "peft", "pyarrow", "huggingface_hub", "tokenizers", "fsspec", "pandas"):
    try:
        mod = importlib.import_module(m); print(f"{m:16s} {mod.__version__:14s} {mod.__file__}")
    except Exception as e:
        print(f"{m:16s} IMPORT FAILED: {e!r}")
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
PY
JSONL="$OUTDIR/ref_${ARCH}.jsonl"
rc=0
# verl-rs first, when its binary is here (VERL_BIN, default .bin/gpu/verl, with libverl_fsdp.so next to it;
# carry `.bin` in the device call). VERL_FLAGS are passed to `verl bench grpo` only (trl_grpo.py gets "$@"),
# after the workload flags, so e.g. VERL_FLAGS="--device cpu --prompts 2" overrides them. SKIP_VERL=1 skips it.
VERL_BIN="${VERL_BIN:-.bin/gpu/verl}"
BASE=plain
if [[ "${SKIP_VERL:-0}" != 1 && -x "$VERL_BIN" ]]; then
  [[ -d /opt/torch/.venv/bin ]] && export PATH="/opt/torch/.venv/bin:$PATH"  # the loader finds libtorch via python3
  # shellcheck disable=SC2086
  if "$VERL_BIN" bench grpo --arch "$ARCH" --prompts 64 --n 8 --prompt-len 256 --response-len 512 --ignore-eos \
      --device cuda --json ${VERL_FLAGS:-} >"$OUTDIR/verl_${ARCH}.json" 2> >(tee "$OUTDIR/verl_${ARCH}.log" >&2); then
    grep '^{' "$OUTDIR/verl_${ARCH}.json" >>"$JSONL" && BASE=verl-rs
  else
    rc=$?; echo "verl bench grpo failed (rc $rc); see $OUTDIR/verl_${ARCH}.log" >&2
  fi
elif [[ "${SKIP_VERL:-0}" != 1 ]]; then
  echo "no verl binary at $VERL_BIN: running the Python reference only" >&2
fi
for mode in ${MODES:-plain trl}; do
  "$PY" bench/trl_grpo.py --mode "$mode" --arch "$ARCH" --prompts 64 --n 8 --prompt-len 256 --response-len 512 \
    --ignore-eos --device cuda --json-out "$JSONL" "$@" 2> >(tee "$OUTDIR/${mode}_${ARCH}.log" >&2) || rc=$?
done
if [[ -s "$JSONL" ]]; then
  "$PY" bench/ratio_table.py "$JSONL" --base "$BASE"
  [[ "$BASE" != plain ]] && grep -q '"system": "plain"' "$JSONL" && { echo; "$PY" bench/ratio_table.py "$JSONL" --base plain; }
fi
exit $rc
