#!/bin/bash
# Image deploy, in one run:
#  1. streaming: the deploy agent's write path (`pxed agent write-image`: HTTP, zstd,
#     SHA-256 while writing, fsync) against `curl URL | zstd -d | dd conv=fsync`, both
#     writing the lab's Debian 12 image to the same kind of target (a loop device over
#     a file in the same directory), alternating run by run; both served by pxed's own
#     HTTP server over loopback;
#  2. a lab reinstall (lab/run.sh): wall time from the reinstall call to `available`,
#     split by stage (unless NO_LAB=1).
# Needs root (loop devices, the lab), the image in images/cache (lab/run.sh or
# images/build/debian-12.sh builds it), curl, zstd, losetup.
# Usage: bench/deploy.sh [runs]   (default 3 per tool)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}
# shellcheck source=bench/lib.sh
. bench/lib.sh
need curl zstd losetup dd python3
CACHE=${PXED_IMAGE_CACHE:-images/cache}
M=$CACHE/debian-12-amd64.json
[ -f "$M" ] || { echo "no image in $CACHE: run images/build/debian-12.sh first" >&2; exit 1; }
cargo build --release --quiet
read -r SIZE SHA < <(python3 -c 'import json,sys; m=json.load(open(sys.argv[1])); print(m["raw_size"], m["raw_sha256"])' "$M")

H=$(free_tcp)
mkdir -p "$tmp/data" "$tmp/ipxe"
PXED_LOG=warn PXED_IMAGES_DIR="$(cd "$CACHE" && pwd)" target/release/pxed serve --demo \
    --data-dir "$tmp/data" --ipxe-dir "$tmp/ipxe" --http "127.0.0.1:$H" --tftp 127.0.0.1:0 \
    >"$tmp/pxed.log" 2>&1 &
pids+=($!)
URL="http://127.0.0.1:$H/images/debian-12-amd64.raw.zst"
for _ in $(seq 100); do curl -sfI "$URL" >/dev/null && break; sleep 0.1; done

truncate -s "$SIZE" "$tmp/target.img"
LOOP=$(losetup --find --show "$tmp/target.img")
trap 'losetup -d "$LOOP" 2>/dev/null; cleanup' EXIT

mbps() { python3 -c "print('%.1f' % ($SIZE / $1 / 1e6))"; }
agent=() pipe=() piped=()
for r in $(seq "$RUNS"); do
    t0=$(date +%s.%N)
    target/release/pxed agent write-image --url "$URL" --size "$SIZE" --sha256 "$SHA" --out "$LOOP" >/dev/null
    agent+=("$(echo "$(date +%s.%N) - $t0" | bc)")
    t0=$(date +%s.%N)
    curl -sS "$URL" | zstd -dc | dd of="$LOOP" bs=4M conv=fsync status=none
    pipe+=("$(echo "$(date +%s.%N) - $t0" | bc)")
    t0=$(date +%s.%N)
    curl -sS "$URL" | zstd -dc | tee >(sha256sum > "$tmp/sum") | dd of="$LOOP" bs=4M conv=fsync status=none
    while [ ! -s "$tmp/sum" ]; do sleep 0.01; done
    [ "$(cut -d' ' -f1 "$tmp/sum")" = "$SHA" ] || { echo "pipe wrote a different image" >&2; exit 1; }
    rm -f "$tmp/sum"
    piped+=("$(echo "$(date +%s.%N) - $t0" | bc)")
    echo "run $r: agent ${agent[-1]} s, curl|zstd|dd ${pipe[-1]} s, with sha256sum ${piped[-1]} s" >&2
done
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
ma=$(median "${agent[@]}") mp=$(median "${pipe[@]}") mh=$(median "${piped[@]}")
echo
echo "Streaming $SIZE raw bytes (zstd over HTTP on loopback) to a loop device, median of $RUNS:"
printf '  %-44s %8s s  %8s MB/s\n' "pxed agent write-image (verifies SHA-256)" "$ma" "$(mbps "$ma")"
printf '  %-44s %8s s  %8s MB/s\n' "curl | zstd -d | dd conv=fsync (no check)" "$mp" "$(mbps "$mp")"
printf '  %-44s %8s s  %8s MB/s\n' "curl | zstd -d | tee >(sha256sum) | dd" "$mh" "$(mbps "$mh")"
printf '  ratio agent / pipe: %s; agent / pipe with sha256sum: %s\n' \
    "$(python3 -c "print('%.2f' % ($ma / $mp))")" "$(python3 -c "print('%.2f' % ($ma / $mh))")"

if [ -z "${NO_LAB:-}" ]; then
    echo
    echo "Lab reinstall (one OVMF VM, TCG), stage by stage:"
    LAB_TIMELINE_OUT=$tmp/timeline.json bash lab/run.sh --no-install --reinstalls 1 >"$tmp/lab.log" 2>&1 \
        || { tail -30 "$tmp/lab.log"; exit 1; }
    python3 - "$tmp/timeline.json" <<'PY'
import json, sys, datetime
t = lambda s: datetime.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
ev = json.load(open(sys.argv[1]))
first = {}
for e in ev:
    first.setdefault(e["event"], t(e["at"]))
marks = [("reinstall_requested", "reinstall call"), ("power_cycled", "BMC: netboot set, power cycled"),
         ("installer_served", "firmware PXE -> iPXE -> script"), ("deploy_started", "deploy ramdisk booted, plan fetched"),
         ("deploy_verify", "wipe + image streamed and verified"), ("install_finished", "grow + configure + installed"),
         ("first_boot_reported", "reboot to disk, Debian up, first-boot"), ("health_passed", "health check")]
prev = None
for key, label in marks:
    if key not in first:
        continue
    if prev is not None:
        print("  %-42s %7.1f s" % (label, first[key] - first[prev]))
    prev = key
print("  %-42s %7.1f s" % ("total: reinstall call -> available", first.get("health_passed", 0) - first["reinstall_requested"]))
PY
fi
