#!/bin/bash
# One input answered by a Slurm array of 4 tasks, one shard each, then merged by a job that Slurm starts
# once every task has ended well:
#
#   examples/cluster/slurm-batch.sh requests.jsonl results.jsonl [more dsv4 batch flags, e.g. --model DIR]
#
# Each task runs `dsv4 batch --shard auto`, which reads SLURM_ARRAY_TASK_ID (less SLURM_ARRAY_TASK_MIN) and
# SLURM_ARRAY_TASK_COUNT. --resume makes a rerun task (requeued after a node failure, or resubmitted by hand
# with `sbatch --array=2 ...`) answer only what its shard's files do not hold yet. IN and OUT must be on a
# file system every node sees. The merge is given the same flags, so --retry-failed reruns failed requests
# with the shards' own settings.
set -euo pipefail
IN=${1:?usage: slurm-batch.sh IN.jsonl OUT.jsonl [dsv4 batch flags]}
OUT=${2:?usage: slurm-batch.sh IN.jsonl OUT.jsonl [dsv4 batch flags]}
shift 2
FLAGS=$( (( $# )) && printf ' %q' "$@" || true)
SHARDS=${SHARDS:-4}

job=$(sbatch --parsable --job-name=dsv4-batch --array=0-$((SHARDS - 1)) --requeue \
      --output="$OUT.shard-%a.log" ${SBATCH_FLAGS:-} \
      --wrap="dsv4 batch $(printf %q "$IN") -o $(printf %q "$OUT") --shard auto --resume$FLAGS")
sbatch --job-name=dsv4-merge --dependency="afterok:$job" --output="$OUT.merge.log" \
       --wrap="dsv4 batch merge $(printf %q "$OUT") --retry-failed$FLAGS"
echo "array job $job: $SHARDS shards of $IN; the merge writes $OUT when they have all ended"
