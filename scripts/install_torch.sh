#!/bin/sh
# Install torch into the venv without pulling a CUDA build on a machine without a GPU.
#
# Names no package host: pip's own configuration decides where torch comes from
# (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, pip.conf). On x86-64 Linux
# without an NVIDIA driver it asks for the CPU-only build, torch==VERSION+cpu, which
# only a CPU wheel index or a wheel directory serves; when pip's configuration reaches
# none, it stops with one line saying how to point pip at one, rather than fetching a
# multi-GB CUDA build. Elsewhere (a GPU host, macOS, Arm) it installs torch==VERSION
# from the configured index.
set -eu
PY=${PY:-.venv/bin/python}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
if "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
    exit 0
fi
if [ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    if ! "$PY" -m pip install --quiet "torch==${TORCH_VERSION}+cpu"; then
        echo "install_torch.sh: pip found no CPU-only torch ${TORCH_VERSION}+cpu; point pip at a CPU wheel index" \
             "(PIP_INDEX_URL=... or PIP_EXTRA_INDEX_URL=... make install) or a directory holding the wheel" \
             "(PIP_FIND_LINKS=/path/to/wheels make install)" >&2
        exit 1
    fi
    exit 0
fi
exec "$PY" -m pip install --quiet "torch==${TORCH_VERSION}"
