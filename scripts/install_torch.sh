#!/bin/sh
# Install torch into the venv without pulling a CUDA build on a machine without a GPU.
# Order of preference: torch already there at the right version; a local wheel directory
# that pip already knows (PIP_FIND_LINKS); the CPU wheel index when no NVIDIA driver is
# present; the default index otherwise (CUDA build, for GPU machines).
set -eu
PY=${PY:-.venv/bin/python}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
if "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
    exit 0
fi
if [ -n "${PIP_FIND_LINKS:-}" ] && ls ${PIP_FIND_LINKS}/torch-${TORCH_VERSION}* >/dev/null 2>&1; then
    exec "$PY" -m pip install --quiet "torch==${TORCH_VERSION}"
fi
if [ -d /opt/wheels ] && ls /opt/wheels/torch-${TORCH_VERSION}* >/dev/null 2>&1; then
    exec "$PY" -m pip install --quiet --find-links /opt/wheels "torch==${TORCH_VERSION}"
fi
if ! command -v nvidia-smi >/dev/null 2>&1; then
    exec "$PY" -m pip install --quiet "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
fi
exec "$PY" -m pip install --quiet "torch==${TORCH_VERSION}"
