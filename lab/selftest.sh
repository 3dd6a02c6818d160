#!/usr/bin/env bash
# Proves lab/controller.py end to end with one OVMF VM (TCG) behind sushy-tools' fake Redfish:
#   1. PATCH Boot Pxe/Once + Reset On  -> QEMU starts with network boot, the override is consumed,
#      dnsmasq sees a PXEClient DHCPDISCOVER from the VM's MAC; iPXE (snponly.efi) runs `reboot`
#      -> QEMU exits (guest-reset) -> the controller restarts it from the disk
#   2. Reset ForceOff                  -> QEMU gone, BMC power Off
#   3. Reset On (no override)          -> QEMU starts with disk boot (disk bootindex=0, NIC none)
#   4. ForceOff; PATCH Pxe + Reset On, iPXE runs `poweroff` -> guest-shutdown -> BMC power Off
# Everything runs in netns pxlabtest (bridge br0 10.98.0.1/24, tap pxlt0). Cleans up on any exit.
# Needs root, qemu-system-x86, ovmf, dnsmasq-base, curl, the sushy venv (.ci/install.sh).
# KEEP=1 keeps the work dir. SKIP_IPXE=1 skips the iPXE parts (reboot/poweroff by the guest).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
NS=pxlabtest TAP=pxlt0 MAC=52:54:00:98:00:11 UUID=98989898-0000-4000-8000-000000000011
MAC2=52:54:00:98:00:12 UUID2=98989898-0000-4000-8000-000000000012 UUID3=98989898-0000-4000-8000-000000000013 UUID4=98989898-0000-4000-8000-000000000014
W=$(mktemp -d /tmp/pxlab-selftest.XXXXXX)
LAB=$W/lab.json EV=$W/state/node1.events.jsonl DLOG=$W/dnsmasq.log
T0=$(date +%s.%N)
CPID='' DPID='' FAIL=0 PASSES=0

el() { printf '%6.1f' "$(echo "$(date +%s.%N) - $T0" | bc)"; }
say() { echo "[$(el)s] $*"; }
ok() { PASSES=$((PASSES+1)); say "PASS $*"; }
bad() { FAIL=$((FAIL+1)); say "FAIL $*"; }

cleanup() {
  rc=$?
  set +e
  if [ -n "$CPID" ] && kill -0 "$CPID" 2>/dev/null; then
    kill -TERM "$CPID"; for _ in $(seq 1 100); do kill -0 "$CPID" 2>/dev/null || break; sleep 0.1; done
  fi
  [ -f "$LAB" ] && python3 "$here/controller.py" stop --lab "$LAB" >/dev/null 2>&1
  [ -n "$DPID" ] && kill "$DPID" 2>/dev/null
  if [ "$FAIL" -gt 0 ] || [ "$rc" -ne 0 ]; then
    echo "---- controller output (tail)"; tail -n 30 "$W/controller.out" 2>/dev/null
    echo "---- console (tail)"; tail -c 2000 "$W/node1.console.log" 2>/dev/null | tr -d '\r' | tail -n 20
    echo "---- qemu log (tail)"; tail -n 10 "$W/state/node1.qemu.log" 2>/dev/null
  fi
  ip netns del "$NS" 2>/dev/null
  if [ -n "${KEEP:-}" ]; then echo "work dir kept: $W"; else rm -rf "$W"; fi
  echo "$PASSES passed, $FAIL failed"
  [ "$FAIL" -eq 0 ] && [ "$rc" -eq 0 ] || exit 1
}
trap cleanup EXIT
trap 'exit 130' INT TERM

command -v qemu-system-x86_64 >/dev/null && command -v dnsmasq >/dev/null && command -v curl >/dev/null \
  && [ -x /tmp/pxed-peers/venv/bin/sushy-emulator ] && [ -f /usr/share/OVMF/OVMF_CODE_4M.fd ] \
  || { echo "missing qemu-system-x86_64, dnsmasq, curl, ovmf or the sushy venv: run .ci/install.sh"; FAIL=1; exit 1; }

# ---- network: netns + bridge + tap
ip netns del "$NS" 2>/dev/null
ip netns add "$NS"
ip -n "$NS" link set lo up
ip -n "$NS" link add br0 type bridge
ip -n "$NS" addr add 10.98.0.1/24 dev br0
ip -n "$NS" link set br0 up
ip -n "$NS" tuntap add dev "$TAP" mode tap
ip -n "$NS" link set "$TAP" master br0 up
ip -n "$NS" tuntap add dev pxlt1 mode tap
ip -n "$NS" link set pxlt1 master br0 up

# ---- dnsmasq: DHCP + TFTP; UEFI PXE gets snponly.efi, iPXE then gets boot.ipxe
mkdir -p "$W/tftp"
IPXE_BIN=
for d in "$here/../ipxe/bin" /tmp/pxed-peers/ipxe-bin; do [ -f "$d/snponly.efi" ] && IPXE_BIN=$d && break; done
if [ -z "$IPXE_BIN" ] && [ -z "${SKIP_IPXE:-}" ]; then
  bash "$here/../ipxe/fetch.sh" /tmp/pxed-peers/ipxe-bin >/dev/null 2>&1 && IPXE_BIN=/tmp/pxed-peers/ipxe-bin
fi
[ -z "$IPXE_BIN" ] && SKIP_IPXE=1
[ -n "$IPXE_BIN" ] && cp "$IPXE_BIN/snponly.efi" "$W/tftp/"
printf '#!ipxe\necho PXLAB reboot\nreboot\n' > "$W/tftp/boot.ipxe"
ip netns exec "$NS" dnsmasq --no-daemon --port=0 --interface=br0 --bind-interfaces --no-ping \
  --dhcp-range=10.98.0.100,10.98.0.200,255.255.255.0,1h --dhcp-leasefile="$W/leases" --log-dhcp \
  --log-facility="$DLOG" --enable-tftp --tftp-root="$W/tftp" --dhcp-match=set:ipxe,175 \
  --dhcp-boot=tag:!ipxe,snponly.efi,,10.98.0.1 --dhcp-boot=tag:ipxe,boot.ipxe,,10.98.0.1 \
  --pid-file= > "$W/dnsmasq.out" 2>&1 &
DPID=$!

# ---- lab file + controller
cat > "$LAB" <<JSON
{
  "name": "selftest",
  "state_dir": "$W/state",
  "netns": "$NS",
  "redfish": {"host": "127.0.0.1", "port": 8000, "user": "admin", "password": "password"},
  "notify": {"host": "127.0.0.1", "port": 9999},
  "pxe_override": "once",
  "vms": [
    {"name": "node1", "uuid": "$UUID", "mac": "$MAC", "firmware": "ovmf",
     "disk": "$W/node1.qcow2", "disk_size": "1G", "tap": "$TAP", "memory": 512,
     "console": "$W/node1.console.log"},
    {"name": "node2", "uuid": "$UUID2", "mac": "$MAC2", "firmware": "seabios", "nic": "e1000",
     "disk": "$W/node2.raw", "disk_size": "64M", "tap": "pxlt1", "memory": 256},
    {"name": "node3", "uuid": "$UUID3", "mac": "52:54:00:98:00:13", "firmware": "ovmf",
     "disk": "$W/node3.qcow2", "disk_size": "64M", "tap": "pxlt-missing"},
    {"name": "node4", "uuid": "$UUID4", "mac": "52:54:00:98:00:14", "firmware": "ovmf",
     "disk": "$W/node4.qcow2", "disk_size": "64M", "tap": "pxlt0", "extra_args": ["-device", "no-such-device"]}
  ]
}
JSON
python3 "$here/controller.py" start --lab "$LAB" > "$W/controller.out" 2>&1 &
CPID=$!
for _ in $(seq 1 150); do [ -f "$W/state/ready" ] && break; kill -0 $CPID 2>/dev/null || break; sleep 0.2; done
[ -f "$W/state/ready" ] && ok "controller + sushy up" || { bad "controller did not come up"; exit 1; }

S=http://127.0.0.1:8000/redfish/v1/Systems/$UUID
rf() { ip netns exec "$NS" curl -s -u admin:password -H 'Content-Type: application/json' "$@"; }
power() { rf "$S" | python3 -c 'import sys,json;d=json.load(sys.stdin);print(d["PowerState"],d["Boot"]["BootSourceOverrideTarget"])'; }
reset() { rf -o /dev/null -w '%{http_code}' -X POST -d "{\"ResetType\":\"$1\"}" "$S/Actions/ComputerSystem.Reset"; }
pxe_once() { rf -o /dev/null -w '%{http_code}' -X PATCH \
  -d '{"Boot":{"BootSourceOverrideTarget":"Pxe","BootSourceOverrideEnabled":"Once","BootSourceOverrideMode":"UEFI"}}' "$S"; }
# count event-log lines matching a python predicate on the record r
evcount() { python3 -c 'import sys,json
n=0
for l in open(sys.argv[1]):
    r=json.loads(l)
    if eval(sys.argv[2]): n+=1
print(n)' "${EVF:-$EV}" "$1" 2>/dev/null || echo 0; }
# wait until cmd succeeds; $1 = timeout s
waitfor() { local t=$1; shift; local end=$(( $(date +%s) + t )); while [ "$(date +%s)" -lt "$end" ]; do "$@" && return 0; sleep 0.5; done; return 1; }
qemu_pid() { cat "$W/state/node1.qemu.pid.ctl" 2>/dev/null; }
qemu_running() { local p; p=$(qemu_pid); [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }
ev_ge() { [ "$(evcount "$1")" -ge "$2" ]; }
disc_count() { grep -ci "DHCPDISCOVER(br0) $MAC" "$DLOG" 2>/dev/null || true; }
pxeclient_seen() { grep -q "vendor class: PXEClient" "$DLOG" 2>/dev/null && [ "$(disc_count)" -ge "${1:-1}" ]; }
power_is() { [ "$(power | cut -d' ' -f1)" = "$1" ]; }

# ---- 1: one-time network boot
say "step 1: PATCH Pxe/Once -> $(pxe_once); Reset On -> $(reset On)"; t1=$(date +%s.%N)
if waitfor 20 ev_ge 'r.get("action")=="start" and r.get("boot")=="network"' 1; then
  ok "controller started QEMU with network boot after $(echo "$(date +%s.%N) - $t1" | bc | cut -c1-5) s (sushy applies power 1-11 s late)"
else bad "no network start in the event log"; fi
cmd=$(tr '\0' ' ' < "/proc/$(qemu_pid)/cmdline" 2>/dev/null)
case "$cmd" in *"mac=$MAC,romfile=,bootindex=0"*"bootindex=1"*) ok "QEMU: NIC bootindex=0, disk bootindex=1";; *) bad "unexpected QEMU command: $cmd";; esac
[ "$(power)" = "On Hdd" ] && ok "BMC: power On, override consumed (target Hdd)" || bad "BMC says '$(power)', want 'On Hdd'"
if waitfor 90 pxeclient_seen 1; then
  ok "dnsmasq saw a PXEClient DHCPDISCOVER from $MAC $(echo "$(date +%s.%N) - $t1" | bc | cut -c1-5) s after Reset On"
else bad "no PXE DHCPDISCOVER from $MAC"; fi
if [ -z "${SKIP_IPXE:-}" ]; then
  # iPXE fetches boot.ipxe and reboots: the controller must restart QEMU from the disk
  if waitfor 90 ev_ge 'r.get("action")=="start" and r.get("reason")=="guest-reset" and r.get("boot")=="disk"' 1; then
    ok "guest reboot -> QEMU restarted from disk $(echo "$(date +%s.%N) - $t1" | bc | cut -c1-5) s after Reset On"
  else bad "no disk restart after the guest rebooted"; fi
  printf '#!ipxe\necho PXLAB idle\nsleep 600\n' > "$W/tftp/boot.ipxe"   # no more reboots from a PXE fallback
  [ "$(evcount 'r.get("action")=="exited" and r.get("qemu_reason")=="guest-reset"')" = 1 ] && ok "QMP SHUTDOWN reason guest-reset seen once" || bad "guest-reset not logged once"
fi

# ---- 2: ForceOff
say "step 2: Reset ForceOff -> $(reset ForceOff)"; t2=$(date +%s.%N)
if waitfor 20 ev_ge 'r.get("action")=="stop" and r.get("why")=="power-off"' 1 && ! qemu_running; then
  ok "QEMU stopped $(echo "$(date +%s.%N) - $t2" | bc | cut -c1-5) s after ForceOff ($(grep '"stop"' "$EV" | tail -1 | python3 -c 'import sys,json;print(json.load(sys.stdin)["how"])'))"
else bad "QEMU not stopped after ForceOff"; fi
power_is Off && ok "BMC power Off" || bad "BMC power '$(power)'"
pgrep -f "pxlab-node1" >/dev/null && bad "a QEMU process of node1 is still there" || ok "no QEMU process left"

# ---- 3: Reset On without override -> disk
d0=$(disc_count)
say "step 3: Reset On -> $(reset On)"; t3=$(date +%s.%N)
if waitfor 20 ev_ge 'r.get("action")=="start" and r.get("reason")=="power-on" and r.get("boot")=="disk"' 1; then
  ok "controller started QEMU with disk boot after $(echo "$(date +%s.%N) - $t3" | bc | cut -c1-5) s"
else bad "no disk start in the event log"; fi
cmd=$(tr '\0' ' ' < "/proc/$(qemu_pid)/cmdline" 2>/dev/null)
case "$cmd" in *"romfile=,bootindex"*) bad "NIC has a bootindex on a disk boot";; *"drive=d0,bootindex=0"*) ok "QEMU: disk bootindex=0, NIC without bootindex";; *) bad "unexpected QEMU command: $cmd";; esac
sleep "${DISK_WATCH:-25}"
say "console after ${DISK_WATCH:-25} s of disk boot: $(tr -d '\r' < "$W/node1.console.log" | grep -aoE 'BdsDxe: [^\n]*|Boot[0-9A-F]{4}[^\n]*' | tail -n 4 | tr '\n' '|')"
say "PXE DHCPDISCOVERs from $MAC during the disk boot (firmware fallback, informational): $(( $(disc_count) - d0 ))"
[ "$(evcount 'r.get("action")=="start" and r.get("boot")=="network"')" = 1 ] && ok "exactly one network boot so far" || bad "network boots: $(evcount 'r.get("boot")=="network" and r.get("action")=="start"')"
reset ForceOff >/dev/null
waitfor 20 power_is Off && ! qemu_running && ok "ForceOff again -> Off" || bad "second ForceOff"

# ---- 4: guest poweroff -> BMC Off
if [ -z "${SKIP_IPXE:-}" ]; then
  printf '#!ipxe\necho PXLAB poweroff\npoweroff\n' > "$W/tftp/boot.ipxe"
  say "step 4: PATCH Pxe/Once -> $(pxe_once); Reset On -> $(reset On)"; t4=$(date +%s.%N)
  if waitfor 120 ev_ge 'r.get("action")=="exited" and r.get("qemu_reason")=="guest-shutdown"' 1; then
    ok "guest poweroff seen (QMP guest-shutdown) $(echo "$(date +%s.%N) - $t4" | bc | cut -c1-5) s after Reset On"
  else bad "no guest-shutdown"; fi
  ev_ge 'r.get("action")=="bmc-force-off"' 1 && ok "controller sent ForceOff to the BMC" || bad "no bmc-force-off"
  waitfor 20 power_is Off && ok "BMC power Off after guest poweroff $(echo "$(date +%s.%N) - $t4" | bc | cut -c1-5) s" || bad "BMC power '$(power)'"
  sleep 1
  [ "$(evcount 'r.get("action")=="start"')" = 4 ] && ok "no restart after the poweroff (4 starts in all)" || bad "starts: $(evcount 'r.get("action")=="start"')"
  [ "$(evcount 'r.get("action")=="start" and r.get("boot")=="network"')" = 2 ] && ok "exactly two network boots (one per Pxe/Once)" || bad "network boots != 2"
fi

# ---- 5: SeaBIOS + iPXE ROM (e1000): network boot; iPXE runs boot.ipxe (`reboot`; this old ROM has no
#      poweroff) -> guest-reset -> restart from the disk (what SeaBIOS then does is in its debug log)
if [ -z "${SKIP_SEABIOS:-}" ]; then
  S1=$S; S=http://127.0.0.1:8000/redfish/v1/Systems/$UUID2; EVF=$W/state/node2.events.jsonl
  printf '#!ipxe\necho PXLAB reboot\nreboot\n' > "$W/tftp/boot.ipxe"
  say "step 5 (seabios): PATCH Pxe/Once Legacy -> $(rf -o /dev/null -w '%{http_code}' -X PATCH \
      -d '{"Boot":{"BootSourceOverrideTarget":"Pxe","BootSourceOverrideEnabled":"Once","BootSourceOverrideMode":"Legacy"}}' "$S"); Reset On -> $(reset On)"; t5=$(date +%s.%N)
  waitfor 20 ev_ge 'r.get("action")=="start" and r.get("boot")=="network"' 1 && ok "seabios VM started with network boot" || bad "seabios: no network start"
  if waitfor 60 bash -c "[ \$(grep -ci 'DHCPDISCOVER(br0) $MAC2' '$DLOG') -ge 1 ]"; then
    ok "dnsmasq saw a DHCPDISCOVER from the iPXE ROM ($MAC2) $(echo "$(date +%s.%N) - $t5" | bc | cut -c1-5) s after Reset On"
  else bad "seabios: no DHCPDISCOVER from $MAC2"; fi
  if [ -z "${SKIP_IPXE:-}" ]; then
    if waitfor 60 ev_ge 'r.get("action")=="start" and r.get("reason")=="guest-reset" and r.get("boot")=="disk"' 1; then
      ok "seabios: iPXE reboot -> restarted from disk $(echo "$(date +%s.%N) - $t5" | bc | cut -c1-5) s after Reset On"
    else bad "seabios: no disk restart"; fi
    printf '#!ipxe\necho PXLAB idle\nsleep 600\n' > "$W/tftp/boot.ipxe"
    sleep 12
    say "seabios firmware log, disk boot: $(grep -a -E '^Booting from|^Searching bootorder|^Boot failed|bootorder' "$W/state/node2.firmware.log" | tail -n 4 | tr '\n' '|')"
  fi
  reset ForceOff >/dev/null; waitfor 20 power_is Off && ok "seabios: ForceOff -> Off" || bad "seabios: still on"
  S=$S1; EVF=
fi

# ---- 6: QEMU that cannot start (tap missing) -> the BMC goes back Off
S1=$S; S=http://127.0.0.1:8000/redfish/v1/Systems/$UUID3; EVF=$W/state/node3.events.jsonl
say "step 6 (tap missing): Reset On -> $(reset On)"
waitfor 30 ev_ge 'r.get("action")=="bmc-force-off"' 1 && waitfor 20 power_is Off \
  && ok "start refused: $(grep '"start-failed"' "$EVF" | python3 -c 'import sys,json;print(json.loads(sys.stdin.readline())["detail"])'); BMC Off" \
  || bad "tap-missing VM not reported Off"
S=$S1; EVF=
S1=$S; S=http://127.0.0.1:8000/redfish/v1/Systems/$UUID4; EVF=$W/state/node4.events.jsonl
say "step 6b (QEMU exits at once: bad -device): Reset On -> $(reset On)"
waitfor 30 ev_ge 'r.get("action")=="bmc-force-off"' 1 && waitfor 20 power_is Off \
  && ok "QEMU failure reported: $(grep '"exited"' "$EVF" | python3 -c 'import sys,json;r=json.loads(sys.stdin.readline());print(r["why"], r.get("qemu_output",[""])[-1][:90])'); BMC Off" \
  || bad "crashing VM not reported Off"
S=$S1; EVF=

# ---- clean shutdown of the controller with a VM running
say "Reset On (disk) -> $(reset On)"; waitfor 20 qemu_running || bad "node1 not running"
st=$(python3 "$here/controller.py" status --lab "$LAB" | tr -d ' \n')
case "$st" in *'"node1":{"qemu_pid":'[0-9]*'"power":"On","target":"Hdd"'*) ok "status: $st";; *) bad "status: $st";; esac
kill -TERM "$CPID"; waitfor 20 bash -c "! kill -0 $CPID 2>/dev/null" && ok "controller exited on SIGTERM" || bad "controller still running"
CPID=
sleep 0.5
pgrep -f "$W/state" >/dev/null && bad "processes of the lab left: $(pgrep -af "$W/state")" || ok "no sushy/QEMU process left after SIGTERM"
[ "$(evcount 'r.get("why")=="controller shutdown"')" = 1 ] && ok "event log: stop on controller shutdown" || bad "no controller-shutdown stop"
say "notification payloads: $(wc -l < "$W/state/notifications.jsonl"); events node1: $(wc -l < "$EV")"
[ -n "${KEEP:-}" ] && cut -c1-240 "$EV"

# ---- 7: a crashed controller (SIGKILL) leaves sushy + QEMU: `stop --lab` removes them
python3 "$here/controller.py" start --lab "$LAB" >> "$W/controller.out" 2>&1 &
CPID=$!
waitfor 30 test -f "$W/state/ready" || bad "controller restart"
: > "$EV"
say "step 7: Reset On -> $(reset On)"; waitfor 20 qemu_running || bad "node1 not running"
{ kill -KILL "$CPID"; wait "$CPID"; } 2>/dev/null; sleep 0.5; CPID=
pgrep -f "$W/state" >/dev/null && ok "after SIGKILL of the controller: $(pgrep -f "$W/state" | wc -l) processes left" || bad "nothing left to clean?"
say "stop: $(python3 "$here/controller.py" stop --lab "$LAB")"
pgrep -f "$W/state" >/dev/null && bad "processes left after stop: $(pgrep -af "$W/state")" || ok "controller.py stop removed sushy and QEMU"
true
