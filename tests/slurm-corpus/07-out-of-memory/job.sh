#!/bin/bash
#SBATCH --job-name=hungry
#SBATCH --mem=100M
#SBATCH --output=hungry.out
echo "loading"
awk 'BEGIN { s = "xxxxxxxxxxxxxxxx"; while (length(s) < 1024 * 1024 * 1024) s = s s; print length(s) }'
echo "after $?"
