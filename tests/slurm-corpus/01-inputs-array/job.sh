#!/bin/bash
#SBATCH --job-name=align
#SBATCH --array=1-4%2
#SBATCH --time=00:10:00
#SBATCH --cpus-per-task=1
#SBATCH --mem=512M

# One sample per task, read from the submit directory.
cd "$SLURM_SUBMIT_DIR"
SAMPLE=$(sed -n "${SLURM_ARRAY_TASK_ID}p" samples.txt)
echo "task ${SLURM_ARRAY_TASK_ID} of ${SLURM_ARRAY_TASK_COUNT}: ${SAMPLE}"
mkdir -p results
awk -v s="$SAMPLE" '!/^#/ { print s, $1, $2 * length(s) }' data/reference.txt > "results/${SAMPLE}.tsv"
wc -l < "results/${SAMPLE}.tsv"
