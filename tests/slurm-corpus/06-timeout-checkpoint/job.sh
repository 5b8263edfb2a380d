#!/bin/bash
#SBATCH --job-name=long
#SBATCH --time=1
#SBATCH --output=long.out

# Checkpoint on SIGTERM, as Slurm sends it at the time limit.
checkpoint() {
  sleep 1
  echo "checkpointed" > checkpoint.txt
  echo "caught SIGTERM, checkpoint written"
  exit 0
}
trap checkpoint TERM
echo "started"
while true; do
  sleep 1
done
