#!/usr/bin/env bash
# Set up orchestrator in ./.venv: the package, the real ms-swift 4.6 stack (torch 2.13.0 from the package
# index; on a CPU-only machine point PIP_EXTRA_INDEX_URL at https://download.pytorch.org/whl/cpu for the
# small CPU build), and with --test the test tools (pytest, hypothesis, py-spy) plus rsync and
# Prometheus/promtool. Idempotent: a second run only checks. Needs nothing but the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1
PY=${PYTHON:-python3}
say() { echo "setup: $* (${SECONDS}s)"; }
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "setup: Python >= 3.11 needed ($PY)" >&2; exit 2; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $PY"
  "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first, alone: the largest download, so its progress line comes before the long wait.
if .venv/bin/python -c 'import torch' 2>/dev/null; then
  say "torch already installed"
else
  say "installing torch 2.13.0${PIP_EXTRA_INDEX_URL:+ (extra index: $PIP_EXTRA_INDEX_URL)}, the largest download ..."
  pip install "torch==2.13.0"
fi
extras=swift
[ $want_test = 1 ] && extras=swift,test
say "installing orchestrator[$extras] with ms-swift 4.6.0 and the pins in constraints/swift-cpu.txt ..."
pip install -e ".[$extras]" -c constraints/swift-cpu.txt
if [ $want_test = 1 ]; then
  missing=()
  command -v rsync >/dev/null || missing+=(rsync)
  command -v promtool >/dev/null || missing+=(prometheus)
  command -v systemd-analyze >/dev/null || missing+=(systemd)
  [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && command -v srun >/dev/null \
    || missing+=(slurmctld slurmd slurm-client)   # the 3-node test cluster (tests/slurm_cluster.py)
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
      say "installing ${missing[*]} with apt-get ..."
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
      echo "setup: please install: ${missing[*]} (tests that need them are skipped)" >&2
    fi
  fi
fi
say "ok ($(.venv/bin/orchestrator --version))"
