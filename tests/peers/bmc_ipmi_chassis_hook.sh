#!/bin/sh
# ipmi_sim chassis_control hook for the BMC integration tests.
# ipmi_sim runs: <hook> <state-dir> <mc> get <param...> | <hook> <state-dir> <mc> set <param> <value> ...
# Faults: a file `fault-power-stuck` in the state dir drops power changes, `fault-boot-ignored` drops boot changes.
D=$1; shift
echo "$(date +%T.%N) $*" >> "$D/chassis.log"
mc=$1; op=$2; shift 2
if [ "$op" = get ]; then
  for p in "$@"; do case $p in
    power) echo "power:$(cat "$D/power" 2>/dev/null || echo 0)";;
    boot) echo "boot:$(cat "$D/boot" 2>/dev/null || echo default)";;
  esac; done
else
  while [ $# -gt 0 ]; do case $1 in
    power) [ -e "$D/fault-power-stuck" ] || echo "$2" > "$D/power"; shift 2;;
    boot) [ -e "$D/fault-boot-ignored" ] || echo "$2" > "$D/boot"; shift 2;;
    *) shift 2;;
  esac; done
fi
exit 0
