#!/bin/bash
#SBATCH --job-name=analyse
#SBATCH --output=analyse.out
total=$(awk '{ s += $1 } END { print s }' intermediate/numbers.txt)
echo "$total" > total.txt
echo "total $total"
