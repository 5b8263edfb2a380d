#!/bin/bash
#SBATCH --job-name=params
#SBATCH --output=params-%x.out
echo "MY_PARAM=${MY_PARAM:-unset}"
echo "SLURM_JOB_NAME=${SLURM_JOB_NAME}"
echo "${MY_PARAM:-unset}" > param.txt
