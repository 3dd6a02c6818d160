#!/bin/sh
# udhcpc hook for the DHCP tests: records the environment of the `bound` event
# (ip, siaddr, boot_file, serverid, ...) in $UDHCPC_OUT instead of configuring eth0.
[ "$1" = bound ] || exit 0
env > "$UDHCPC_OUT.tmp" && mv "$UDHCPC_OUT.tmp" "$UDHCPC_OUT"
