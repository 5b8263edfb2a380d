#!/bin/bash
#SBATCH --job-name=steps
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
#SBATCH --output=steps.log

echo "before the steps"
srun --ntasks=1 bash -c 'echo "step ${SLURM_STEP_ID} procid ${SLURM_PROCID}"' > step0.txt
srun -n1 --cpus-per-task=1 bash -c 'seq 1 5 | paste -sd+ | bc 2>/dev/null || echo 15' > step1.txt
srun sh -c 'exit 0'
echo "steps done: $(cat step0.txt) $(cat step1.txt)"
