# Source me: the environment the build and the tests need (tch finds libtorch through the venv's torch).
_verl_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$_verl_root/.venv/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
_verl_torch_lib="$(ls -d "$_verl_root"/.venv/lib/python3*/site-packages/torch/lib 2>/dev/null | head -n1 || true)"
if [ -n "$_verl_torch_lib" ]; then
  export LD_LIBRARY_PATH="$_verl_torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
unset _verl_root _verl_torch_lib
