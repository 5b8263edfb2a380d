#!/bin/bash
#SBATCH --job-name=flaky
#SBATCH --array=1-3
if [ "$SLURM_ARRAY_TASK_ID" -eq 2 ]; then
  echo "task 2: bad input" >&2
  exit 3
fi
echo "task ${SLURM_ARRAY_TASK_ID} fine"
