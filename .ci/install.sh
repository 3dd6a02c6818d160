#!/usr/bin/env bash
# Installs every tool the test suite and benchmarks use on a fresh Debian 12 machine.
# Idempotent: re-running it skips what is already there.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
PEERS_DIR=${PEERS_DIR:-/tmp/pxed-peers}

pkgs=(iproute2 dnsmasq-base isc-dhcp-client dhcpcd-base udhcpc busybox-static
      tftp-hpa atftp tftpd-hpa curl openipmi ipmitool kea-admin
      systemd python3-venv ca-certificates shellcheck cloud-init python3-jsonschema python3-yaml
      debconf openssl chromium qemu-system-x86 ovmf qemu-system-arm qemu-efi-aarch64 ipxe-qemu)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  # policy-rc.d: package scripts would otherwise start tftpd-hpa on :69.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# cloud-init is installed only for `cloud-init schema`; never let it act on this machine.
mkdir -p /etc/cloud && touch /etc/cloud/cloud-init.disabled

# Python peers: sushy-tools (Redfish emulator), pykickstart (ksvalidator), cloud-init (schema).
venv=$PEERS_DIR/venv
if [ ! -x "$venv/bin/sushy-emulator" ] || [ ! -x "$venv/bin/ksvalidator" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q sushy-tools bcrypt pykickstart
fi

# iPXE binaries (Debian trixie's ipxe package, fetched without touching the system's sources).
if [ ! -f "$here/ipxe/bin/snponly.efi" ]; then
  bash "$here/ipxe/fetch.sh" "$here/ipxe/bin"
fi
