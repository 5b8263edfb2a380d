#!/bin/bash
#SBATCH --job-name=sub
#SBATCH --array=0-2
#SBATCH --output=logs/%x_%a.out
#SBATCH --error=logs/%x_%a.err
mkdir -p "results/deep/nested/${SLURM_ARRAY_TASK_ID}"
printf 'x,y\n%d,%d\n' "$SLURM_ARRAY_TASK_ID" $((SLURM_ARRAY_TASK_ID * SLURM_ARRAY_TASK_ID)) \
  > "results/deep/nested/${SLURM_ARRAY_TASK_ID}/points.csv"
echo "wrote task ${SLURM_ARRAY_TASK_ID}"
echo "a warning from ${SLURM_ARRAY_TASK_ID}" >&2
