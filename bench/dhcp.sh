#!/usr/bin/env bash
# DHCP throughput: perfdhcp (package kea-admin) against pxed (full mode, durable leases:
# SQLite WAL, synchronous=FULL, ACK only after commit) and against dnsmasq
# (--leasefile-ro --no-ping: its leases are then NOT durable, it keeps them only in
# memory; without --leasefile-ro it rewrites its lease file per ACK and tops out near
# 170 leases/s). Each server runs in its own netns pair, 10.98.0.0/16 over a veth.
#
# For each server the offered rate steps up; the figure reported is the highest
# achieved rate (4-way DORA exchanges/s) whose drop ratio stayed at or below 1%.
# Leases accumulate over the ladder (perfdhcp draws clients from RANGE MACs), as they
# do on a real network; dnsmasq's rate falls as its lease list grows, pxed's does not.
#
# Kea (kea-dhcp4-server) runs too, with two threads and memfile persist=true, the
# setup its documentation gives for throughput.
#
# `pxedpg` is pxed with its store on PostgreSQL (Debian's server, a private cluster on
# this machine's disk, synchronous_commit=on, a Unix socket; `pxed migrate` first):
# the same durable ACKs, each batch of leases one PostgreSQL transaction.
#
# `pxedpg2` is two pxed on one PostgreSQL database, both on one bridge with the load
# generator (each DISCOVER reaches both; the client takes the first offer): every
# lease is decided by the database at commit, and each instance's lease table follows
# the other's commits (LISTEN/NOTIFY). The machine's two cores now run two servers,
# PostgreSQL and perfdhcp.
#
# Usage: bench/dhcp.sh [rates...]   (root; builds pxed in release mode)
# Env:   PERIOD=seconds per step (default 10), RANGE=distinct clients (default 50000),
#        SERVERS="pxed kea dnsmasq" (which to run, in order; also pxedpg, pxedpg2),
#        KEA_QUEUE=Kea's packet-queue-size (default 64, Kea's own default)
set -euo pipefail
cd "$(dirname "$0")/.."
RATES=("$@")
# Fine steps near dnsmasq's limit (a coarse ladder would report its last step below
# the limit, not the limit), coarser ones up to pxed's.
[ ${#RATES[@]} -gt 0 ] || RATES=(600 800 1000 1100 1200 1300 1400 1500 1600 1700 1800 2000
                                 4000 6000 8000 8500 9000 9500 10000 10500 11000 12000)
PERIOD=${PERIOD:-10}
RANGE=${RANGE:-50000}
SERVERS=${SERVERS:-pxed kea dnsmasq}
for tool in /usr/sbin/perfdhcp dnsmasq kea-dhcp4 ip; do
  command -v "$tool" >/dev/null || { echo "missing $tool (apt-get install kea-admin kea-dhcp4-server dnsmasq-base iproute2)" >&2; exit 1; }
done
cargo build --release --bin pxed >&2
PXED=$PWD/target/release/pxed

tag=$$
work=$(mktemp -d -p /var/tmp pxed-bench.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for ns in pxbs-$tag-{p,k,d,q,r,s} pxbc-$tag-{p,k,d,q,r} pxbb-$tag; do ip netns del "$ns" 2>/dev/null || true; done
  if [ -d "$work/pg" ]; then .ci/pg-start --stop "$work/pg" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# netns pair: server pv0 10.98.0.1/16 <-> client eth0 10.98.0.2/16
pair() {
  local s=pxbs-$tag-$1 c=pxbc-$tag-$1
  ip netns add "$s"; ip netns add "$c"
  ip link add pv0 netns "$s" type veth peer name eth0 netns "$c"
  ip -n "$s" addr add 10.98.0.1/16 dev pv0; ip -n "$s" link set pv0 up; ip -n "$s" link set lo up
  ip -n "$c" addr add 10.98.0.2/16 dev eth0; ip -n "$c" link set eth0 up; ip -n "$c" link set lo up
}

# A bridge in netns pxbb-$tag, and on it: netns $1 (veth eth0, address $2/16).
on_bridge() {
  local ns=$1 n
  n=$(ip -n "pxbb-$tag" -o link show 2>/dev/null | grep -c ' p[0-9]*@' || true)
  if ! ip netns list | grep -q "^pxbb-$tag"; then
    ip netns add "pxbb-$tag"
    ip -n "pxbb-$tag" link add br0 type bridge
    ip -n "pxbb-$tag" link set br0 up
  fi
  ip netns add "$ns"
  ip link add "p$n" netns "pxbb-$tag" type veth peer name eth0 netns "$ns"
  ip -n "pxbb-$tag" link set "p$n" master br0
  ip -n "pxbb-$tag" link set "p$n" up
  ip -n "$ns" addr add "$2/16" dev eth0; ip -n "$ns" link set eth0 up; ip -n "$ns" link set lo up
}

# Waits until something listens on UDP :67 in netns $1.
wait_port67() {
  for _ in $(seq 100); do
    ip netns exec "$1" ss -Hlun 'sport = :67' | grep -q . && return 0
    sleep 0.1
  done
  echo "no DHCP server came up in $1" >&2; return 1
}

# Runs the rate ladder against the server behind client netns $1; prints one line per step
# "offered achieved drop%" to stderr and the best achieved rate (drops <= 1%) to stdout.
ladder() {
  local c=$1 best=0 fails=0
  for r in "${RATES[@]}"; do
    out=$(timeout $((PERIOD + 30)) ip netns exec "$c" /usr/sbin/perfdhcp -4 -l eth0 -r "$r" -R "$RANGE" -p "$PERIOD" 2>&1 || true)
    read -r achieved drop < <(awk '
      /^Rate:/ { rate = $2 }
      /^sent packets:/ { sent[++s] = $3 }
      /^received packets:/ { recv[++v] = $3 }
      END {
        # Block 1 is DISCOVER-OFFER, block 2 REQUEST-ACK: an exchange is complete when
        # its ACK arrives, so drops = 1 - ACKs / DISCOVERs.
        d = (sent[1] > 0) ? 100 * (1 - recv[2] / sent[1]) : 100
        if (d < 0) d = 0
        printf "%.0f %.2f\n", rate, d
      }' <<<"$out")
    printf '  %-8s offered %6s/s  achieved %6s/s  drops %6s%%\n' "$2" "$r" "$achieved" "$drop" >&2
    # Two failed steps in a row end the ladder: one can be noise on a shared machine.
    if awk -v d="$drop" 'BEGIN { exit !(d <= 1.0) }'; then
      [ "$achieved" -gt "$best" ] && best=$achieved
      fails=0
    else
      fails=$((fails + 1))
      [ "$fails" -ge 2 ] && break
    fi
  done
  echo "$best"
}

declare -A best
leases='?'
leases_pg='?'
leases_pg2='?'
conflicts_pg2=''
# pxed in full DHCP mode in netns pair $1, its data dir $2 (extra environment: $3...).
start_pxed() {
  local p=$1 data=$2
  shift 2
  pair "$p"
  mkdir -p "$data"
  ip netns exec "pxbs-$tag-$p" env "$@" "$PXED" serve --dhcp full --interface pv0 \
    --pool 10.98.1.1-10.98.255.250 --netmask 255.255.0.0 --lease-time 1h \
    --data-dir "$data" --ipxe-dir "$PWD/ipxe/bin" --http 10.98.0.1:80 --tftp 10.98.0.1:69 \
    2>"$data.log" &
  pids+=($!)
  wait_port67 "pxbs-$tag-$p" || { cat "$data.log" >&2; exit 1; }
}
run_pxed() {
  echo "== pxed (full mode, durable leases)" >&2
  start_pxed p "$work/pxed"
  best[pxed]=$(ladder pxbc-$tag-p pxed)
  leases=$(python3 -c "import sqlite3,sys; print(sqlite3.connect(sys.argv[1]).execute('select count(*) from leases').fetchone()[0])" "$work/pxed/pxed.sqlite" 2>/dev/null || echo '?')
}
# The private PostgreSQL (started on first use) and a new database $1 on it: its URL.
pg_database() {
  chmod 755 "$work"
  [ -d "$work/pg" ] || .ci/pg-start "$work/pg" >/dev/null
  psql -X -q "postgres://postgres@localhost/postgres?host=$work/pg" -c "CREATE DATABASE $1" >/dev/null
  echo "postgres://postgres@localhost/$1?host=$work/pg"
}
run_pxedpg() {
  local url
  url=$(pg_database pxed)
  echo "== pxed (full mode, durable leases) on PostgreSQL $(psql -X -At "$url" -c 'SHOW server_version')" >&2
  PXED_DATABASE_URL=$url "$PXED" migrate --data-dir "$work/pxedpg" >&2
  start_pxed q "$work/pxedpg" "PXED_DATABASE_URL=$url"
  best[pxedpg]=$(ladder pxbc-$tag-q pxedpg)
  leases_pg=$(psql -X -At "$url" -c 'SELECT count(*) FROM leases' 2>/dev/null || echo '?')
}

run_pxedpg2() {
  local url i=0 srv
  url=$(pg_database pxed2)
  echo "== two pxed (full mode, durable leases) on one PostgreSQL $(psql -X -At "$url" -c 'SHOW server_version') database" >&2
  PXED_DATABASE_URL=$url "$PXED" migrate --data-dir "$work/pxedpg2-r" >&2
  for srv in r s; do
    i=$((i + 1))
    on_bridge "pxbs-$tag-$srv" "10.98.0.$((i * 3 + 1))"
    mkdir -p "$work/pxedpg2-$srv"
    ip netns exec "pxbs-$tag-$srv" env "PXED_DATABASE_URL=$url" "$PXED" serve --dhcp full \
      --interface eth0 --pool 10.98.1.1-10.98.255.250 --netmask 255.255.0.0 --lease-time 1h \
      --data-dir "$work/pxedpg2-$srv" --ipxe-dir "$PWD/ipxe/bin" \
      --http "10.98.0.$((i * 3 + 1)):80" --tftp "10.98.0.$((i * 3 + 1)):69" \
      2>"$work/pxedpg2-$srv.log" &
    pids+=($!)
    wait_port67 "pxbs-$tag-$srv" || { cat "$work/pxedpg2-$srv.log" >&2; exit 1; }
  done
  on_bridge "pxbc-$tag-r" 10.98.0.2
  best[pxedpg2]=$(ladder "pxbc-$tag-r" pxedpg2)
  leases_pg2=$(psql -X -At "$url" -c 'SELECT count(*) FROM leases' 2>/dev/null || echo '?')
  for srv in r s; do
    conflicts_pg2+="$srv: $(grep -c 'held by another instance' "$work/pxedpg2-$srv.log" || true) "
  done
}

# Kea as its multi-threading guide sets it up for throughput: two threads (one per
# core here), memfile with persist=true (each lease appended to its CSV, not fsynced:
# durable against a Kea crash, not against a power cut), no lease file cleanup
# during the run.
run_kea() {
  echo "== kea-dhcp4 $(kea-dhcp4 -v) (2 threads, memfile persist=true)" >&2
  pair k
  mkdir -p "$work/kea"
  cat > "$work/kea/kea.json" <<EOF
{ "Dhcp4": {
    "interfaces-config": { "interfaces": [ "pv0" ], "dhcp-socket-type": "raw" },
    "lease-database": { "type": "memfile", "persist": true, "lfc-interval": 0,
                        "name": "$work/kea/leases.csv" },
    "multi-threading": { "enable-multi-threading": true, "thread-pool-size": 2,
                         "packet-queue-size": ${KEA_QUEUE:-64} },
    "valid-lifetime": 3600,
    "subnet4": [ { "id": 1, "subnet": "10.98.0.0/16",
                   "pools": [ { "pool": "10.98.1.1 - 10.98.255.250" } ] } ],
    "loggers": [ { "name": "kea-dhcp4", "severity": "WARN",
                   "output_options": [ { "output": "$work/kea/kea.log" } ] } ]
} }
EOF
  KEA_PIDFILE_DIR=$work/kea KEA_LOCKFILE_DIR=$work/kea \
    ip netns exec pxbs-$tag-k kea-dhcp4 -c "$work/kea/kea.json" 2>>"$work/kea/kea.log" &
  pids+=($!)
  wait_port67 pxbs-$tag-k || { cat "$work/kea/kea.log" >&2; exit 1; }
  best[kea]=$(ladder pxbc-$tag-k kea)
}

run_dnsmasq() {
  echo "== dnsmasq (--leasefile-ro --no-ping: leases NOT durable)" >&2
  pair d
  ip netns exec pxbs-$tag-d dnsmasq --keep-in-foreground --no-resolv --port=0 --interface=pv0 \
    --bind-interfaces --no-ping --dhcp-authoritative --dhcp-lease-max=200000 \
    --dhcp-range=10.98.1.1,10.98.255.250,255.255.0.0,1h --leasefile-ro --log-facility=/dev/null \
    --pid-file="$work/dnsmasq.pid" &
  pids+=($!)
  wait_port67 pxbs-$tag-d
  best[dnsmasq]=$(ladder pxbc-$tag-d dnsmasq)
}

for server in $SERVERS; do
  "run_$server"
done

echo
printf '%-40s %s\n' "server" "DORA exchanges/s at <=1% drops"
for server in $SERVERS; do
  case $server in
    pxed) label="pxed (durable: SQLite, $leases leases)" ;;
    pxedpg) label="pxed (durable: PostgreSQL, $leases_pg leases)" ;;
    pxedpg2) label="2 x pxed (one PostgreSQL, $leases_pg2 leases)" ;;
    kea) label="kea (2 threads, persist=true)" ;;
    dnsmasq) label="dnsmasq (leases not durable)" ;;
  esac
  printf '%-40s %s\n' "$label" "${best[$server]}"
done
if [ -n "${best[pxed]:-}" ] && [ "${best[pxedpg]:-0}" -gt 0 ]; then
  awk -v a="${best[pxedpg]}" -v b="${best[pxed]}" 'BEGIN { printf "ratio pxed on PostgreSQL / on SQLite: %.2fx\n", a / b }'
fi
if [ -n "${best[pxed]:-}" ] && [ "${best[pxedpg2]:-0}" -gt 0 ]; then
  awk -v a="${best[pxedpg2]}" -v b="${best[pxed]}" 'BEGIN { printf "ratio two pxed on PostgreSQL / one on SQLite: %.2fx\n", a / b }'
  echo "leases refused by the database (another instance held the address), per instance: $conflicts_pg2"
fi
for peer in kea dnsmasq; do
  if [ -n "${best[pxed]:-}" ] && [ "${best[$peer]:-0}" -gt 0 ]; then
    awk -v a="${best[pxed]}" -v b="${best[$peer]}" -v p="$peer" 'BEGIN { printf "ratio pxed/%s: %.2fx\n", p, a / b }'
  fi
done
