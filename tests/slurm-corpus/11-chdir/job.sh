#!/bin/bash
#SBATCH --job-name=chdir
#SBATCH --chdir=work
#SBATCH --output=chdir.out
echo "in $(basename "$PWD")"
tr a-z A-Z < in.txt > out.txt
