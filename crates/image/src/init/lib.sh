# Functions of the Shoal initramfs /init. Kept apart from the main script
# so unit tests can source them alone with busybox sh.

# Prints the insmod parameters for virtio_mmio found on a kernel command
# line: each virtio_mmio.device=<size>@<base>:<irq>[:<id>] (what QEMU's
# microvm appends with acpi=off) becomes device=<...>. Module parameters
# given on the command line only reach built-in code, so /init must pass
# them to insmod itself.
mmio_params_from_cmdline() {
    params=""
    for arg in $1; do
        case "$arg" in
            virtio_mmio.device=*) params="$params device=${arg#virtio_mmio.device=}" ;;
        esac
    done
    echo "${params# }"
}

# Waits up to $2 tenths of a second for block device $1 to appear.
wait_for_block() {
    tries=0
    while [ ! -b "$1" ]; do
        [ "$tries" -ge "$2" ] && return 1
        sleep 0.1
        tries=$((tries + 1))
    done
    return 0
}
