#!/usr/bin/env bash
# Records what sushy-tools' fake driver PUTs to its external notifier for each PATCH and each
# ResetType (no QEMU: a plain listener answers 200 and logs). Runs in its own netns pxlabpay.
# Output: one line per request: the request, its HTTP status, then every payload it caused
# (uuid/name/nics/external_notifier left out). Reading the system (GET) after apply_time is what
# applies a pending power change, so each reset is followed by GETs until nothing is pending.
set -uo pipefail
NS=pxlabpay V=${SUSHY_VENV:-/tmp/pxed-peers/venv}; W=$(mktemp -d /tmp/pxlab-payloads.XXXXXX)
U=98989898-0000-4000-8000-0000000000aa S=http://127.0.0.1:8000/redfish/v1/Systems/$U
SPID='' LPID=''
cleanup() { [ -n "$SPID" ] && kill "$SPID" 2>/dev/null; [ -n "$LPID" ] && kill "$LPID" 2>/dev/null; sleep 0.3
            ip netns del "$NS" 2>/dev/null; rm -rf "$W"; }
trap cleanup EXIT
ip netns del "$NS" 2>/dev/null; ip netns add "$NS"; ip -n "$NS" link set lo up
"$V/bin/python3" -c 'import bcrypt;print("admin:"+bcrypt.hashpw(b"password",bcrypt.gensalt(rounds=5)).decode())' > "$W/htpasswd"
cat > "$W/sushy.conf" <<CONF
SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'
SUSHY_EMULATOR_LISTEN_PORT = 8000
SUSHY_EMULATOR_AUTH_FILE = '$W/htpasswd'
SUSHY_EMULATOR_STATE_DIR = '$W/state'
SUSHY_EMULATOR_FAKE_SYSTEMS = [{'uuid': '$U', 'name': 'pay', 'power_state': 'Off', 'external_notifier': True,
                                'nics': [{'mac': '52:54:00:98:00:aa'}]}]
EXTERNAL_NOTIFICATION_URL = 'http://127.0.0.1:9999/notify'
CONF
ip netns exec "$NS" python3 -c '
import http.server,sys
class H(http.server.BaseHTTPRequestHandler):
    def do_PUT(self):
        b=self.rfile.read(int(self.headers.get("Content-Length",0)))
        with open(sys.argv[1],"ab") as f: f.write(b+b"\n")
        self.send_response(200); self.send_header("Content-Length","0"); self.end_headers()
    def log_message(self,*a): pass
http.server.ThreadingHTTPServer(("127.0.0.1",9999),H).serve_forever()' "$W/notify.log" & LPID=$!
ip netns exec "$NS" "$V/bin/sushy-emulator" --config "$W/sushy.conf" --fake > "$W/sushy.log" 2>&1 & SPID=$!
c() { ip netns exec "$NS" curl -s -u admin:password -H 'Content-Type: application/json' "$@"; }
for _ in $(seq 1 60); do [ "$(c -o /dev/null -w '%{http_code}' "$S")" = 200 ] && break; sleep 0.3; done
shown=0
show() {  # $1 = label, $2 = status: print the payloads that arrived since the last call
  echo "## $1 -> HTTP $2"
  tail -n +$((shown+1)) "$W/notify.log" | python3 -c '
import sys,json
t0=float(sys.argv[1])
for l in sys.stdin:
    d=json.loads(l)
    for k in ("uuid","name","nics","external_notifier"): d.pop(k,None)
    p=d.get("pending_power")
    if p: p["apply_time"]="request+%ds" % round(p["apply_time"]-t0)
    print("   ", json.dumps(d))' "${TREQ:-0}"
  shown=$(wc -l < "$W/notify.log")
}
settle() { for _ in $(seq 1 30); do c "$S" >/dev/null; [ "$(tail -n1 "$W/notify.log" | grep -c 'pending_power": {')" = 0 ] && break; sleep 0.5; done; }
st=$(c -o /dev/null -w '%{http_code}' -X PATCH -d '{"Boot":{"BootSourceOverrideTarget":"Pxe","BootSourceOverrideEnabled":"Once","BootSourceOverrideMode":"UEFI"}}' "$S")
show 'PATCH Boot {Target Pxe, Enabled Once, Mode UEFI}' "$st"
echo "   read back: $(c "$S" | python3 -c 'import sys,json;b=json.load(sys.stdin)["Boot"];print(b["BootSourceOverrideTarget"],b["BootSourceOverrideEnabled"])')"
st=$(c -o /dev/null -w '%{http_code}' -X PATCH -d '{"Boot":{"BootSourceOverrideEnabled":"Disabled"}}' "$S")
show 'PATCH Boot {Enabled Disabled} alone' "$st"
st=$(c -o /dev/null -w '%{http_code}' -X PATCH -d '{"Boot":{"BootSourceOverrideTarget":"Hdd","BootSourceOverrideEnabled":"Disabled"}}' "$S")
show 'PATCH Boot {Target Hdd, Enabled Disabled}' "$st"
st=$(c -o /dev/null -w '%{http_code}' -X PATCH -d '{"Boot":{"BootSourceOverrideTarget":"None","BootSourceOverrideEnabled":"Disabled"}}' "$S")
show 'PATCH Boot {Target None, Enabled Disabled}' "$st"
echo "   read back: $(c "$S" | python3 -c 'import sys,json;b=json.load(sys.stdin)["Boot"];print(b["BootSourceOverrideTarget"],b["BootSourceOverrideEnabled"])')"
c -o /dev/null -X PATCH -d '{"Boot":{"BootSourceOverrideTarget":"Hdd"}}' "$S"; shown=$(wc -l < "$W/notify.log")
for rt in On On ForceRestart GracefulRestart ForceOff ForceOff ForceOn GracefulShutdown ForceRestart Nmi PushPowerButton PowerCycle; do
  pre=$(c "$S" | python3 -c 'import sys,json;print(json.load(sys.stdin)["PowerState"])')
  TREQ=$(date +%s.%N)
  st=$(c -o /dev/null -w '%{http_code}' -X POST -d "{\"ResetType\":\"$rt\"}" "$S/Actions/ComputerSystem.Reset")
  settle
  show "Reset $rt (power was $pre)" "$st"
done
