#!/usr/bin/env python3
"""A small Redfish proxy in front of sushy-tools that injects the faults real BMCs show.

Usage: bmc_fault_proxy.py --upstream http://127.0.0.1:PORT [--faults a,b,...]
Listens on 127.0.0.1 on a free port and prints "PORT <n>" on stdout once ready.

Faults (comma-separated):
  patch500              PATCH on a system answers 500 with a Redfish error body
  ignore-patch          PATCH answers 204 and is dropped (the override never changes)
  reset-noop            ComputerSystem.Reset answers 204 and is dropped (power never changes)
  slow-reset            ComputerSystem.Reset is forwarded at once and answered 5 s later (the
                        machine restarts while its caller still waits: a window to crash in)
  advertise-powercycle  prepend PowerCycle to ResetType@Redfish.AllowableValues (sushy then 501s it)
  sessions              add a SessionService: POST .../Sessions -> X-Auth-Token; requests with
                        the token are forwarded with the user's basic auth
  etag                  GET of a system carries an ETag; PATCH needs a matching If-Match (else 412)
  lie-unless-mode       a lying BMC: GET hides BootSourceOverrideMode; a PATCH of a Pxe override
                        without BootSourceOverrideMode is read back as asked, but the BMC behind
                        is told Hdd (the machine boots its disk); one that spells out the mode is
                        forwarded as is (firmware that picks legacy unless told UEFI)
  lie-unless-offon      a lying BMC: the override is taken, but only a cold boot (On after
                        ForceOff) honours it; a restart-type reset (ForceRestart, PowerCycle,
                        GracefulRestart) boots the disk

With a lie-* fault, --on-netboot CMD is run (by the shell, in the background) each time the
"machine" really netboots: a reset that powers it on while the override boots Pxe and the lie
does not apply. The tests make CMD send DHCP from the node's MAC (udhcpc in a namespace).
GET /_proxy/stats returns counters as JSON (patches, if_match, resets, logins, logouts,
netboots, disk_boots).
"""
import argparse
import base64
import json
import secrets
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
STATS = {"patches": 0, "if_match": [], "resets": [], "logins": 0, "logouts": 0,
         "netboots": 0, "disk_boots": 0}
# What the lying BMC remembers per system path: the last boot PATCH, whether it was off.
BOOT = {}
TOKENS = {}  # token -> (basic header, session path)
ETAG = {"n": 1}


def redfish_error(msg):
    return json.dumps({"error": {"code": "Base.1.0.GeneralError", "message": msg,
                                 "@Message.ExtendedInfo": [{"Message": msg}]}}).encode()


class Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        sys.stderr.write("proxy: " + (fmt % args) + "\n")

    def reply(self, status, body=b"", headers=None):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if body:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def upstream(self, method, path, body, auth):
        req = urllib.request.Request(self.server.upstream + path, data=body or None, method=method)
        if auth:
            req.add_header("Authorization", auth)
        if body:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read(), dict(e.headers)

    def auth(self):
        """The basic auth header to send upstream, or None to refuse with 401."""
        tok = self.headers.get("X-Auth-Token")
        if tok is not None:
            with LOCK:
                t = TOKENS.get(tok)
            return t[0] if t else None
        return self.headers.get("Authorization", "")

    def is_system(self, path):
        parts = path.rstrip("/").split("/")
        return len(parts) == 5 and parts[:4] == ["", "redfish", "v1", "Systems"]

    def handle_any(self, method):
        f = self.server.faults
        path = self.path
        body = self.body()
        if path == "/_proxy/stats":
            with LOCK:
                return self.reply(200, json.dumps(STATS).encode())
        if "sessions" in f and path.rstrip("/") == "/redfish/v1/SessionService/Sessions" and method == "POST":
            creds = json.loads(body or b"{}")
            basic = "Basic " + base64.b64encode(
                f"{creds.get('UserName', '')}:{creds.get('Password', '')}".encode()).decode()
            st, _, _ = self.upstream("GET", "/redfish/v1/Systems", None, basic)
            if st != 200:
                return self.reply(401, redfish_error("Invalid username or password"))
            tok = secrets.token_hex(16)
            with LOCK:
                STATS["logins"] += 1
                n = STATS["logins"]
                TOKENS[tok] = (basic, f"/redfish/v1/SessionService/Sessions/{n}")
            return self.reply(201, json.dumps({"Id": str(n)}).encode(),
                              {"X-Auth-Token": tok, "Location": f"/redfish/v1/SessionService/Sessions/{n}"})
        if "sessions" in f and path.startswith("/redfish/v1/SessionService/Sessions/") and method == "DELETE":
            with LOCK:
                for k, v in list(TOKENS.items()):
                    if v[1] == path:
                        del TOKENS[k]
                        STATS["logouts"] += 1
            return self.reply(204)
        auth = self.auth()
        if auth is None:
            return self.reply(401, redfish_error("session expired"))
        if method == "PATCH" and self.is_system(path):
            with LOCK:
                STATS["patches"] += 1
                STATS["if_match"].append(self.headers.get("If-Match"))
            if "etag" in f and self.headers.get("If-Match") != f'W/"{ETAG["n"]}"':
                return self.reply(412, redfish_error("ETag mismatch"))
            if "patch500" in f:
                return self.reply(500, redfish_error("Internal error while applying boot settings"))
            if "ignore-patch" in f:
                return self.reply(204)
            ETAG["n"] += 1
            boot = json.loads(body or b"{}").get("Boot", {})
            if boot:
                with LOCK:
                    st = BOOT.setdefault(path.rstrip("/"), {})
                    st["patch"] = boot
                    st.pop("claimed", None)
                if ("lie-unless-mode" in f and boot.get("BootSourceOverrideTarget") == "Pxe"
                        and "BootSourceOverrideMode" not in boot):
                    # Taken and read back as asked, but the machine is told the disk.
                    with LOCK:
                        st["claimed"] = dict(boot)
                    body = json.dumps({"Boot": dict(boot, BootSourceOverrideTarget="Hdd")}).encode()
        if method == "POST" and path.endswith("/Actions/ComputerSystem.Reset"):
            kind = json.loads(body or b"{}").get("ResetType")
            with LOCK:
                STATS["resets"].append(kind)
            if "reset-noop" in f:
                return self.reply(204)
            if "lie-unless-mode" in f or "lie-unless-offon" in f:
                self.boot_after_reset(path.rsplit("/Actions/", 1)[0].rstrip("/"), kind, auth)
        st, data, headers = self.upstream(method, path, body, auth)
        if "slow-reset" in f and method == "POST" and path.endswith("/Actions/ComputerSystem.Reset"):
            time.sleep(5)
        out = {}
        if st == 200 and method == "GET" and data:
            doc = json.loads(data)
            if path.rstrip("/") == "/redfish/v1" and "sessions" in f:
                doc.setdefault("Links", {})["Sessions"] = {"@odata.id": "/redfish/v1/SessionService/Sessions"}
                doc["SessionService"] = {"@odata.id": "/redfish/v1/SessionService"}
            if self.is_system(path):
                if "advertise-powercycle" in f:
                    act = doc.get("Actions", {}).get("#ComputerSystem.Reset", {})
                    act["ResetType@Redfish.AllowableValues"] = ["PowerCycle"] + act.get(
                        "ResetType@Redfish.AllowableValues", [])
                if "etag" in f:
                    out["ETag"] = f'W/"{ETAG["n"]}"'
                if "lie-unless-mode" in f and isinstance(doc.get("Boot"), dict):
                    doc["Boot"].pop("BootSourceOverrideMode", None)
                    doc["Boot"].pop("BootSourceOverrideMode@Redfish.AllowableValues", None)
                    with LOCK:
                        claimed = BOOT.get(path.rstrip("/"), {}).get("claimed")
                    if claimed:
                        doc["Boot"].update(claimed)
            data = json.dumps(doc).encode()
        self.reply(st, data, out)

    def boot_after_reset(self, system, kind, auth):
        """Decides what the lying machine boots after reset `kind`; runs the hook on a netboot."""
        f = self.server.faults
        with LOCK:
            st = BOOT.setdefault(system, {})
            was_off = st.get("off", False)
            if kind in ("ForceOff", "GracefulShutdown", "PushPowerButton"):
                st["off"] = True
                return
            st["off"] = False
            patch = st.get("patch", {})
        powers_on = kind in ("On", "ForceOn", "ForceRestart", "PowerCycle", "GracefulRestart")
        if not powers_on:
            return
        netboot = patch.get("BootSourceOverrideTarget") == "Pxe" and patch.get(
            "BootSourceOverrideEnabled") in ("Once", "Continuous")
        if "lie-unless-mode" in f and "BootSourceOverrideMode" not in patch:
            netboot = False
        if "lie-unless-offon" in f and not (kind in ("On", "ForceOn") and was_off):
            netboot = False
        with LOCK:
            STATS["netboots" if netboot else "disk_boots"] += 1
        sys.stderr.write(f"proxy: reset {kind} of {system}: boots {'the network' if netboot else 'its disk'}\n")
        if netboot and self.server.on_netboot:
            subprocess.Popen(self.server.on_netboot, shell=True, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def do_GET(self):
        self.handle_any("GET")

    def do_POST(self):
        self.handle_any("POST")

    def do_PATCH(self):
        self.handle_any("PATCH")

    def do_DELETE(self):
        self.handle_any("DELETE")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--faults", default="")
    ap.add_argument("--on-netboot", default="")
    a = ap.parse_args()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    srv.daemon_threads = True
    srv.upstream = a.upstream.rstrip("/")
    srv.faults = set(x for x in a.faults.split(",") if x)
    srv.on_netboot = a.on_netboot
    print(f"PORT {srv.server_address[1]}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
