#!/usr/bin/env python3
"""Reinstall → BMC reset latency through pxed, with the raw sushy figure beside it.

Runs a recording Redfish proxy (a thread in this process, in front of sushy-emulator)
that timestamps every ComputerSystem.Reset POST the moment its request arrives, then
registers one node whose BMC is the proxy and, N times:
  POST /api/v1/nodes/{id}/reinstall (t0) -> wait for the proxy to see the reset (t1)
  -> POST .../actions/fail, so it can be reinstalled again
  -> wait until the BMC has been idle for --settle ms (the previous generation's
     power-state polling has ended), so no sample overlaps the one before.
Prints p50/p99/max of t1 - t0, and the round trip of reset POSTs sent straight to sushy
(another system, same emulator) as the peer figure. Both clocks are this process's
time.monotonic(). Started by bench/bmc.sh.
"""
import argparse
import base64
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
REC = {"resets": [], "requests": 0, "inflight": 0, "last": time.monotonic(), "log": []}
RESET_SEEN = threading.Event()
FWD_REQ = ("Authorization", "Content-Type", "If-Match", "X-Auth-Token")
FWD_RESP = ("Content-Type", "ETag", "Location", "X-Auth-Token")


class Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: without TCP_NODELAY, Nagle plus the
    # client's delayed ACK would add ~40 ms to some answers and bill it to pxed.
    disable_nagle_algorithm = True

    def log_message(self, fmt, *args):
        pass

    def handle_any(self, method):
        now = time.monotonic()
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        with LOCK:
            REC["requests"] += 1
            REC["inflight"] += 1
            REC["log"].append((now, method, self.path))
            if method == "POST" and self.path.endswith("/Actions/ComputerSystem.Reset"):
                kind = json.loads(body or b"{}").get("ResetType")
                REC["resets"].append((now, kind, REC["requests"]))
                RESET_SEEN.set()
        try:
            req = urllib.request.Request(self.server.upstream + self.path, data=body or None,
                                         method=method)
            for h in FWD_REQ:
                if self.headers.get(h) is not None:
                    req.add_header(h, self.headers[h])
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    st, data, hdrs = r.status, r.read(), r.headers
            except urllib.error.HTTPError as e:
                st, data, hdrs = e.code, e.read(), e.headers
            self.send_response(st)
            for h in FWD_RESP:
                if hdrs.get(h) is not None:
                    self.send_header(h, hdrs[h])
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        finally:
            with LOCK:
                REC["inflight"] -= 1
                REC["last"] = time.monotonic()

    def do_GET(self):
        self.handle_any("GET")

    def do_POST(self):
        self.handle_any("POST")

    def do_PATCH(self):
        self.handle_any("PATCH")

    def do_DELETE(self):
        self.handle_any("DELETE")


def call(method, url, body=None, headers=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 method=method)
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def pct(xs, p):
    """Nearest-rank percentile."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, -(-len(s) * p // 100) - 1))
    return s[k]


def ms(x):
    return f"{x * 1000:8.1f} ms"


def wait_idle(settle, timeout=30):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with LOCK:
            quiet = REC["inflight"] == 0 and time.monotonic() - REC["last"] >= settle
        if quiet:
            return
        time.sleep(0.02)
    raise SystemExit("the BMC never went idle")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sushy", required=True)
    ap.add_argument("--pxed", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--password", required=True)
    ap.add_argument("--system", required=True, help="system the node's BMC points at")
    ap.add_argument("--other", required=True, help="system for the direct sushy figure")
    ap.add_argument("-n", type=int, default=100)
    ap.add_argument("--direct", type=int, default=20)
    ap.add_argument("--settle", type=float, default=0.6)
    ap.add_argument("--trace", type=int, default=0, help="print the BMC requests of the first K reinstalls")
    a = ap.parse_args()

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    srv.daemon_threads = True
    srv.upstream = a.sushy.rstrip("/")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    proxy = f"http://127.0.0.1:{srv.server_address[1]}"

    # The peer figure: reset POSTs straight to sushy, no pxed, no proxy.
    basic = {"Authorization": "Basic " + base64.b64encode(f"admin:{a.password}".encode()).decode()}
    reset = f"{a.sushy}/redfish/v1/Systems/{a.other}/Actions/ComputerSystem.Reset"
    direct = []
    for i in range(a.direct):
        t = time.monotonic()
        st, body = call("POST", reset, {"ResetType": "On" if i % 2 == 0 else "ForceOff"}, basic)
        direct.append(time.monotonic() - t)
        assert st in (200, 202, 204), (st, body)
    gets = []
    for _ in range(a.direct):
        t = time.monotonic()
        st, _ = call("GET", f"{a.sushy}/redfish/v1/Systems/{a.other}", None, basic)
        gets.append(time.monotonic() - t)
        assert st == 200

    api = {"Authorization": f"Bearer {a.token}"}
    st, body = call("POST", f"{a.pxed}/api/v1/nodes", {
        "macs": ["52:54:00:be:00:01"], "arch": "x86_64",
        "bmc": {"driver": "redfish", "address": proxy, "username": "admin",
                "password": a.password, "system_id": a.system}}, api)
    assert st == 201, (st, body)
    node = json.loads(body)["id"]

    lat, posts, before, skipped = [], [], [], []
    i = -1
    while len(lat) < a.n:
        i += 1
        if len(skipped) > a.n:
            raise SystemExit(f"{len(skipped)} reinstalls sent no reset")
        wait_idle(a.settle)
        RESET_SEEN.clear()
        with LOCK:
            n_before, n_resets = REC["requests"], len(REC["resets"])
        t0 = time.monotonic()
        st, body = call("POST", f"{a.pxed}/api/v1/nodes/{node}/reinstall", {"image": "rocky-9"}, api)
        posts.append(time.monotonic() - t0)
        assert st == 202, (i, st, body)
        state = "reclaiming"
        end = time.monotonic() + 30
        while not RESET_SEEN.wait(1.0) and state == "reclaiming":
            _, n = call("GET", f"{a.pxed}/api/v1/nodes/{node}", None, api)
            state = json.loads(n)["state"]
            if time.monotonic() > end:
                raise SystemExit(f"iteration {i}: no reset reached the BMC in 30 s: {n.decode()}")
        if not RESET_SEEN.is_set():
            # sushy applies a reset 1-11 s late: the previous reinstall's power-on landed
            # between the driver's two power reads, and it reported the cycle done
            # without sending one. Not a latency sample; reinstall again.
            skipped.append((i, state))
            if state == "netbooting":
                call("POST", f"{a.pxed}/api/v1/nodes/{node}/actions/fail", {"reason": "bench"}, api)
            continue
        with LOCK:
            t1, kind, seq = REC["resets"][n_resets]
        lat.append(t1 - t0)
        if i < a.trace:
            with LOCK:
                log = REC["log"][n_before:seq]
            print(f"reinstall {i}: reset after {ms(t1 - t0).strip()}")
            for t, m, path in log:
                print(f"  +{ms(t - t0)} {m} {path}")
        before.append(seq - n_before)
        st, body = call("POST", f"{a.pxed}/api/v1/nodes/{node}/actions/fail",
                        {"reason": "bench: reinstall again"}, api)
        if st != 200:
            # The power step may already have failed the node on its own (short deadline).
            _, n = call("GET", f"{a.pxed}/api/v1/nodes/{node}", None, api)
            assert json.loads(n)["state"] == "failed", (i, st, body, n)

    kinds = sorted({k for _, k, _ in REC["resets"]})
    print(f"reinstalls sampled: {a.n}; resets seen at the BMC: {len(REC['resets'])} ({', '.join(kinds)})")
    if skipped:
        print(f"reinstalls that reached {skipped[0][1]} with no reset sent (sushy's late "
              f"power-on seen between two power reads; not sampled): {len(skipped)}")
    print(f"BMC requests per reinstall up to and including the reset: median "
          f"{statistics.median(before):.0f} (min {min(before)}, max {max(before)})")
    print("")
    print(f"{'':44} {'p50':>11} {'p99':>11} {'max':>11}")
    print(f"{'pxed: POST /reinstall -> reset at the BMC':44} {ms(pct(lat, 50))} {ms(pct(lat, 99))} {ms(max(lat))}")
    print(f"{'pxed: POST /reinstall response time':44} {ms(pct(posts, 50))} {ms(pct(posts, 99))} {ms(max(posts))}")
    print(f"{'sushy: direct reset POST round trip':44} {ms(pct(direct, 50))} {ms(pct(direct, 99))} {ms(max(direct))}")
    print(f"{'sushy: direct GET system round trip':44} {ms(pct(gets, 50))} {ms(pct(gets, 99))} {ms(max(gets))}")
    print(f"(sushy figures over {a.direct} requests each, first one included)")


if __name__ == "__main__":
    main()
