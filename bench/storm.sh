#!/usr/bin/env bash
# Boot storm: N simulated nodes (bench/storm.rs) against a real pxed, and the same
# storm's DHCP + TFTP + HTTP parts against dnsmasq (DHCP + TFTP) + nginx (HTTP).
#
#   pxed:    N nodes registered (each with its own BMC: a Redfish double in the
#            simulator), allocated, then every reinstall called through the API at
#            t=0; each node boots when its BMC powers it on with a one-time network
#            boot: DHCP (x86-64 UEFI) -> TFTP snponly.efi (tsize, blksize 1468,
#            windowsize 4) -> DHCP as iPXE -> HTTP script -> kernel -> initrd ->
#            kickstart + `installed` -> DHCP (installed OS) -> first-boot + health,
#            until pxed answers `available`.
#   dnsmasq: the same N nodes power on at t=0 (no lifecycle, no pacing) and run
#            DHCP -> TFTP -> DHCP as iPXE -> a static script from nginx -> kernel ->
#            initrd, the same files.
#   pxed-boot: the same as dnsmasq's, against pxed (the nodes are not reinstalling, so
#            their script boots the disk; they fetch the same kernel and initrd).
#
# Each server runs in its own netns pair: server 10.77.0.1/16 <-> client 10.77.0.2/16
# over one veth; the client side has a `local` route for the pool (10.77.128.0/17), so
# each node speaks from the address it leased.
#
# Usage: bench/storm.sh [nodes...]            (root; default 1000)
# Env:   SERVERS="pxed dnsmasq pxed-boot"  which runs, in order (default "pxed")
#        KERNEL_MB=10 INITRD_MB=60           file sizes
#        WAVE_SIZE=250 WAVE_INTERVAL=2       pxed's power-on waves ([pacing])
#        MAX_FIRST_STAGE=64 MAX_STREAMS=128  pxed's transfer slots ([pacing])
#        MAX_BOOTING=1024                    pxed's booting places ([pacing] max_booting; 0: off)
#        FLOOR_STREAMS=64 FLOOR_PAIRS=200    the floor measurement
#        BMC_NET=10.77.64.0                  node i's BMC at this address + i (inside
#                                            10.77.64.0/18, which the client side routes to
#                                            itself); empty: every BMC at the client's one address
#        BMC_POLL=250ms                      pxed's power-state polls ([bmc] poll_interval; its default 2s)
#        NEIGH=1                             raise the server netns' ARP table limits
#        PXED_BIN=/path/to/pxed              run that build (default: cargo build --release);
#                                            an A/B of two builds on one machine
#        PXED_LOG=warn                       pxed's log filter (e.g. "warn,sqlx::query=debug"
#                                            logs every statement; the log is copied to
#                                            /tmp/storm-pxed-N-MODE.log)
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=("$@")
[ ${#NODES[@]} -gt 0 ] || NODES=(1000)
for n in "${NODES[@]}"; do
  if ! [ "$n" -ge 1 ] 2>/dev/null || [ "$n" -gt 16384 ]; then
    echo "nodes: 1..16384 (BMCs at 10.77.64.0/18), not $n" >&2; exit 1
  fi
done
SERVERS=${SERVERS:-pxed}
BMC_NET=${BMC_NET-10.77.64.0}
KERNEL_MB=${KERNEL_MB:-10} INITRD_MB=${INITRD_MB:-60}
for tool in ip dnsmasq nginx python3; do
  command -v "$tool" >/dev/null || case " $SERVERS " in
    *" dnsmasq "*) echo "missing $tool (apt-get install iproute2 dnsmasq-base nginx-light)" >&2; exit 1 ;;
    *) [ "$tool" = ip ] && { echo "missing ip" >&2; exit 1; } ;;
  esac
done
[ -n "${PXED_BIN:-}" ] || cargo build --release --bin pxed >&2
built=$(cargo bench --bench storm --no-run 2>&1) || { echo "$built" | tail -n 30 >&2; echo "could not build bench/storm.rs" >&2; exit 1; }
SIM=$(echo "$built" | sed -n 's/.*Executable .*(\(.*\)).*/\1/p' | tail -1)
[ -x "$SIM" ] || { echo "$built" | tail -n 30 >&2; echo "could not find bench/storm.rs's executable" >&2; exit 1; }
PXED=${PXED_BIN:-$PWD/target/release/pxed}
ulimit -n "$(ulimit -Hn)"

tag=$$
work=$(mktemp -d -p /var/tmp pxed-storm.XXXXXX)
chmod 755 "$work" # nginx's workers and dnsmasq drop root and read from here
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for ns in pxss-$tag pxsc-$tag; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
S=pxss-$tag C=pxsc-$tag

pair() {
  ip netns del "$S" 2>/dev/null || true; ip netns del "$C" 2>/dev/null || true
  ip netns add "$S"; ip netns add "$C"
  ip link add s0 netns "$S" type veth peer name c0 netns "$C"
  ip -n "$S" addr add 10.77.0.1/16 dev s0; ip -n "$S" link set s0 up; ip -n "$S" link set lo up
  ip -n "$C" addr add 10.77.0.2/16 dev c0; ip -n "$C" link set c0 up; ip -n "$C" link set lo up
  ip -n "$C" route add local 10.77.128.0/17 dev lo
  # Node i's BMC (the simulator's Redfish double) answers at 10.77.64.0 + i.
  ip -n "$C" route add local 10.77.64.0/18 dev lo
  if [ "${NEIGH:-1}" = 1 ]; then
    # The server answers every node by unicast: one ARP entry per node. Linux's
    # defaults (gc_thresh3 = 1024) overflow past ~1,000 nodes on one L2 segment.
    for k in 1 2 3; do
      ip netns exec "$S" sysctl -qw "net.ipv4.neigh.default.gc_thresh$k=$((k * 32768))" 2>/dev/null ||
        sysctl -qw "net.ipv4.neigh.default.gc_thresh$k=$((k * 32768))"
    done
  fi
}

wait_tcp() { # NS ADDR PORT
  for _ in $(seq 200); do
    ip netns exec "$1" bash -c "exec 3<>/dev/tcp/$2/$3" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "nothing listens on $2:$3 in $1" >&2; return 1
}

# The files every node fetches.
mkdir -p "$work/mirror/repo" "$work/www/images/storm/x86_64"
head -c $((KERNEL_MB << 20)) /dev/urandom >"$work/mirror/kernel"
head -c $((INITRD_MB << 20)) /dev/urandom >"$work/mirror/initrd"
cp "$work/mirror/kernel" "$work/mirror/initrd" "$work/www/images/storm/x86_64/"
cat >"$work/storm.toml" <<TOML
name = "storm"
description = "boot storm: a ${KERNEL_MB} MiB kernel and a ${INITRD_MB} MiB initrd"
family = "kickstart"
[arches.x86_64]
kernel = "kernel"
initrd = "initrd"
cmdline = "ip=dhcp inst.text"
repo = "repo/"
TOML

pxed_env() {
  # The import reads the files from the mirror directory; the installers' repo URL (in
  # the kickstart, which no simulated installer follows) must be http.
  echo PXED_API_TOKEN=storm-token PXED_MIRROR_BASE="${1:-http://10.77.0.1/mirror/}" \
    PXED_IMAGES_DIR="$work/images" PXED_LOG="${PXED_LOG:-warn}" \
    PXED_PACING__POWER_ON_WAVE_SIZE="${WAVE_SIZE:-250}" \
    PXED_PACING__POWER_ON_WAVE_INTERVAL_SECS="${WAVE_INTERVAL:-2}" \
    PXED_PACING__MAX_FIRST_STAGE="${MAX_FIRST_STAGE:-64}" \
    PXED_PACING__MAX_STREAMS="${MAX_STREAMS:-128}" \
    PXED_PACING__MAX_BOOTING="${MAX_BOOTING:-1024}" \
    PXED_BMC__POLL_INTERVAL="${BMC_POLL:-250ms}"
}

# run_pxed N MODE
run_pxed() {
  local n=$1 mode=$2
  pair
  rm -rf "$work/data" "$work/images"
  # shellcheck disable=SC2046
  env $(pxed_env "file://$work/mirror/") "$PXED" image add "$work/storm.toml" --no-check --arch x86_64 \
    --data-dir "$work/data" >/dev/null
  # shellcheck disable=SC2046
  ip netns exec "$S" env $(pxed_env) bash -c "ulimit -n \$(ulimit -Hn); exec \"\$0\" \"\$@\"" "$PXED" serve \
    --dhcp full --interface s0 --pool 10.77.128.10-10.77.255.250 --netmask 255.255.0.0 \
    --lease-time 1h --server-ip 10.77.0.1 --data-dir "$work/data" --ipxe-dir "$PWD/ipxe/bin" \
    --http 10.77.0.1:80 --tftp 10.77.0.1:69 2>"$work/pxed-$n-$mode.log" &
  local pid=$!
  pids+=("$pid")
  wait_tcp "$S" 10.77.0.1 80 || { cat "$work/pxed-$n-$mode.log" >&2; exit 1; }
  sleep 0.5
  local sim_mode=pxed
  [ "$mode" = pxed-boot ] && sim_mode=boot
  echo "== $mode: $n nodes" >&2
  ip netns exec "$C" "$SIM" --mode "$sim_mode" --nodes "$n" --server 10.77.0.1 --local 10.77.0.2 \
    ${BMC_NET:+--bmc-net "$BMC_NET"} --token storm-token --server-pid "$pid" --floor-streams "${FLOOR_STREAMS:-64}" \
    --floor-pairs "${FLOOR_PAIRS:-200}" --api-parallel "${API_PARALLEL:-64}" | sed "s/^RESULT /RESULT server=$mode /"
  if [ "$sim_mode" = pxed ]; then
    grep -E '^pxed_(power_on|dhcp_offers_held|first_stage|streams|http_sendfile|tftp|store_commits|store_writes|store_write|http_connections)[a-z_]* ' \
      <(ip netns exec "$C" curl -sS http://10.77.0.1/metrics) | sed 's/^/  /' || true
  fi
  kill "$pid"; wait "$pid" 2>/dev/null || true
  cp "$work/pxed-$n-$mode.log" "/tmp/storm-pxed-$n-$mode.log"
  echo "pxed log lines with ERROR or panic: $(grep -ciE ' error |panic' "$work/pxed-$n-$mode.log" || true)"
}

run_dnsmasq() {
  local n=$1
  pair
  mkdir -p "$work/tftp" "$work/nginx"
  cp "$PWD/ipxe/bin/snponly.efi" "$work/tftp/"
  printf '#!ipxe\nkernel http://10.77.0.1/images/storm/x86_64/kernel ip=dhcp\ninitrd http://10.77.0.1/images/storm/x86_64/initrd\nboot\n' \
    >"$work/www/boot.ipxe"
  cat >"$work/nginx/nginx.conf" <<NGX
worker_processes auto;
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log warn;
events { worker_connections 65536; }
worker_rlimit_nofile 1048576;
http {
  access_log off;
  sendfile on; tcp_nopush on;
  types { application/octet-stream bin; }
  default_type application/octet-stream;
  server { listen 10.77.0.1:80 backlog=4096; root $work/www; }
}
NGX
  ip netns exec "$S" nginx -c "$work/nginx/nginx.conf" -g 'daemon off;' &
  local npid=$!
  pids+=("$npid")
  ip netns exec "$S" dnsmasq --keep-in-foreground --no-resolv --port=0 --interface=s0 \
    --bind-interfaces --dhcp-authoritative --dhcp-lease-max=200000 --no-ping \
    --dhcp-range=10.77.128.10,10.77.255.250,255.255.0.0,1h --leasefile-ro \
    --log-facility="$work/dnsmasq.log" \
    --dhcp-userclass=set:ipxe,iPXE --dhcp-boot=tag:!ipxe,snponly.efi \
    --dhcp-boot=tag:ipxe,http://10.77.0.1/boot.ipxe \
    --enable-tftp --tftp-root="$work/tftp" --tftp-max=65535 --pid-file="$work/dnsmasq.pid" &
  local dpid=$!
  pids+=("$dpid")
  wait_tcp "$S" 10.77.0.1 80
  sleep 0.5
  local server_pids=(--server-pid "$dpid")
  for p in $(pgrep -f "nginx.*$work/nginx"); do server_pids+=(--server-pid "$p"); done
  echo "== dnsmasq + nginx: $n nodes" >&2
  ip netns exec "$C" "$SIM" --mode boot --nodes "$n" --server 10.77.0.1 --local 10.77.0.2 \
    "${server_pids[@]}" --floor-streams "${FLOOR_STREAMS:-64}" --floor-pairs "${FLOOR_PAIRS:-200}" |
    sed "s/^RESULT /RESULT server=dnsmasq+nginx /"
  kill "$npid" "$dpid"; wait "$npid" "$dpid" 2>/dev/null || true
  cp "$work/dnsmasq.log" "/tmp/storm-dnsmasq-$n.log" 2>/dev/null || true
}

for n in "${NODES[@]}"; do
  for s in $SERVERS; do
    case $s in
      pxed) run_pxed "$n" pxed ;;
      pxed-boot) run_pxed "$n" pxed-boot ;;
      dnsmasq) run_dnsmasq "$n" ;;
      *) echo "unknown server $s" >&2; exit 2 ;;
    esac
  done
done
