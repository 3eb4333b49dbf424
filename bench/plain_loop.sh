#!/bin/bash
# The field's restart loop, as a shell script: relaunch the trainer after a fixed sleep, resuming from
# the newest checkpoint directory (the field's procedure: resume-from-latest, no verification, no hang
# detection, a fixed port). Done when the trainer exits 0.
#   plain_loop.sh OUTPUT_DIR SLEEP_S TRAINER_ARGV...
out=$1; wait_s=$2; shift 2
while true; do
  latest=$(ls -d "$out"/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -n 1)
  if [ -n "$latest" ]; then
    "$@" --resume_from_checkpoint "$latest"
  else
    "$@"
  fi
  [ $? -eq 0 ] && exit 0
  sleep "$wait_s"
done
