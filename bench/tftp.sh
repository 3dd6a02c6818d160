#!/bin/bash
# TFTP throughput, pxed vs tftpd-hpa, in one run: seconds to fetch a 32 MiB file over
# loopback at blksize 1468, with and without windowsize 16 (atftp), and with curl
# (no windowsize support) and tftp-hpa (512-byte blocks only).
# Needs: cargo, atftp, curl, tftp (tftp-hpa), /usr/sbin/in.tftpd (tftpd-hpa), python3.
# Usage: bench/tftp.sh [runs]   (default 5 runs per case after one warm-up)
#        ONLY=curl bench/tftp.sh 10   (only the cases whose name contains ONLY)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
# shellcheck source=bench/lib.sh
. bench/lib.sh
need atftp curl tftp python3 /usr/sbin/in.tftpd
cargo build --release --quiet
P=$(free_udp); Q=$(free_udp); H=$(free_tcp)

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
for srv in "pxed:$P" "tftpd-hpa:$Q"; do
    name=${srv%%:*}; port=${srv##*:}
    atftp --option "blksize 1468" --option "windowsize 16" -g -r big32.bin -l "$tmp/out/check" 127.0.0.1 "$port" >/dev/null 2>&1
    cmp "$tmp/root/big32.bin" "$tmp/out/check"
    oack=$(atftp --trace --option "blksize 1468" --option "windowsize 16" --option "tsize 0" \
        -g -r ready -l "$tmp/out/r" 127.0.0.1 "$port" 2>&1 | grep -m1 OACK || true)
    echo "$name answers blksize 1468, windowsize 16, tsize 0 with: ${oack:-no OACK}"
done

# Each run fetches with every case from pxed and from tftpd-hpa, alternating which
# goes first, so drift in machine load lands on both servers alike; the ratio
# column is the median of the per-run ratios.
python3 - "$RUNS" "$P" "$Q" "$tmp/out" "${ONLY:-}" <<'EOF'
import statistics, subprocess, sys, time
runs, p, q, out, only = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
f = "big32.bin"
cases = {
    "atftp bs1468": lambda port: ["atftp", "--option", "blksize 1468", "-g", "-r", f, "-l", f"{out}/a", "127.0.0.1", port],
    "atftp bs1468 ws16": lambda port: ["atftp", "--option", "blksize 1468", "--option", "windowsize 16", "-g", "-r", f, "-l", f"{out}/a", "127.0.0.1", port],
    "curl bs1468": lambda port: ["curl", "-sS", "--tftp-blksize", "1468", "-o", f"{out}/c", f"tftp://127.0.0.1:{port}/{f}"],
    "tftp-hpa 512": lambda port: ["tftp", "-m", "binary", "127.0.0.1", port, "-c", "get", f, f"{out}/h"],
}
cases = {k: v for k, v in cases.items() if only in k}

def timed(cmd):
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t

times = {k: ([], []) for k in cases}
for k, cmd in cases.items():  # warm-up
    timed(cmd(p)); timed(cmd(q))
for i in range(runs):
    for k, cmd in cases.items():
        order = [(0, p), (1, q)] if i % 2 == 0 else [(1, q), (0, p)]
        for j, port in order:
            times[k][j].append(timed(cmd(port)))

def fmt(xs):
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):>11.3f} ± {sd:<4.3f}"
print(f"\n32 MiB over loopback, mean ± stddev seconds ({runs} runs, interleaved)")
print(f"{'client / options':<22}{'pxed':>18}{'tftpd-hpa':>18}{'pxed/hpa':>10}")
for k, (a, b) in times.items():
    ratio = statistics.median(x / y for x, y in zip(a, b))
    print(f"{k:<22}{fmt(a)}{fmt(b)}{ratio:>10.2f}")
EOF
