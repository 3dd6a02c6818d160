#!/bin/bash
# Reinstall -> BMC reset latency: how long after `POST /api/v1/nodes/{id}/reinstall` the
# ComputerSystem.Reset POST reaches the BMC (sushy-emulator --fake behind a recording
# proxy), over N reinstalls, with sushy's own reset round trip beside it.
# The path measured: API apply + store write, the worker's set-netboot step (find the
# system, PATCH the one-time override, read it back), the power-state read, the reset.
# Needs: cargo, curl, python3, the sushy-tools venv ($PEERS_DIR/venv, see .ci/install.sh).
# Usage: bench/bmc.sh [reinstalls]   (default 100)
# Env:   STORES="sqlite postgresql" (pxed's store for each run, in order; PostgreSQL is a
#        private cluster on this machine, see bench/lib.sh)
#
# [bmc] bounds are short (power_deadline 2s, poll 200ms) so that the power observation of
# one reinstall ends soon after its reset; bench/bmc_bench.py then waits for the BMC to be
# idle before the next reinstall, so no sample is slowed by the previous one's polling.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-100}
STORES=${STORES:-sqlite postgresql}
P=${PEERS_DIR:-/tmp/pxed-peers}
V=$P/venv/bin
# shellcheck source=bench/lib.sh
. bench/lib.sh
need curl python3 "$V/python3" "$V/sushy-emulator"
cargo build --release --quiet
S=$(free_tcp); H=$(free_tcp); T=$(free_udp)
PASSWORD=bench-$RANDOM-Pa55
TOKEN=bench-token-$RANDOM
NODE=11111111-2222-3333-4444-5555555555b1
OTHER=11111111-2222-3333-4444-5555555555b2

# sushy-emulator --fake with basic auth (bcrypt cost 4, checked on every request).
mkdir -p "$tmp/sushy-state"
"$V/python3" -c "import bcrypt,sys;print('admin:'+bcrypt.hashpw(sys.argv[1].encode(),bcrypt.gensalt(rounds=4)).decode())" \
    "$PASSWORD" > "$tmp/htpasswd"
cat > "$tmp/sushy.conf" <<CONF
SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'
SUSHY_EMULATOR_LISTEN_PORT = $S
SUSHY_EMULATOR_AUTH_FILE = '$tmp/htpasswd'
SUSHY_EMULATOR_STATE_DIR = '$tmp/sushy-state'
SUSHY_EMULATOR_FAKE_SYSTEMS = [
    {'uuid': '$NODE', 'name': 'bench1', 'power_state': 'On',
     'nics': [{'mac': '52:54:00:be:00:01', 'ip': '10.99.0.201'}]},
    {'uuid': '$OTHER', 'name': 'bench2', 'power_state': 'Off',
     'nics': [{'mac': '52:54:00:be:00:02', 'ip': '10.99.0.202'}]},
]
CONF
"$V/sushy-emulator" --config "$tmp/sushy.conf" --fake >"$tmp/sushy.log" 2>&1 &
pids+=($!)

# A local mirror with the kernels the rocky-9 catalog entry names, imported once
# (--no-check: no repository metadata, nothing is installed from it).
for arch in x86_64 aarch64; do
    d=$tmp/mirror/rocky/9/BaseOS/$arch/os/images/pxeboot
    mkdir -p "$d"; echo "kernel $arch" > "$d/vmlinuz"; echo "initrd $arch" > "$d/initrd.img"
done
export PXED_MIRROR_BASE=$tmp/mirror/

# One pxed per store, one after the other against the same BMC.
for store in $STORES; do
    env=()
    if [ "$store" = postgresql ]; then
        env=("PXED_DATABASE_URL=$(pg_database "pxed_bmc")")
        env "${env[@]}" target/release/pxed migrate --data-dir "$tmp/data-$store" >/dev/null 2>&1
    fi
    env "${env[@]}" target/release/pxed image add rocky-9 --no-check --demo --data-dir "$tmp/data-$store" >/dev/null
    H=$(free_tcp); T=$(free_udp)
    env "${env[@]}" PXED_LOG=warn PXED_API_TOKEN=$TOKEN \
    PXED_LIFECYCLE__MAX_ATTEMPTS=0 PXED_LIFECYCLE__DEADLINES__RECLAIMING=30s \
    PXED_BMC__REQUEST_TIMEOUT=5s PXED_BMC__POWER_DEADLINE=2s PXED_BMC__RESTART_OBSERVE=1s \
    PXED_BMC__POLL_INTERVAL=200ms \
        target/release/pxed serve --demo --data-dir "$tmp/data-$store" --http "127.0.0.1:$H" \
        --tftp "127.0.0.1:$T" >>"$tmp/pxed.log" 2>&1 &
    pxed=$!
    pids+=("$pxed")
    for url in "http://127.0.0.1:$H/healthz" "http://127.0.0.1:$S/redfish/v1/"; do
        for _ in $(seq 150); do
            curl -s -o /dev/null "$url" && continue 2
            sleep 0.1
        done
        echo "nothing answers $url" >&2; cat "$tmp/pxed.log" "$tmp/sushy.log" >&2; exit 1
    done
    echo "== pxed's store: $store"
    "$V/python3" bench/bmc_bench.py -n "$N" --sushy "http://127.0.0.1:$S" --pxed "http://127.0.0.1:$H" \
        --token "$TOKEN" --password "$PASSWORD" --system "$NODE" --other "$OTHER" ${BENCH_TRACE:+--trace "$BENCH_TRACE"}
    kill "$pxed"; wait "$pxed" 2>/dev/null || true
done
if grep -q -- "$PASSWORD" "$tmp/pxed.log"; then echo "BMC password in the pxed log!" >&2; exit 1; fi
echo "pxed warnings during the run, by kind (power-step failures belong to reinstalls already"
echo "marked failed by the bench: stale results, ignored by the lifecycle):"
grep WARN "$tmp/pxed.log" | sed -E 's/^[^ ]+ +WARN +//; s/(generation|attempt|node|waited|for)[= ][^ ]+//g; s/127\.0\.0\.1:[0-9]+/BMC/g' \
    | cut -c1-150 | sort | uniq -c | sort -rn | head -5 || true
