#!/bin/bash
# The technicians' board over 2,000 nodes: render time and size of the HTML board
# (`/?limit=1000`, two pages) beside the plain JSON listing of the same nodes
# (`/api/v1/nodes?limit=1000`, two pages) and the board's own JSON (`/status.json`),
# from one pxed in one run. Nodes carry labels (rack), two MACs, and a mix of states
# (available, allocated, failed and quarantined with reasons, discovered).
# Needs: cargo, curl, python3.
# Usage: bench/board.sh [nodes] [runs]   (default 2000 nodes, 21 runs per URL; the median is printed)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-2000}
RUNS=${2:-21}
# shellcheck source=bench/lib.sh
. bench/lib.sh
need curl python3
cargo build --release --quiet
H=$(free_tcp); T=$(free_udp)
TOKEN=bench-token-$RANDOM

PXED_LOG=warn PXED_API_TOKEN=$TOKEN PXED_STATUS_PUBLIC=false \
    target/release/pxed serve --demo --data-dir "$tmp/data" --http "127.0.0.1:$H" \
    --tftp "127.0.0.1:$T" >"$tmp/pxed.log" 2>&1 &
pids+=($!)
for _ in $(seq 150); do
    curl -s -o /dev/null "http://127.0.0.1:$H/healthz" && break
    sleep 0.1
done

# Register N nodes (8 at a time) and move some into other states through the API.
python3 - "$H" "$TOKEN" "$N" <<'PY'
import json, sys, urllib.request
from concurrent.futures import ThreadPoolExecutor
port, token, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
def call(method, path, body=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)
def one(i):
    macs = [f"52:54:{i >> 16 & 255:02x}:{i >> 8 & 255:02x}:{i & 255:02x}:01",
            f"52:54:{i >> 16 & 255:02x}:{i >> 8 & 255:02x}:{i & 255:02x}:02"]
    body = {"macs": macs, "arch": "arm64" if i % 3 == 0 else "x86_64",
            "labels": {"rack": f"r{i // 40:02d}", "row": "abcd"[i % 4]}}
    if i % 10 == 9:
        body["state"] = "discovered"
    else:
        body["name"] = f"r{i // 40:02d}-n{i % 40:02d}"
    nid = call("POST", "/api/v1/nodes", body)["id"]
    if i % 10 == 1:
        call("POST", f"/api/v1/nodes/{nid}/actions/allocate", {})
    elif i % 10 == 3:
        call("POST", f"/api/v1/nodes/{nid}/actions/fail", {"reason": "health: disk 2 reports 412 reallocated sectors"})
    elif i % 50 == 5:
        call("POST", f"/api/v1/nodes/{nid}/actions/quarantine", {"reason": "GPU 3 fell off the bus"})
with ThreadPoolExecutor(8) as ex:
    list(ex.map(one, range(n)))
PY

# Median time and size of fetching all pages of a listing, RUNS times.
measure() {
    local first=$1 runs=$RUNS
    local times=() size=0
    for _ in $(seq "$runs"); do
        local url=$first total=0 bytes=0
        while [ -n "$url" ]; do
            local out
            out=$(curl -sS -o "$tmp/body" -D "$tmp/head" -w '%{time_total} %{size_download}' \
                -H "Authorization: Bearer $TOKEN" -H 'Accept: text/html' "$url")
            total=$(python3 -c "print($total + ${out% *})")
            bytes=$((bytes + ${out#* }))
            # The next page: the Link header (API), or the board's / status.json's `next`.
            local next
            next=$(python3 - "$tmp/head" "$tmp/body" "$url" <<'PY'
import json, re, sys
head, body, url = open(sys.argv[1]).read(), open(sys.argv[2], errors="replace").read(), sys.argv[3]
base = re.match(r"(https?://[^/]+)", url).group(1)
m = re.search(r'^link: <([^>]+)>; rel="next"', head, re.I | re.M)
if m:
    print(base + m.group(1)); sys.exit()
if url.split("?")[0].endswith("/status.json"):
    n = json.loads(body).get("next")
    print(f"{base}/status.json?{n}" if n else ""); sys.exit()
m = re.search(r'<a href="/\?([^"]+)">next page</a>', body)
print(f"{base}/?{m.group(1).replace('&#38;', '&')}" if m else "")
PY
)
            url=$next
        done
        times+=("$total"); size=$bytes
    done
    python3 - "$size" "${times[@]}" <<'PY'
import statistics, sys
size, times = int(sys.argv[1]), [float(t) for t in sys.argv[2:]]
print(f"{statistics.median(times) * 1000:8.1f} ms  {size / 1024:8.1f} KiB")
PY
}

B=http://127.0.0.1:$H
rows=$(curl -sS -H "Authorization: Bearer $TOKEN" "$B/status.json?limit=1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["total"])')
echo "board over $rows nodes (release build, median of $RUNS runs, all pages, loopback):"
printf '  %-52s %s\n' "pxed board HTML     /?limit=1000 (2 pages)" "$(measure "$B/?limit=1000")"
printf '  %-52s %s\n' "pxed board HTML     / (default 500 a page, 4 pages)" "$(measure "$B/")"
printf '  %-52s %s\n' "pxed board JSON     /status.json?limit=1000" "$(measure "$B/status.json?limit=1000")"
printf '  %-52s %s\n' "plain JSON listing  /api/v1/nodes?limit=1000" "$(measure "$B/api/v1/nodes?limit=1000")"
printf '  %-52s %s\n' "filtered board      /?label=rack=r07&state=failed" "$(measure "$B/?label=rack%3Dr07&state=failed")"
printf '  %-52s %s\n' "free text board     /?q=52:54:00:03" "$(measure "$B/?q=52%3A54%3A00%3A03")"
