# Sourced by scripts/up and scripts/test: create or reuse .venv/ at the repo root and install
# the project with the extras in $KVS_EXTRAS, then the packages in $KVS_NODEPS without their
# dependencies. torch is installed first, pinned to the CPU wheel our machines carry: letting
# pip resolve torch on its own pulls a multi-GB CUDA build (SGLang's wheel would, too, which is
# why it goes in with --no-deps).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
KVS_NODEPS="${KVS_NODEPS:-}"
if [ ! -x "$venv/bin/python" ]; then
  echo "creating $venv" >&2
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
want="$(sha256sum < "$root/pyproject.toml" | cut -c1-16)-${KVS_EXTRAS}-${KVS_NODEPS}"
stamp="$venv/.kvsidecar-installed"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing kvsidecar[${KVS_EXTRAS}] into $venv (the first run takes a few minutes)" >&2
  # --no-compile: byte-compiling every module of torch and friends up front took more than
  # half the install (42 -> 8 s for torch alone); the suite compiles the ones it imports, once.
  pip_install() { "$py" -m pip install -q --disable-pip-version-check --no-compile "$@"; }
  pip_install --upgrade pip
  pip_install "torch==2.13.0"
  pip_install -e "$root[${KVS_EXTRAS}]"
  if [ -n "$KVS_NODEPS" ]; then
    # shellcheck disable=SC2086  # a list of requirement specs
    pip_install --no-deps $KVS_NODEPS
  fi
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
