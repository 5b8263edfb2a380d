#!/bin/bash
#SBATCH --job-name=big
#SBATCH --output=big.out
# A 24 MiB result and a 14 MB text table, as a simulation leaves them.
head -c 25165824 /dev/zero | tr '\0' 'q' > field.dat
seq 1 2000000 > table.txt
echo "$(wc -c < field.dat) $(wc -l < table.txt)"
