#!/usr/bin/env bash
# The pxed lab: a real Debian 12 put on a QEMU VM through pxed, under Redfish power control.
#
#   lab/run.sh [--vms N] [--reinstalls N] [--keep] [--no-install] [--fault NAME]
#              [--firmware ovmf|seabios] [--installer]
#
# As root on a fresh Debian 12 machine, in this order:
#   1. installs what it needs (.ci/install.sh), builds pxed (release) and meanwhile the
#      Debian 12 disk image, then the deploy ramdisk (both cached under images/cache),
#   2. creates netns `pxlab` with bridge br0 10.98.0.1/24 and one tap per VM,
#   3. starts pxed there (full DHCP on br0, TFTP, HTTP on 10.98.0.1:80), sushy-tools' fake
#      Redfish BMC and lab/controller.py (which turns each Redfish power change into
#      starting, stopping or resetting that VM's QEMU: network boot while a one-time Pxe
#      override is pending, the VM's own disk otherwise),
#   4. registers each VM as a node with its Redfish BMC, allocates it, and calls the
#      reinstall endpoint exactly as a reclaim hook would (POST with an Idempotency-Key),
#   5. follows each node to `available` (or `failed`), prints its timeline, checks the
#      hostname derived from the MAC, and repeats for --reinstalls generations,
#   6. tears down everything it created, even on failure; on a failing node it prints the
#      VM's serial console tail and pxed's log lines for that node.
#
# --fault NAME, one VM, after which the lab checks pxed's verdict:
#   checksum   the image's SHA-256 in the manifest is wrong; notfound: the image file is
#              gone from pxed's store: `failed` at installing with the agent's reason, at
#              once (not at a deadline);
#   poweroff   the VM is powered off (Redfish ForceOff) while the image is being written:
#              the installing deadline retries the reclaim and the node ends `available`;
#   nooverride the VM's disk already holds the Debian image (written from the image cache
#              before it starts, as on a node that ran before) and the BMC accepts the
#              one-time Pxe override but the VM boots that disk: the node must never be
#              reported reinstalled; every netboot method is caught within the observe
#              window (LAB_NETBOOT_OBSERVE, 45 s) and it ends `failed` at netbooting with
#              "netboot_not_observed ... tried: standard, uefi_override, off_on".
#   lyingbmc   the BMC (tests/peers/bmc_fault_proxy.py lie-unless-mode in front of sushy)
#              takes a Pxe override without BootSourceOverrideMode, reads it back as asked
#              and boots the disk: generation 1 must be caught as netboot_not_observed
#              within the observe window, recovered by the `uefi_override` method and end
#              `available`; generation 2 must start with that method (recorded for the
#              BMC model) and end `available` with no netboot_not_observed.
#   lostdevice the VM's hardware changes between reinstalls, through extra QEMU arguments
#              read at each power-on: generation 1 has two PCIe root ports, 09.0 (x16)
#              and 0a.0, each with a virtio-rng card behind it; generation 2 runs 09.0 at
#              x4 and has 0a.0 and its card pulled. Generation 2 must end `quarantined`
#              by the acceptance gate with the diff naming the narrowed link and both
#              removed devices; accepting the inventory (the API's re-baseline) returns
#              the node to `available`. (Unchanged hardware passing the gate is the plain
#              lab's generation 2.)
#   failover   two pxed on one PostgreSQL database (a private cluster started by
#              .ci/pg-start): A on br0 at 10.98.0.1, B on a veth into the same bridge at
#              10.98.0.3, both answering DHCP, TFTP and HTTP, lifecycle.owner_ttl 3 s.
#              While the image is written, the instance that holds the node (node_owners:
#              the one the deploy agent streams from and reports to) is killed with SIGKILL. The
#              other must take the node over, retry it at its installing deadline
#              (LAB_INSTALL_DEADLINE, 150 s here) and finish the reinstall: `available`
#              with the MAC's hostname, every stage in order.
# --installer, one VM: instead of the image deploy, the vendor's installer: Debian 12's
#   debian-installer (debian-installer-12-netboot-amd64) from a mirror built from the
#   archive by lab/di-mirror.sh and served in the namespace on 10.98.0.1:8080. It loads
#   pxed's preseed, logs to pxed's syslog receiver, and stops where the archive's gaps
#   leave it without an installer component (see lab/README.md): the lab checks that
#   pxed saw the preseed loaded and the hostname preseeded, and failed the node at
#   installing with the installer's own words within two minutes of the error.
# KEEP=1 or --keep leaves the namespace, pxed and the VMs running (status page at
#   http://10.98.0.1/ inside the namespace: `ip netns exec pxlab curl -s 10.98.0.1/`).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
VMS=1 REINSTALLS=2 KEEP=${KEEP:-} INSTALL=1 FAULT='' FIRMWARE=ovmf PASSES=0 INSTALLER=''
while [ $# -gt 0 ]; do
  case "$1" in
    --vms) VMS=$2; shift ;;
    --reinstalls) REINSTALLS=$2; shift ;;
    --keep) KEEP=1 ;;
    --no-install) INSTALL= ;;
    --fault) FAULT=$2; shift ;;
    --firmware) FIRMWARE=$2; shift ;;
    --installer) INSTALLER=1 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
NS=${LAB_NETNS:-pxlab}
SERVER=10.98.0.1
CACHE=${PXED_IMAGE_CACHE:-$here/images/cache}
W=$(mktemp -d /tmp/pxlab.XXXXXX)
TOKEN=lab-$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')
T0=$(date +%s)
PXED_PID='' CTL_PID='' MIRROR_PID='' IMAGE_PID='' PROXY_PID='' PXED_B_PID='' PG_DIR=''
# The failover fault's second instance; the API is asked through whichever is alive.
SERVER_B=10.98.0.3 API_IP=$SERVER
FAILED=0

say() { printf '[%4ds] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
  local rc=$?
  set +e
  if [ -n "$KEEP" ]; then
    say "kept: namespace $NS, work dir $W (pxed log $W/pxed.log); tear down with: lab/run.sh --teardown-only is not needed: kill $PXED_PID $CTL_PID; ip netns del $NS"
    return
  fi
  if [ -n "$IMAGE_PID" ]; then # the image build and what it started (debootstrap, zstd)
    pkill -TERM -P "$IMAGE_PID" 2>/dev/null; kill -TERM "$IMAGE_PID" 2>/dev/null; wait "$IMAGE_PID" 2>/dev/null
  fi
  [ -n "$CTL_PID" ] && kill -TERM "$CTL_PID" 2>/dev/null && wait "$CTL_PID" 2>/dev/null
  [ -f "$W/lab.json" ] && python3 "$here/lab/controller.py" stop --lab "$W/lab.json" >/dev/null 2>&1
  [ -n "$PXED_PID" ] && kill -TERM "$PXED_PID" 2>/dev/null && wait "$PXED_PID" 2>/dev/null
  [ -n "$PXED_B_PID" ] && kill -TERM "$PXED_B_PID" 2>/dev/null && wait "$PXED_B_PID" 2>/dev/null
  [ -n "$PG_DIR" ] && bash "$here/.ci/pg-start" --stop "$PG_DIR" 2>/dev/null && rm -rf "$PG_DIR"
  [ -n "$MIRROR_PID" ] && kill -TERM "$MIRROR_PID" 2>/dev/null && wait "$MIRROR_PID" 2>/dev/null
  [ -n "$PROXY_PID" ] && kill -TERM "$PROXY_PID" 2>/dev/null && wait "$PROXY_PID" 2>/dev/null
  ip netns pids "$NS" 2>/dev/null | xargs -r kill -9 2>/dev/null
  ip netns del "$NS" 2>/dev/null
  rm -rf "$W"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

[ "$(id -u)" = 0 ] || { echo "lab/run.sh needs root (network namespaces, taps)" >&2; exit 2; }

# ---- 1. tools, pxed, image, deploy ramdisk
if [ -n "$INSTALL" ]; then
  say "installing tools (.ci/install.sh)"
  bash "$here/.ci/install.sh" > "$W/install.log" 2>&1 || { tail -20 "$W/install.log"; exit 1; }
fi
IMAGE=debian-12 MIRROR=$CACHE
# The Debian image does not need pxed: it is built (or found current) while cargo builds.
if [ -z "$INSTALLER" ]; then
  bash "$here/images/build/debian-12.sh" --out "$CACHE" > "$W/image.log" 2>&1 &
  IMAGE_PID=$!
fi
say "building pxed (release)${IMAGE_PID:+ and meanwhile the Debian 12 image}"
(cd "$here" && cargo build --release --quiet)
PXED=$here/target/release/pxed
if [ -n "$INSTALLER" ]; then
  say "building or reusing the debian-installer mirror in $CACHE/di-mirror"
  bash "$here/lab/di-mirror.sh" --out "$CACHE/di-mirror" > "$W/mirror.log" 2>&1 || { tail -30 "$W/mirror.log"; exit 1; }
  tail -n 1 "$W/mirror.log" | sed 's/^/    /'
  IMAGE=debian-12-installer MIRROR=http://$SERVER:8080/ VMS=1 REINSTALLS=1
else
  say "building or reusing the Debian 12 image and the deploy ramdisk in $CACHE"
  wait "$IMAGE_PID" || { tail -30 "$W/image.log"; exit 1; }
  IMAGE_PID=''
  bash "$here/images/build/deploy-ramdisk.sh" --pxed "$PXED" --out "$CACHE" > "$W/ramdisk.log" 2>&1 \
    || { tail -30 "$W/ramdisk.log"; exit 1; }
  tail -n 2 "$W/image.log" "$W/ramdisk.log" | grep -v '^$' | sed 's/^/    /'
fi

# The image store pxed imports from: the build output, or a copy with a fault in it.
if [ "$FAULT" = checksum ]; then
  MIRROR=$W/mirror; mkdir -p "$MIRROR"
  ln -s "$CACHE/debian-12-amd64.raw.zst" "$CACHE/deploy-amd64" "$MIRROR/"
  python3 - "$CACHE/debian-12-amd64.json" "$MIRROR/debian-12-amd64.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
m["raw_sha256"] = "0" * 64   # what the agent writes can never match this
json.dump(m, open(sys.argv[2], "w"))
PY
fi

# ---- 2. network namespace, bridge, taps
ip netns del "$NS" 2>/dev/null || true
ip netns add "$NS"
ip -n "$NS" link set lo up
ip -n "$NS" link add br0 type bridge
ip -n "$NS" addr add "$SERVER/24" dev br0
ip -n "$NS" link set br0 up
for i in $(seq 1 "$VMS"); do
  ip -n "$NS" tuntap add dev "pxtap$i" mode tap
  ip -n "$NS" link set "pxtap$i" master br0 up
done

# ---- 3. pxed, BMC emulator, lab controller
export PXED_API_TOKEN=$TOKEN PXED_IMAGES_CATALOG=$here/images PXED_MIRROR_BASE=$MIRROR
# The namespace is the lab's own: the board at http://10.98.0.1/ opens without a token.
export PXED_STATUS_PUBLIC=true
case "$FAULT" in
  ''|checksum|notfound) ;;
  poweroff) LAB_INSTALL_DEADLINE=${LAB_INSTALL_DEADLINE:-150s} ;;
  nooverride) REINSTALLS=1
    export PXED_LIFECYCLE__MAX_ATTEMPTS=1 PXED_LIFECYCLE__NETBOOT_OBSERVE=${LAB_NETBOOT_OBSERVE:-45s} ;;
  lyingbmc) REINSTALLS=2
    export PXED_LIFECYCLE__NETBOOT_OBSERVE=${LAB_NETBOOT_OBSERVE:-60s} ;;
  lostdevice) REINSTALLS=2 ;;
  failover) REINSTALLS=1 LAB_INSTALL_DEADLINE=${LAB_INSTALL_DEADLINE:-150s}
    export PXED_LIFECYCLE__OWNER_TTL=3s ;;
  *) echo "unknown fault $FAULT (checksum, notfound, poweroff, nooverride, lyingbmc, lostdevice, failover)" >&2; exit 2 ;;
esac
[ -n "$FAULT" ] && VMS=1
export PXED_LIFECYCLE__DEADLINES__NETBOOTING=${LAB_NETBOOT_DEADLINE:-10m}
export PXED_LIFECYCLE__DEADLINES__INSTALLING=${LAB_INSTALL_DEADLINE:-15m}
export PXED_LIFECYCLE__DEADLINES__FIRST_BOOT=${LAB_FIRSTBOOT_DEADLINE:-10m}
SRV=(--data-dir "$W/data" --ipxe-dir "$here/ipxe/bin")
if [ -n "$INSTALLER" ]; then
  # The mirror, as the installer and pxed reach it: HTTP inside the namespace.
  ip netns exec "$NS" python3 -m http.server 8080 --bind "$SERVER" --directory "$CACHE/di-mirror" \
    > "$W/mirror-http.log" 2>&1 &
  MIRROR_PID=$!
  for _ in $(seq 1 50); do ip netns exec "$NS" curl -sf -o /dev/null "${MIRROR}debian/dists/bookworm/Release" && break; sleep 0.2; done
  export PXED_LIFECYCLE__MAX_ATTEMPTS=0
fi
if [ "$FAULT" = failover ]; then
  # One PostgreSQL database for both instances, its schema from `pxed migrate`.
  PG_DIR=$(mktemp -u /tmp/pxlab-pg.XXXXXX)
  PG_BIN=$(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
  bash "$here/.ci/pg-start" "$PG_DIR" >/dev/null
  "$PG_BIN/psql" -X -q -h "$PG_DIR" -U postgres -d postgres -c 'CREATE DATABASE pxlab' >/dev/null
  export PXED_DATABASE_URL="postgres://postgres@localhost/pxlab?host=$PG_DIR"
  "$PXED" migrate "${SRV[@]}" > "$W/migrate.log" 2>&1 || { cat "$W/migrate.log"; exit 1; }
  say "fault failover: PostgreSQL in $PG_DIR, database pxlab migrated"
fi
say "importing image $IMAGE from $MIRROR"
ip netns exec "$NS" "$PXED" image add "$IMAGE" ${INSTALLER:+--arch x86_64} "${SRV[@]}" > "$W/import.log" 2>&1 \
  || { cat "$W/import.log"; exit 1; }
if [ "$FAULT" = notfound ]; then rm -f "$W/data/images/debian-12/x86_64/disk.raw.zst"; fi
ip netns exec "$NS" env PXED_LOG=info "$PXED" serve "${SRV[@]}" --interface br0 --dhcp full \
  --pool 10.98.0.100-10.98.0.199 --netmask 255.255.255.0 --router "$SERVER" --server-ip "$SERVER" \
  --http "$SERVER:80" --tftp "$SERVER:69" > "$W/pxed.log" 2>&1 &
PXED_PID=$!
if [ "$FAULT" = failover ]; then
  # Instance B: the same secret key and image files (a copy of A's data dir), its own
  # port into the bridge and address; both answer every client.
  cp -a "$W/data" "$W/data-b"
  ip -n "$NS" link add pxb0 type veth peer name pxb1
  ip -n "$NS" link set pxb1 master br0 up
  ip -n "$NS" addr add "$SERVER_B/24" dev pxb0
  ip -n "$NS" link set pxb0 up
  ip netns exec "$NS" sysctl -qw net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.pxb0.rp_filter=0
  ip netns exec "$NS" env PXED_LOG=info "$PXED" serve --data-dir "$W/data-b" --ipxe-dir "$here/ipxe/bin" \
    --interface pxb0 --dhcp full --pool 10.98.0.100-10.98.0.199 --netmask 255.255.255.0 \
    --router "$SERVER" --server-ip "$SERVER_B" --http "$SERVER_B:80" --tftp "$SERVER_B:69" \
    > "$W/pxed-b.log" 2>&1 &
  PXED_B_PID=$!
  for _ in $(seq 1 50); do ip netns exec "$NS" curl -sf "http://$SERVER_B/healthz" >/dev/null && break; sleep 0.2; done
  ip netns exec "$NS" curl -sf "http://$SERVER_B/healthz" >/dev/null || { tail -20 "$W/pxed-b.log"; say "instance B did not come up"; exit 1; }
  say "fault failover: instance A at $SERVER (pid $PXED_PID), B at $SERVER_B (pid $PXED_B_PID), one database"
fi

MACS=() UUIDS=()
vms_json=
for i in $(seq 1 "$VMS"); do
  MACS+=("52:54:00:98:01:$(printf '%02x' "$i")")
  UUIDS+=("98989898-0001-4000-8000-0000000000$(printf '%02x' "$i")")
  [ -n "$vms_json" ] && vms_json+=","
  vms_json+="{\"name\":\"vm$i\",\"uuid\":\"${UUIDS[-1]}\",\"mac\":\"${MACS[-1]}\",\"firmware\":\"$FIRMWARE\",
    \"disk\":\"$W/vm$i.qcow2\",\"disk_size\":\"3G\",\"tap\":\"pxtap$i\",\"memory\":1024,
    \"console\":\"$W/vm$i.console.log\", \"extra_args_file\":\"$W/vm$i.extra.json\"}"
done
start_controller() { # PXE-OVERRIDE-MODE (once | ignored)
  cat > "$W/lab.json" <<JSON
{"name": "pxlab", "state_dir": "$W/state", "netns": "$NS",
 "redfish": {"host": "127.0.0.1", "port": 8000, "user": "admin", "password": "password"},
 "notify": {"host": "127.0.0.1", "port": 9999}, "pxe_override": "$1",
 "vms": [$vms_json]}
JSON
  rm -f "$W/state/ready"
  python3 "$here/lab/controller.py" start --lab "$W/lab.json" >> "$W/controller.log" 2>&1 &
  CTL_PID=$!
  for _ in $(seq 1 150); do [ -f "$W/state/ready" ] && break; sleep 0.2; done
  [ -f "$W/state/ready" ] || { tail -20 "$W/controller.log"; say "lab controller did not come up"; exit 1; }
}
if [ "$FAULT" = nooverride ]; then
  # A node that ran before: an OS on its disk for the ignored override to boot (with an
  # empty disk the firmware would fall through to the network and boot pxed anyway).
  zstd -q -dc "$CACHE/debian-12-amd64.raw.zst" > "$W/vm1.raw"
  qemu-img convert -q -f raw -O qcow2 "$W/vm1.raw" "$W/vm1.qcow2" && rm -f "$W/vm1.raw"
  qemu-img resize -q "$W/vm1.qcow2" 3G
  say "fault nooverride: vm1's disk holds debian-12; the BMC accepts the Pxe override but the VM boots its disk"
  start_controller ignored
else
  start_controller once
fi
BMC_URL=http://127.0.0.1:8000
if [ "$FAULT" = lyingbmc ]; then
  # The lying BMC: the fault proxy in front of sushy, in the namespace.
  ip netns exec "$NS" python3 "$here/tests/peers/bmc_fault_proxy.py" --upstream "$BMC_URL" \
    --faults lie-unless-mode > "$W/proxy.out" 2> "$W/proxy.log" &
  PROXY_PID=$!
  for _ in $(seq 1 50); do grep -q '^PORT ' "$W/proxy.out" 2>/dev/null && break; sleep 0.2; done
  BMC_URL="http://127.0.0.1:$(sed -n 's/^PORT //p' "$W/proxy.out")"
  say "fault lyingbmc: nodes' BMC is the lying proxy at $BMC_URL"
fi
api() { # METHOD PATH [JSON] [IDEMPOTENCY-KEY]
  local a=(-sS -X "$1" -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json')
  [ -n "${3:-}" ] && a+=(-d "$3")
  [ -n "${4:-}" ] && a+=(-H "Idempotency-Key: $4")
  ip netns exec "$NS" curl "${a[@]}" "http://$API_IP/api/v1$2"
}
for _ in $(seq 1 50); do ip netns exec "$NS" curl -sf "http://$SERVER/healthz" >/dev/null && break; sleep 0.2; done
ip netns exec "$NS" curl -sf "http://$SERVER/healthz" >/dev/null || { tail -20 "$W/pxed.log"; say "pxed did not come up"; exit 1; }
say "pxed, sushy-tools and the lab controller are up in netns $NS"

# ---- 4. register, allocate, reinstall
IDS=()
for i in $(seq 1 "$VMS"); do
  body=$(printf '{"name":"vm%s","arch":"x86_64","macs":["%s"],"bmc":{"driver":"redfish","address":"%s","username":"admin","password":"password","system_id":"%s"}}' \
    "$i" "${MACS[$((i-1))]}" "$BMC_URL" "${UUIDS[$((i-1))]}")
  id=$(api POST /nodes "$body" | python3 -c 'import sys,json; print(json.load(sys.stdin)["id"])')
  api POST "/nodes/$id/actions/allocate" >/dev/null
  IDS+=("$id")
done

field() { python3 -c 'import sys,json; d=json.load(sys.stdin); print(d.get(sys.argv[1]) if d.get(sys.argv[1]) is not None else "")' "$1"; }

timeline() { # ID GENERATION: the node's events of that generation, with seconds since the first
  api GET "/nodes/$1" | python3 -c '
import sys, json, datetime
d = json.load(sys.stdin); gen = int(sys.argv[1])
ev = [e for e in d["events"] if e["generation"] == gen]
t = lambda s: datetime.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
t0 = t(ev[0]["at"]) if ev else 0
for e in ev:
    print("    %7.1fs  %-22s %-12s -> %-12s %s" % (t(e["at"]) - t0, e["event"], e["from_state"] or "", e["to_state"], e["detail"] or ""))
' "$2"
}

diagnose() { # ID VM-INDEX
  local i=$2
  say "node $1 (vm$i): console tail"; tail -c 3000 "$W/vm$i.console.log" 2>/dev/null | tr -d '\r' | tail -n 25 | sed 's/^/    /'
  say "node $1: pxed log lines for ${MACS[$((i-1))]} / node=$1"
  grep -E "${MACS[$((i-1))]}|node=$1[^0-9]" "$W/pxed.log" | tail -n 25 | sed 's/^/    /'
}

redfish() { # METHOD PATH [JSON]: the lab's BMC, as an operator or a fault would use it
  ip netns exec "$NS" curl -sS -o /dev/null -w '%{http_code}' -u admin:password -X "$1" \
    -H 'Content-Type: application/json' ${3:+-d "$3"} "http://127.0.0.1:8000/redfish/v1$2"
}
# What the current fault expects of this generation: ok (available), fail-install, fail-netboot.
expect() {
  [ -n "$INSTALLER" ] && { echo installer; return; }
  case "$FAULT" in
    checksum|notfound) echo fail-install ;;
    nooverride) echo fail-netboot ;;
    lostdevice) [ "$1" = 2 ] && echo quarantine || echo ok ;;
    *) echo ok ;;
  esac
}
# The lostdevice fault's hardware for generation $1 (QEMU arguments as JSON).
hardware() {
  local port='"-device", "pcie-root-port,id=rp9,bus=pcie.0,chassis=9,addr=0x9,x-speed=16,x-width=WIDTH"'
  local card='"-device", "virtio-rng-pci,bus=rp9"'
  local port2='"-device", "pcie-root-port,id=rp10,bus=pcie.0,chassis=10,addr=0xa"'
  local card2='"-device", "virtio-rng-pci,bus=rp10"'
  case "$1" in
    1) echo "[${port/WIDTH/16}, $card, $port2, $card2]" ;;
    *) echo "[${port/WIDTH/4}, $card]" ;;
  esac
}
for gen in $(seq 1 "$REINSTALLS"); do
  if [ "$FAULT" = lostdevice ]; then
    for i in $(seq 1 "$VMS"); do hardware "$gen" > "$W/vm$i.extra.json"; done
    say "fault lostdevice: generation $gen hardware: $(cat "$W/vm1.extra.json")"
  fi
  for i in $(seq 1 "$VMS"); do
    id=${IDS[$((i-1))]}
    key="lab-reclaim-$id-$gen"
    out=$(api POST "/nodes/$id/reinstall" "{\"image\":\"$IMAGE\"}" "$key")
    again=$(api POST "/nodes/$id/reinstall" "{\"image\":\"$IMAGE\"}" "$key")
    [ "$out" = "$again" ] || { say "idempotent replay differs: $out vs $again"; FAILED=$((FAILED+1)); }
    say "node $id (vm$i): reinstall generation $(echo "$out" | field generation) requested"
  done
  for i in $(seq 1 "$VMS"); do
    id=${IDS[$((i-1))]}
    start=$(date +%s) last='' cut=''
    while :; do
      n=$(api GET "/nodes/$id")
      st=$(echo "$n" | field state)
      [ "$st" != "$last" ] && say "node $id: $st" && last=$st
      if [ "$FAULT" = poweroff ] && [ -z "$cut" ] && echo "$n" | grep -q '% written'; then
        cut=1
        say "fault poweroff: Redfish ForceOff while the image is written -> $(redfish POST \
          "/Systems/${UUIDS[$((i-1))]}/Actions/ComputerSystem.Reset" '{"ResetType":"ForceOff"}')"
      fi
      if [ "$FAULT" = failover ] && [ -z "$cut" ] && echo "$n" | grep -q '% written'; then
        cut=1
        # The claim's holder is `host:pid:random`.
        owner=$("$PG_BIN/psql" -X -At "$PXED_DATABASE_URL" -c "SELECT owner FROM node_owners WHERE node_id = $id")
        pid=$(echo "$owner" | cut -d: -f2)
        case "$pid" in
          "$PXED_PID") VICTIM=A SURVIVOR_LOG=$W/pxed-b.log API_IP=$SERVER_B PXED_PID='' ;;
          "$PXED_B_PID") VICTIM=B SURVIVOR_LOG=$W/pxed.log PXED_B_PID='' ;;
          *) say "FAIL fault failover: node $id is held by '$owner', neither instance"; FAILED=$((FAILED+1)); break ;;
        esac
        kill -9 "$pid"
        say "fault failover: instance $VICTIM (pid $pid), which holds node $id, killed with SIGKILL while the image is written"
      fi
      case "$st" in available|failed|quarantined) break ;; esac
      if [ $(( $(date +%s) - start )) -gt "${LAB_NODE_TIMEOUT:-1500}" ]; then say "node $id: timed out in $st"; break; fi
      sleep 2
    done
    took=$(( $(date +%s) - start ))
    timeline "$id" "$gen"
    if [ -n "${LAB_TIMELINE_OUT:-}" ]; then
      api GET "/nodes/$id" | python3 -c 'import sys, json
d = json.load(sys.stdin); g = int(sys.argv[1])
json.dump([e for e in d["events"] if e["generation"] == g], open(sys.argv[2], "w"))' "$gen" "$LAB_TIMELINE_OUT"
    fi
    host=$(echo "$n" | field hostname)
    want="node-$(echo "${MACS[$((i-1))]}" | tr -d ':' | cut -c7-12)"
    reason=$(echo "$n" | field failed_reason) step=$(echo "$n" | field failed_step)
    installed=$(echo "$n" | python3 -c 'import sys, json
d = json.load(sys.stdin); g = int(sys.argv[1])
print(sum(1 for e in d["events"] if e["generation"] == g and e["event"] == "install_finished"))' "$gen")
    # The deploy agent's inventory of this generation, and how long collecting it took.
    inv=$(echo "$n" | python3 -c 'import sys, json
d = json.load(sys.stdin); g = int(sys.argv[1])
print(next((e["detail"] for e in d["events"] if e["generation"] == g and e["event"] == "inventory"), ""))' "$gen")
    [ -n "$inv" ] && say "node $id generation $gen inventory: $inv"
    case "$(expect "$gen")" in
      quarantine)
        # The gate must have quarantined it, naming what changed; accepting the new
        # inventory (re-baseline) must return it to available.
        # Generation 2: 09.0's link narrowed, 0a.0 and the card behind it (bus 02) gone.
        lost=1
        for want in 'pci 0000:00:09.0 \(.*\) max link changed: 16 GT/s x16 -> 16 GT/s x4' \
                    'pci 0000:00:0a.0 removed' 'pci 0000:02:00.0 removed \(was \[1af4:1044\]\)'; do
          echo "$reason" | grep -Eq "^inventory: .*$want" || lost=''
        done
        if [ "$st" = quarantined ] && [ -n "$lost" ]; then
          PASSES=$((PASSES+1)); say "PASS fault lostdevice generation $gen: quarantined in ${took}s: $reason"
          acc=$(api POST "/nodes/$id/inventory/accept" '{}')
          now=$(api GET "/nodes/$id" | field state)
          if [ "$now" = available ]; then
            PASSES=$((PASSES+1)); say "PASS fault lostdevice generation $gen: re-baselined, available: $(echo "$acc" | field changes_accepted | head -c 300)"
          else say "FAIL fault lostdevice generation $gen: after accept the node is $now: $acc"; FAILED=$((FAILED+1)); fi
        else
          say "FAIL fault lostdevice generation $gen: node $id is $st ($step: $reason)"
          FAILED=$((FAILED+1)); diagnose "$id" "$i"
          api GET "/nodes/$id/inventory" | head -c 3000; echo
        fi
        continue ;;
      installer)
        # The installer's own log, as pxed's syslog receiver kept it, must show the
        # preseed loaded and the MAC-derived hostname preseeded; the node must fail at
        # installing with a line of that log, within two minutes of it.
        verdict=$(api GET "/nodes/$id/log" | python3 -c '
import sys, json, datetime
log = json.load(sys.stdin)["lines"]; n = json.loads(sys.argv[1]); host, gen = sys.argv[2], int(sys.argv[3])
t = lambda s: datetime.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
ev = [e for e in n["events"] if e["generation"] == gen]
names = [e["event"] for e in ev]
problems = []
if n["state"] != "failed" or n.get("failed_step") != "installing":
    problems.append("node is %s at %s" % (n["state"], n.get("failed_step")))
if not any("preseed: successfully loaded preseed file" in l["line"] for l in log):
    problems.append("no preseed-loaded line in the installer log")
if not any(l["line"].endswith("SET netcfg/hostname " + host) for l in log):
    problems.append("hostname %s not seen preseeded" % host)
for m in ("installer_kernel_booted", "installer_config_loaded", "install_failed"):
    if m not in names:
        problems.append("no %s on the timeline" % m)
reason = (n.get("failed_reason") or "").split(": ", 1)[-1]
said = [l for l in log if l["line"] == reason]
failed = [e for e in ev if e["event"] == "install_failed"]
if not said:
    problems.append("the reason is not a line of the installer log: " + reason)
elif failed:
    lag = t(failed[-1]["at"]) - t(said[-1]["at"])
    if lag > 120:
        problems.append("failed %.0f s after the installer said so" % lag)
    else:
        print("ok %.1f" % lag); sys.exit()
print("; ".join(problems))' "$n" "$want" "$gen")
        if [ "${verdict%% *}" = ok ]; then
          PASSES=$((PASSES+1))
          say "PASS installer: preseed loaded, $want preseeded, failed at installing ${verdict#ok }s after the installer's error: $reason"
        else say "FAIL installer: $verdict"; FAILED=$((FAILED+1)); diagnose "$id" "$i"; fi
        continue ;;
      fail-install)
        if [ "$st" = failed ] && [ "$step" = installing ]; then
          PASSES=$((PASSES+1)); say "PASS fault $FAULT: node $id failed at installing in ${took}s: $reason"
        else say "FAIL fault $FAULT: node $id is $st ($step: $reason)"; FAILED=$((FAILED+1)); diagnose "$id" "$i"; fi
        continue ;;
      fail-netboot)
        if [ "$st" = failed ] && [ "$step" = netbooting ] && [ "$installed" = 0 ] \
           && echo "$reason" | grep -q "^netboot_not_observed:.*tried: standard, uefi_override, off_on"; then
          PASSES=$((PASSES+1)); say "PASS fault $FAULT: node $id never reported reinstalled; failed in ${took}s: $reason"
        else say "FAIL fault $FAULT: node $id is $st ($step: $reason), installed $installed times"
          FAILED=$((FAILED+1)); diagnose "$id" "$i"; fi
        continue ;;
    esac
    if [ "$FAULT" = poweroff ]; then
      retried=$(echo "$n" | python3 -c 'import sys, json
d = json.load(sys.stdin); g = int(sys.argv[1])
print(sum(1 for e in d["events"] if e["generation"] == g and e["event"] == "deadline_expired"))' "$gen")
      if [ -z "$cut" ] || [ "$retried" = 0 ]; then
        say "FAIL fault poweroff: power cut $([ -n "$cut" ] && echo sent || echo never sent), $retried retries"
        FAILED=$((FAILED+1))
      fi
    fi
    if [ "$FAULT" = failover ]; then
      retried=$(echo "$n" | python3 -c 'import sys, json
d = json.load(sys.stdin); g = int(sys.argv[1])
print(sum(1 for e in d["events"] if e["generation"] == g and e["event"] == "deadline_expired"))' "$gen")
      if [ -n "$cut" ] && grep -q "took over nodes" "${SURVIVOR_LOG:-/dev/null}"; then
        say "fault failover: the survivor took node $id over ($retried retries at a deadline)"
      else
        say "FAIL fault failover: $([ -n "$cut" ] && echo "instance $VICTIM killed" || echo "nothing killed"), no takeover in the survivor's log"
        FAILED=$((FAILED+1))
      fi
    fi
    if [ "$FAULT" = lyingbmc ]; then
      # Generation 1: caught within the window, recovered by uefi_override; 2: starts with it.
      verdict=$(echo "$n" | python3 -c 'import sys, json, datetime
d = json.load(sys.stdin); g = int(sys.argv[1]); window = float(sys.argv[2])
t = lambda s: datetime.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
ev = [e for e in d["events"] if e["generation"] == g]
missed = [e for e in ev if e["event"] == "netboot_not_observed"]
cycles = [e for e in ev if e["event"] == "power_cycled"]
rec = [e["detail"] for e in ev if e["event"] == "netboot_method_recorded"]
if g == 1:
    if len(missed) != 1 or "method standard" not in missed[0]["detail"]:
        print("want one netboot_not_observed of method standard, got %s" % [e["detail"] for e in missed]); sys.exit()
    lag = t(missed[0]["at"]) - t(cycles[0]["at"])
    if not window - 0.1 <= lag <= window + 5:
        print("caught %.1f s after the power cycle (window %.0f s)" % (lag, window)); sys.exit()
    if not rec or not rec[0].startswith("uefi_override made it netboot"):
        print("method not recorded: %s" % rec); sys.exit()
    print("ok caught %.1f s after the power cycle, recovered by uefi_override" % lag)
else:
    if missed or not rec or not rec[0].startswith("uefi_override"):
        print("the recorded method was not tried first: missed %d, recorded %s" % (len(missed), rec)); sys.exit()
    print("ok started with uefi_override, nothing missed")' "$gen" "${PXED_LIFECYCLE__NETBOOT_OBSERVE%s}")
      if [ "${verdict%% *}" = ok ]; then PASSES=$((PASSES+1)); say "PASS fault lyingbmc generation $gen: ${verdict#ok }"
      else say "FAIL fault lyingbmc generation $gen: $verdict"; FAILED=$((FAILED+1)); fi
    fi
    # The stages must have happened in this order, each exactly where expected.
    order=$(echo "$n" | python3 -c 'import sys, json
d = json.load(sys.stdin); g = int(sys.argv[1])
want = ["reinstall_requested", "netboot_set", "power_cycled", "installer_served", "deploy_started",
        "deploy_wipe", "deploy_verify", "install_finished", "first_boot_reported", "health_passed"]
seen = [e["event"] for e in d["events"] if e["generation"] == g]
pos, last = [], -1
for w in want:
    idx = [i for i, e in enumerate(seen) if e == w and i > last]
    if not idx:
        print("missing or out of order: " + w); sys.exit()
    last = idx[0]
print("ok")' "$gen")
    if [ "$st" = available ] && [ "$order" != ok ]; then
      say "FAIL node $id generation $gen: stage timeline $order"; FAILED=$((FAILED+1))
    fi
    # Stages from the wire (GET /nodes/{id}/stages): every one present, in this order,
    # at non-decreasing times, files with their bytes; earlier generations summarised.
    wire=$(api GET "/nodes/$id/stages" | python3 -c 'import sys, json
v = json.load(sys.stdin); g = int(sys.argv[1])
want = ["reinstall", "power", "dhcp_discover", "lease", "first_stage", "ipxe_dhcp", "script",
        "kernel", "initrd", "deploy_started", "installed", "first_boot", "health", "available"]
st = v["stages"]; names = [s["stage"] for s in st]
if v["generation"] != g:
    print("stages of generation %s, not %s" % (v["generation"], g)); sys.exit()
missing = [w for w in want if w not in names]
if missing:
    print("missing: " + " ".join(missing) + " (have: " + " ".join(names) + ")"); sys.exit()
pos = [names.index(w) for w in want]
if pos != sorted(pos):
    print("out of order: " + " ".join(names)); sys.exit()
ats = [s["at"] for s in st]
if ats != sorted(ats):
    print("times not ordered"); sys.exit()
for f in ("first_stage", "kernel", "initrd"):
    if not st[names.index(f)].get("bytes"):
        print("no bytes for " + f); sys.exit()
if g > 1 and not any(p["generation"] == g - 1 and p.get("total_ms") for p in v["previous"]):
    print("generation %d not summarised" % (g - 1)); sys.exit()
print("ok " + " ".join("%s+%.1fs" % (s["stage"], (s.get("lasted_ms") or 0) / 1000) for s in st))' "$gen")
    if [ "$st" = available ]; then
      if [ "${wire%% *}" = ok ]; then say "node $id generation $gen stages: ${wire#ok }"
      else say "FAIL node $id generation $gen: stages from the wire: $wire"; FAILED=$((FAILED+1)); fi
    fi
    if [ "$st" = available ] && [ "$host" = "$want" ] && [ "$order" = ok ]; then
      PASSES=$((PASSES+1)); say "PASS node $id generation $gen: available in ${took}s as $host"
    else
      say "FAIL node $id generation $gen: $st, hostname '$host' (want $want): $(echo "$n" | field failed_reason)"
      FAILED=$((FAILED+1)); diagnose "$id" "$i"
    fi
  done
  case "$FAULT" in checksum|notfound|poweroff) break ;; esac
done
if [ "$FAILED" = 0 ]; then say "lab passed"; else say "lab FAILED"; fi
echo "lab: $PASSES passed, $FAILED failed"
[ "$FAILED" = 0 ]
