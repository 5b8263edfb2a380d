#!/bin/bash
#SBATCH --job-name=prepare
#SBATCH --output=prepare.out
mkdir -p intermediate
seq 1 100 > intermediate/numbers.txt
echo "prepared $(wc -l < intermediate/numbers.txt) numbers"
