#!/bin/sh
# pxed first-boot agent for {{ hostname }}, installed with the OS by pxed.
#
# Once, on the first boot that reaches the network, it POSTs the machine's facts
# to $CB/first-boot, runs a small health check and POSTs the result to $CB/health.
# The last part of $CB is this node's agent token, its credential for exactly these
# two reports: this file is root's only, and the token is never printed.
# Each POST is retried with exponential backoff
# (2 s doubling to 5 min) until the server answers 2xx; then the done file is
# created, and the unit's ConditionPathExists keeps it from ever running again.
#
# Health check: "pass" when all of these hold, else "fail" with the reasons:
#   root   the root filesystem is mounted read-write
#   route  a default route exists (IPv4 or IPv6)
#   units  no systemd unit is in the failed state (is-system-running would say
#          "starting" while this unit itself runs, so failed units are counted)
#   name   the hostname is the one pxed assigned
# plus the checks of the node's hardware profile (pxed config `[[profiles]] health`),
# each a command with a timeout, an exit status and text its output must contain.
#
# The first-boot report carries the machine's inventory as this system sees it (PCI
# functions with their PCIe links and NUMA nodes, NICs, CPU, memory) from sysfs, for
# pxed's acceptance gate.
set -u

CB='{{ agent_base }}'
EXPECTED_HOSTNAME='{{ hostname }}'
DONE=${PXED_FIRSTBOOT_DONE:-/var/lib/pxed-firstboot.done}

# A JSON string literal: backslashes and quotes escaped, control characters dropped.
json_str() {
    printf '"%s"' "$(printf '%s' "$1" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' | tr -d '\000-\037')"
}

# A JSON number: digits only, 0 when the probe found nothing.
json_num() {
    case "$1" in
        ''|*[!0-9]*) printf '0' ;;
        *) printf '%s' "$1" ;;
    esac
}

gpu_count() {
    n=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    fi
    # Class 0302: 3D controllers, which is how data-centre GPUs enumerate.
    if [ "$n" = 0 ] && command -v lspci >/dev/null 2>&1; then
        n=$(lspci -d ::0302 2>/dev/null | grep -c .)
    fi
    printf '%s' "$n"
}

post() {
    url="$CB/$1"
    delay=2
    while :; do
        code=$(curl -s -o /dev/null -w '%{http_code}' -m 30 -X POST \
            -H 'Content-Type: application/json' --data-binary "$2" "$url")
        case "$code" in
            2??) return 0 ;;
        esac
        echo "pxed-firstboot: POST $1 answered ${code:-nothing}; retrying in ${delay}s" >&2
        sleep "$delay"
        delay=$((delay * 2))
        if [ "$delay" -gt 300 ]; then delay=300; fi
    done
}

# A sysfs value with its 0x dropped, or the empty string.
sysval() {
    v=$(cat "$1" 2>/dev/null) || v=
    printf '%s' "${v#0x}"
}

# A PCIe link from sysfs (`8.0 GT/s PCIe` and `16`), or null.
link_json() {
    speed=$(awk '{ print $1 + 0 }' "$1/$2_link_speed" 2>/dev/null)
    width=$(cat "$1/$2_link_width" 2>/dev/null)
    case "$speed:$width" in
        *[!0-9.:]*|:*|*:|0:*|*:0) printf 'null' ;;
        *) printf '{"speed_gts":%s,"width":%s}' "$speed" "$width" ;;
    esac
}

# A NUMA node number, or null (-1: the platform does not say).
numa_json() {
    n=$(cat "$1" 2>/dev/null) || n=-1
    case "$n" in
        ''|-*|*[!0-9]*) printf 'null' ;;
        *) printf '%s' "$n" ;;
    esac
}

# Every PCI function: address, IDs, class, NUMA node, current and maximum link.
pci_json() {
    sep=
    printf '['
    for d in /sys/bus/pci/devices/*; do
        [ -e "$d/vendor" ] || continue
        printf '%s{"address":%s,"class":%s,"vendor_id":%s,"device_id":%s,"subsystem_vendor_id":%s,"subsystem_device_id":%s,"numa_node":%s,"link":%s,"max_link":%s}' \
            "$sep" "$(json_str "${d##*/}")" "$(json_str "$(sysval "$d/class")")" \
            "$(json_str "$(sysval "$d/vendor")")" "$(json_str "$(sysval "$d/device")")" \
            "$(json_str "$(sysval "$d/subsystem_vendor")")" \
            "$(json_str "$(sysval "$d/subsystem_device")")" \
            "$(numa_json "$d/numa_node")" "$(link_json "$d" current)" "$(link_json "$d" max)"
        sep=,
    done
    printf ']'
}

# Physical NICs (those with a device): name, MAC, driver, speed, link, PCI address.
nics_json() {
    sep=
    printf '['
    for n in /sys/class/net/*; do
        [ -e "$n/device" ] || continue
        speed=$(cat "$n/speed" 2>/dev/null) || speed=
        case "$speed" in ''|-*|*[!0-9]*) speed=null ;; esac
        dev=$(readlink -f "$n/device")
        printf '%s{"name":%s,"mac":%s,"driver":%s,"speed_mbps":%s,"link_up":%s,"pci_address":%s,"numa_node":%s}' \
            "$sep" "$(json_str "${n##*/}")" "$(json_str "$(cat "$n/address" 2>/dev/null)")" \
            "$(json_str "$(basename "$(readlink -f "$n/device/driver" 2>/dev/null)" 2>/dev/null)")" \
            "$speed" "$([ "$(cat "$n/operstate" 2>/dev/null)" = up ] && echo true || echo false)" \
            "$(json_str "${dev##*/}")" "$(numa_json "$n/device/numa_node")"
        sep=,
    done
    printf ']'
}

inventory_json() {
    nodes=0
    for n in /sys/devices/system/node/node[0-9]*; do
        [ -d "$n" ] && nodes=$((nodes + 1))
    done
    printf '{"arch":%s,"cpu":{"model":%s,"cores":%s,"threads":%s},"numa_nodes":%s,"memory_mib":%s,"system":{"vendor":%s,"model":%s,"serial":%s},"firmware":{"bios":%s},"pci":%s,"nics":%s}' \
        "$(json_str "$(uname -m | sed -e 's/^aarch64$/arm64/')")" \
        "$(json_str "$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)")" \
        "$(json_num "$(grep -E '^core id|^physical id' /proc/cpuinfo | paste - - | sort -u | grep -c .)")" \
        "$(json_num "$(getconf _NPROCESSORS_ONLN 2>/dev/null)")" \
        "$(json_num "$nodes")" \
        "$(json_num "$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)")" \
        "$(json_str "$(cat /sys/class/dmi/id/sys_vendor 2>/dev/null)")" \
        "$(json_str "$(cat /sys/class/dmi/id/product_name 2>/dev/null)")" \
        "$(json_str "$(cat /sys/class/dmi/id/product_serial 2>/dev/null)")" \
        "$(json_str "$(cat /sys/class/dmi/id/bios_version 2>/dev/null)")" \
        "$(pci_json)" "$(nics_json)"
}

host=$(uname -n)
facts=$(printf '{"hostname":%s,"arch":%s,"inventory":%s,"facts":{"cpus":%s,"mem_kb":%s,"gpus":%s,"kernel":%s,"machine_id":%s}}' \
    "$(json_str "$host")" \
    "$(json_str "$(uname -m)")" \
    "$(inventory_json)" \
    "$(json_num "$(getconf _NPROCESSORS_ONLN 2>/dev/null)")" \
    "$(json_num "$(awk '/^MemTotal:/ { print $2 }' /proc/meminfo)")" \
    "$(json_num "$(gpu_count)")" \
    "$(json_str "$(uname -r)")" \
    "$(json_str "$(cat /etc/machine-id 2>/dev/null)")")
post first-boot "$facts"

status=pass
detail=
fail() {
    status=fail
    detail="${detail:+$detail; }$1"
}
# The last mount of / is the one in effect.
if ! awk '$2 == "/" { o = $4 } END { split(o, f, ","); exit !(f[1] == "rw") }' /proc/mounts; then
    fail "root: / is not mounted read-write"
fi
if [ -z "$(ip -4 route show default 2>/dev/null)$(ip -6 route show default 2>/dev/null)" ]; then
    fail "route: no default route"
fi
if failed=$(systemctl list-units --state=failed --no-legend --plain 2>&1); then
    if [ -n "$failed" ]; then
        fail "units: failed: $(printf '%s\n' "$failed" | awk '{ print $1 }' | tr '\n' ' ')"
    fi
else
    fail "units: systemctl: $failed"
fi
if [ "$host" != "$EXPECTED_HOSTNAME" ]; then
    fail "name: hostname is $host, expected $EXPECTED_HOSTNAME"
fi

# run_check NAME TIMEOUT EXIT OUTPUT COMMAND: one profile health check.
run_check() {
    out=$(timeout "$2" /bin/sh -c "$5" 2>/dev/null)
    rc=$?
    if [ "$rc" = 124 ] && [ "$3" != 124 ]; then
        fail "$1: timed out after $2 s"
    elif [ "$rc" != "$3" ]; then
        fail "$1: exit status $rc, expected $3: $(printf '%s' "$out" | tail -c 200 | tr -d '\000-\037')"
    elif [ -n "$4" ]; then
        case "$out" in
            *"$4"*) ;;
            *) fail "$1: output lacks \"$4\"" ;;
        esac
    fi
}
{% for c in checks %}{{ c }}
{% endfor %}
post health "$(printf '{"status":"%s","detail":%s}' "$status" "$(json_str "${detail:-all checks passed}")")"

mkdir -p "$(dirname "$DONE")"
touch "$DONE"
