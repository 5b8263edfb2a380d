# /init of the Shoal initramfs: load the virtio modules, mount /dev/vda and
# hand PID 1 over to the guest agent. Any failure is reported on the
# console and powers the VM off, so a broken image never hangs a bake.
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
AGENT=/usr/local/sbin/shoal-guest-agent

fail() {
    echo "shoal-init: FATAL: $*" >&2
    # ACPI poweroff ends QEMU. Without ACPI, poweroff only halts the CPU
    # and QEMU would sit there forever: reboot instead, which the engine's
    # -no-reboot turns into a QEMU exit.
    if [ -d /sys/firmware/acpi ]; then
        echo "shoal-init: powering off" >&2
        poweroff -f
    fi
    echo "shoal-init: rebooting (no ACPI poweroff)" >&2
    reboot -f
    exit 1
}

mount -t devtmpfs devtmpfs /dev || fail "cannot mount devtmpfs on /dev"
mount -t proc proc /proc || fail "cannot mount /proc"
mount -t sysfs sysfs /sys || fail "cannot mount /sys"

mmio_params=$(mmio_params_from_cmdline "$(cat /proc/cmdline)")
while read -r module; do
    [ -n "$module" ] || continue
    params=""
    [ "$module" = virtio_mmio.ko ] && params=$mmio_params
    # $params is deliberately unquoted: one word per device= parameter.
    # shellcheck disable=SC2086
    insmod "/lib/modules/$module" $params || fail "insmod $module $params failed"
done < /lib/modules/load-order

wait_for_block /dev/vda 50 ||
    fail "/dev/vda did not appear within 5 s (no virtio-blk disk attached, or the virtio-mmio devices were not discovered: Shoal needs QEMU microvm with ACPI on)"
mount -t ext4 -o rw,noatime /dev/vda /newroot || fail "cannot mount /dev/vda (ext4) on /newroot"
[ -x "/newroot$AGENT" ] || fail "$AGENT is missing or not executable on the root filesystem"
for fs in dev proc sys; do
    mkdir -p "/newroot/$fs"
    mount --move "/$fs" "/newroot/$fs" || fail "cannot move /$fs into the new root"
done
exec switch_root /newroot "$AGENT" --init
fail "switch_root to $AGENT failed"
