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

host=$(uname -n)
facts=$(printf '{"hostname":%s,"arch":%s,"facts":{"cpus":%s,"mem_kb":%s,"gpus":%s,"kernel":%s,"machine_id":%s}}' \
    "$(json_str "$host")" \
    "$(json_str "$(uname -m)")" \
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
post health "$(printf '{"status":"%s","detail":%s}' "$status" "$(json_str "${detail:-all checks passed}")")"

mkdir -p "$(dirname "$DONE")"
touch "$DONE"
