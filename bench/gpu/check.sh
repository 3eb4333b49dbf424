#!/usr/bin/env bash
# The GPU check's entry: one device call runs it, as `bench/gpu/prepare.py` prints it:
#   run(command="bash bench/gpu/check.sh", carry=[".gpu-wheels"], timeout_s=600)
# Installs the carried wheels (.gpu-wheels/, if there) into $GPU_CHECK_WORK/site with no index, puts them and
# this repository on PYTHONPATH, then runs bench/gpu/gpucheck.py: $OUT/summary.json and $OUT/logs.tar.gz.
# Without $OUT (by hand, or the tests) it writes to ./.gpu-check-out. It ends itself within
# GPU_CHECK_BUDGET_S (420 s) plus the install (~30 s) and its last step's overrun (at most ~120 s).
# Arguments go to gpucheck.py: `bash bench/gpu/check.sh --only fla_backward_oom` reruns one step.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/.gpu-check-out}
WORK=${GPU_CHECK_WORK:-/tmp/gpu-check}
WHEELS=${GPU_CHECK_WHEELS:-.gpu-wheels}
rm -rf "$WORK" && mkdir -p "$WORK/logs" "$OUT" || exit 2
SITE="$WORK/site"
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if (( ${#wheels[@]} )); then
  echo "installing ${#wheels[@]} carried wheels into $SITE ..."
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${wheels[@]}" >"$WORK/logs/install.log" 2>&1
  echo $? >"$WORK/install.rc"
  echo "${#wheels[@]}" >"$WORK/install.count"
  export PATH="$SITE/bin:$PATH"
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$PY" bench/gpu/gpucheck.py --out "$OUT" --work "$WORK" --budget-s "${GPU_CHECK_BUDGET_S:-420}" "$@"
