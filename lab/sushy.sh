#!/usr/bin/env bash
# Redfish helpers against a lab's sushy-emulator (run inside the lab's netns when it has one).
# Usage: lab/sushy.sh LAB.json VM COMMAND [ARGS]
#   get                      the ComputerSystem JSON
#   power                    PowerState
#   target                   BootSourceOverrideTarget
#   reset TYPE               POST ComputerSystem.Reset (On ForceOn ForceOff GracefulShutdown
#                            GracefulRestart ForceRestart Nmi); prints the HTTP status
#   pxe-once [MODE]          PATCH Boot Pxe / Once (MODE UEFI or Legacy, default UEFI); prints the status
#   boot TARGET [ENABLED]    PATCH Boot TARGET (Pxe Hdd Cd ...), ENABLED default Once; prints the status
#   wait-power STATE [SECS]  poll until PowerState is STATE (default 30 s); reading the system is
#                            also what makes sushy's fake driver apply a pending power change
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,13p' "$0"; exit 2; }
LAB=$1 VM=$2 CMD=$3; shift 3
eval "$(python3 - "$LAB" "$VM" <<'PY'
import json, shlex, sys
lab = json.load(open(sys.argv[1])); rf = lab.get("redfish", {})
vm = next((v for v in lab["vms"] if v["name"] == sys.argv[2] or v["uuid"] == sys.argv[2]), None)
if vm is None:
    sys.exit(f"no VM {sys.argv[2]} in {sys.argv[1]}")
for k, v in {"NS": lab.get("netns") or "", "HOST": rf.get("host", "127.0.0.1"), "PORT": rf.get("port", 8000),
             "RFUSER": rf.get("user", "admin"), "RFPASS": rf.get("password", "password"), "UUID": vm["uuid"]}.items():
    print(f"{k}={shlex.quote(str(v))}")
PY
)"
S=http://$HOST:$PORT/redfish/v1/Systems/$UUID
c() { if [ -n "$NS" ]; then ip netns exec "$NS" curl -s -u "$RFUSER:$RFPASS" -H 'Content-Type: application/json' "$@";
      else curl -s -u "$RFUSER:$RFPASS" -H 'Content-Type: application/json' "$@"; fi; }
field() { c "$S" | python3 -c "import sys,json;d=json.load(sys.stdin);print($1)"; }
case "$CMD" in
  get) c "$S" ;;
  power) field 'd["PowerState"]' ;;
  target) field 'd["Boot"]["BootSourceOverrideTarget"]' ;;
  reset) c -o /dev/null -w '%{http_code}\n' -X POST -d "{\"ResetType\":\"$1\"}" "$S/Actions/ComputerSystem.Reset" ;;
  pxe-once) c -o /dev/null -w '%{http_code}\n' -X PATCH \
      -d "{\"Boot\":{\"BootSourceOverrideTarget\":\"Pxe\",\"BootSourceOverrideEnabled\":\"Once\",\"BootSourceOverrideMode\":\"${1:-UEFI}\"}}" "$S" ;;
  boot) c -o /dev/null -w '%{http_code}\n' -X PATCH \
      -d "{\"Boot\":{\"BootSourceOverrideTarget\":\"$1\",\"BootSourceOverrideEnabled\":\"${2:-Once}\"}}" "$S" ;;
  wait-power)
    end=$(( $(date +%s) + ${2:-30} ))
    while [ "$(date +%s)" -lt "$end" ]; do
      [ "$(field 'd["PowerState"]' 2>/dev/null)" = "$1" ] && { echo "$1"; exit 0; }
      sleep 0.5
    done
    echo "timeout: PowerState is $(field 'd["PowerState"]')" >&2; exit 1 ;;
  *) echo "unknown command $CMD" >&2; exit 2 ;;
esac
