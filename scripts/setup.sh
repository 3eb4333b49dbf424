#!/usr/bin/env bash
# Set up orchestrator in ./.venv: the package, the real ms-swift 4.6 stack on CPU (torch CPU wheel),
# and with --test the test tools (pytest, hypothesis, py-spy) plus rsync and Prometheus/promtool.
# Idempotent: a second run only checks. Works offline apart from the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "setup: Python >= 3.11 needed ($PY)" >&2; exit 2; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first, alone: the CPU build (2.13.0+cpu). Elsewhere set PIP_EXTRA_INDEX_URL to the PyTorch CPU index.
.venv/bin/python -c 'import torch' 2>/dev/null || pip install "torch==2.13.0+cpu"
extras=swift
[ $want_test = 1 ] && extras=swift,test
pip install -e ".[$extras]" -c constraints/swift-cpu.txt
if [ $want_test = 1 ]; then
  missing=()
  command -v rsync >/dev/null || missing+=(rsync)
  command -v promtool >/dev/null || missing+=(prometheus)
  command -v systemd-analyze >/dev/null || missing+=(systemd)
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
      echo "setup: please install: ${missing[*]} (tests that need them are skipped)" >&2
    fi
  fi
fi
echo "setup: ok ($(.venv/bin/orchestrator --version))"
