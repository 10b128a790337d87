# Sourced by demo.sh and test.sh: create .venv if missing and install the project into it.
# torch is pinned to 2.13.0: on this kind of machine that is the CPU wheel; a looser pin pulls a
# multi-GB CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"
STAMP="$VENV/.shardstream-installed"
WANT="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
    echo "shardstream: creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "shardstream: installing dependencies into $VENV (first run takes a few minutes)" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2 || true
    "$VENV/bin/python" -m pip install -q "torch==2.13.0" >&2
    "$VENV/bin/python" -m pip install -q -e "$ROOT[all]" >&2
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export HYDRA_LAUNCHER="${HYDRA_LAUNCHER:-fork}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
