#!/bin/bash
# TFTP throughput, pxed vs tftpd-hpa, in one run: seconds to fetch a 32 MiB file over
# loopback at blksize 1468, with and without windowsize 16 (atftp), and with curl
# (no windowsize support) and tftp-hpa (512-byte blocks only).
# Needs: cargo, atftp, curl, tftp (tftp-hpa), /usr/sbin/in.tftpd (tftpd-hpa), hyperfine, python3.
# Usage: bench/tftp.sh [runs]   (default 5 runs per case after one warm-up)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
for t in atftp curl tftp hyperfine python3 /usr/sbin/in.tftpd; do
    command -v "$t" >/dev/null || { echo "missing: $t" >&2; exit 1; }
done

cargo build --release --quiet
tmp=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$tmp"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
free_tcp() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
P=$(free_port); Q=$(free_port); H=$(free_tcp)

mkdir -p "$tmp/root" "$tmp/data" "$tmp/out"
head -c 32M /dev/urandom > "$tmp/root/big32.bin"
echo ok > "$tmp/root/ready"

PXED_LOG=warn target/release/pxed serve --demo --data-dir "$tmp/data" --ipxe-dir "$tmp/root" \
    --tftp "127.0.0.1:$P" --http "127.0.0.1:$H" >"$tmp/pxed.log" 2>&1 &
pids+=($!)
/usr/sbin/in.tftpd --foreground --listen --address "127.0.0.1:$Q" --user root --secure "$tmp/root" &
pids+=($!)

for port in $P $Q; do
    for _ in $(seq 100); do
        curl -s -o /dev/null "tftp://127.0.0.1:$port/ready" && continue 2
        sleep 0.1
    done
    echo "no TFTP server on port $port" >&2; cat "$tmp/pxed.log" >&2; exit 1
done

# Same bytes from both servers, and windowsize really negotiated where claimed.
for port in $P $Q; do
    atftp --option "blksize 1468" --option "windowsize 16" -g -r big32.bin -l "$tmp/out/check" 127.0.0.1 "$port" >/dev/null 2>&1
    cmp "$tmp/root/big32.bin" "$tmp/out/check"
    oack=$(atftp --trace --option "blksize 1468" --option "windowsize 16" --option "tsize 0" \
        -g -r ready -l "$tmp/out/r" 127.0.0.1 "$port" 2>&1 | grep -m1 OACK || true)
    echo "port $port OACK: ${oack:-none}"
done

f=big32.bin; o=$tmp/out
args=()
for srv in "pxed:$P" "tftpd-hpa:$Q"; do
    name=${srv%%:*}; port=${srv##*:}
    args+=(-n "$name|atftp bs1468" "atftp --option 'blksize 1468' -g -r $f -l $o/a 127.0.0.1 $port")
    args+=(-n "$name|atftp bs1468 ws16" "atftp --option 'blksize 1468' --option 'windowsize 16' -g -r $f -l $o/a 127.0.0.1 $port")
    args+=(-n "$name|curl bs1468" "curl -s --tftp-blksize 1468 -o $o/c tftp://127.0.0.1:$port/$f")
    args+=(-n "$name|tftp-hpa 512" "tftp -m binary 127.0.0.1 $port -c get $f $o/h")
done
hyperfine -N -w 1 -r "$RUNS" --export-json "$tmp/r.json" "${args[@]}" >"$tmp/hyperfine.txt"

python3 - "$tmp/r.json" <<'EOF'
import json, sys
rows = {}
for r in json.load(open(sys.argv[1]))["results"]:
    srv, case = r["command"].split("|")
    rows.setdefault(case, {})[srv] = (r["mean"], r["stddev"] or 0.0)
print(f"\n32 MiB over loopback, mean ± stddev seconds ({len(json.load(open(sys.argv[1]))['results'][0]['times'])} runs)")
print(f"{'client / options':<22}{'pxed':>18}{'tftpd-hpa':>18}{'pxed/hpa':>10}")
for case, s in rows.items():
    p, h = s["pxed"], s["tftpd-hpa"]
    print(f"{case:<22}{p[0]:>11.3f} ± {p[1]:<4.3f}{h[0]:>11.3f} ± {h[1]:<4.3f}{p[0]/h[0]:>10.2f}")
EOF
