#!/bin/sh
# srun inside a Shoal task (issue 22): one job step of one task on this
# node, which is the task's sandbox. What a single-node step says is
# honoured (-c/--cpus-per-task, -D/--chdir, -l/--label, -J) or accepted
# (--export, output, time, memory, binding and verbosity options); a step of
# several tasks or nodes, and MPI, stop with the reason and exit 1, as Slurm
# refuses a step larger than its allocation. POSIX sh: the guest may have
# no bash.
set -u
ntasks=1
nodes=1
label=0
die() {
	echo "srun: error: $*" >&2
	exit 1
}
value() {
	# The value of an option given as "--opt=v", "-ov" or "-o v" (the
	# caller checked that "-o v" has its v).
	case "$1" in
	--*=*) printf '%s' "${1#*=}" ;;
	--*) printf '%s' "$2" ;;
	-??*) printf '%s' "${1#-?}" ;;
	*) printf '%s' "$2" ;;
	esac
}
takes() {
	# 2 when the option's value is the next word, else 1.
	case "$1" in
	--*=* | -??*) echo 1 ;;
	*) echo 2 ;;
	esac
}
needs() {
	# Stops unless the option's value is there.
	[ "$(takes "$1")" -le "$2" ] || die "$1 needs a value"
}
while [ $# -gt 0 ]; do
	case "$1" in
	--) shift; break ;;
	-n | -n?* | --ntasks | --ntasks=*)
		needs "$1" $#; ntasks=$(value "$@"); n=$(takes "$1") ;;
	-N | -N?* | --nodes | --nodes=*)
		needs "$1" $#; nodes=$(value "$@"); n=$(takes "$1") ;;
	-c | -c?* | --cpus-per-task | --cpus-per-task=*)
		needs "$1" $#; SLURM_CPUS_PER_TASK=$(value "$@"); export SLURM_CPUS_PER_TASK; n=$(takes "$1") ;;
	-D | -D?* | --chdir | --chdir=*)
		needs "$1" $#; dir=$(value "$@"); n=$(takes "$1"); cd "$dir" || die "chdir to $dir failed" ;;
	-J | -J?* | --job-name | --job-name=*)
		needs "$1" $#; SLURM_JOB_NAME=$(value "$@"); export SLURM_JOB_NAME; n=$(takes "$1") ;;
	--mpi | --mpi=*) die "an MPI step cannot run in a Shoal task: a task is one sandbox, with no fabric to other sandboxes" ;;
	-l | --label) label=1; n=1 ;;
	-o | -o?* | --output | --output=* | -e | -e?* | --error | --error=* | -i | -i?* | --input | --input=* | \
		-t | -t?* | --time | --time=* | --mem | --mem=* | --mem-per-cpu | --mem-per-cpu=* | \
		-p | -p?* | --partition | --partition=* | -A | -A?* | --account | --account=* | \
		--gres | --gres=* | --gpus | --gpus=* | -G | -G?* | --cpu-bind | --cpu-bind=* | \
		--mem-bind | --mem-bind=* | -m | -m?* | --distribution | --distribution=* | \
		--ntasks-per-node | --ntasks-per-node=* | --kill-on-bad-exit=* | --signal | --signal=* | \
		-W | -W?* | --wait | --wait=* | --open-mode | --open-mode=* | --export | --export=*)
		needs "$1" $#; n=$(takes "$1") ;;
	-u | --unbuffered | --exclusive | --exclusive=* | --overlap | --exact | --whole | -Q | --quiet | \
		-v | --verbose | -K | --kill-on-bad-exit | -X | --disable-status | --pty)
		n=1 ;;
	-*) die "unrecognized option '$1' (srun in a Shoal task runs one task on this node)" ;;
	*) break ;;
	esac
	shift "$n"
done
[ $# -gt 0 ] || die "no command given to execute"
case "$ntasks" in '' | *[!0-9]*) die "invalid number of tasks: $ntasks" ;; esac
case "$nodes" in '' | *[!0-9]*) die "invalid number of nodes: $nodes" ;; esac
[ "$nodes" -le 1 ] || die "a step of $nodes nodes cannot run in a Shoal task: a task is one node (its sandbox)"
[ "$ntasks" -le 1 ] || die "a step of $ntasks tasks cannot run in a Shoal task: srun starts one copy of its command here"
# The step: numbered from 0 within the task, as Slurm numbers them (the
# count is kept beside this file).
state=$(dirname "$0")
steps=$state/.steps
step=$(cat "$steps" 2>/dev/null || echo 0)
case "$step" in '' | *[!0-9]*) step=0 ;; esac
(echo $((step + 1)) >"$steps") 2>/dev/null || true
SLURM_STEP_ID=$step SLURM_STEPID=$step SLURM_STEP_NUM_TASKS=1 SLURM_STEP_NUM_NODES=1 \
	SLURM_NTASKS=1 SLURM_NPROCS=1 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0
export SLURM_STEP_ID SLURM_STEPID SLURM_STEP_NUM_TASKS SLURM_STEP_NUM_NODES \
	SLURM_NTASKS SLURM_NPROCS SLURM_PROCID SLURM_LOCALID SLURM_NODEID
if [ "$label" = 1 ]; then
	# Slurm labels each line with the task number: "0: ...".
	status=$(mktemp) || die "no temporary file for the step's status"
	{ "$@"; echo $? >"$status"; } 2>&1 | sed 's/^/0: /'
	code=$(cat "$status" 2>/dev/null || echo 1)
	rm -f "$status"
	exit "$code"
fi
exec "$@"
