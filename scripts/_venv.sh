# Sourced by scripts/up and scripts/test: create or reuse .venv/ at the repo root and install
# the project with the extras in $KVS_EXTRAS. torch is installed first, pinned to the CPU
# wheel our machines carry: letting pip resolve torch on its own pulls a multi-GB CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
  echo "creating $venv" >&2
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
want="$(cat "$root/pyproject.toml" | sha256sum | cut -c1-16)-${KVS_EXTRAS}"
stamp="$venv/.kvsidecar-installed"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing kvsidecar[${KVS_EXTRAS}] into $venv (first run takes a minute)" >&2
  "$py" -m pip install -q --disable-pip-version-check --upgrade pip
  "$py" -m pip install -q --disable-pip-version-check "torch==2.13.0"
  "$py" -m pip install -q --disable-pip-version-check -e "$root[${KVS_EXTRAS}]"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
