#!/usr/bin/env bash
# Installs every tool the test suite and benchmarks use on a fresh Debian 12 machine.
# Idempotent: re-running it skips what is already there.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
PEERS_DIR=${PEERS_DIR:-/tmp/pxed-peers}

pkgs=(iproute2 dnsmasq-base isc-dhcp-client dhcpcd-base udhcpc busybox-static
      tftp-hpa atftp tftpd-hpa curl openipmi ipmitool kea-admin
      systemd python3-venv ca-certificates shellcheck cloud-init python3-jsonschema python3-yaml
      debconf openssl chromium ovmf qemu-efi-aarch64 ipxe-qemu
      debootstrap mtools dosfstools grub-efi-amd64-bin zstd fdisk e2fsprogs cpio kmod g++
      bsdutils pciutils slurm-wlm munge lldpd ethtool tcpdump
      postgresql)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  # policy-rc.d: package scripts would otherwise start tftpd-hpa on :69.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# QEMU: both system emulators from one release. The machine image ships qemu-utils
# from bookworm-backports, and a backports qemu-system-x86 cannot sit beside
# bookworm's qemu-system-arm (they share qemu-system-common): take both from backports
# where the archive has them, else both from bookworm.
if ! dpkg -s qemu-system-x86 >/dev/null 2>&1 || ! dpkg -s qemu-system-arm >/dev/null 2>&1; then
  bpo=$(mktemp -d)
  grep -h '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null > "$bpo/sources.list" || true
  if [ ! -s "$bpo/sources.list" ]; then
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main" > "$bpo/sources.list"
  fi
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm-backports main" >> "$bpo/sources.list"
  aptb=(apt-get -o Dir::Etc::sourcelist="$bpo/sources.list" -o Dir::Etc::sourceparts=- -o Dir::State::lists="$bpo/lists" -o APT::Sandbox::User=root)
  mkdir -p "$bpo/lists/partial"
  if "${aptb[@]}" update -qq && DEBIAN_FRONTEND=noninteractive "${aptb[@]}" install -y -qq --no-install-recommends \
       -t bookworm-backports qemu-system-x86 qemu-system-arm; then
    echo "qemu-system from bookworm-backports"
  else
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-system-x86 qemu-system-arm
  fi
  rm -rf "$bpo"
fi
# cloud-init is installed only for `cloud-init schema`; never let it act on this machine.
mkdir -p /etc/cloud && touch /etc/cloud/cloud-init.disabled

# Python peers: sushy-tools (Redfish emulator), pykickstart (ksvalidator), cloud-init (schema),
# websocket-client (tests/peers/cdp.py drives headless Chromium over the DevTools protocol).
venv=$PEERS_DIR/venv
if [ ! -x "$venv/bin/sushy-emulator" ] || [ ! -x "$venv/bin/ksvalidator" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q sushy-tools bcrypt pykickstart
fi
# prometheus-client: the tests parse /metrics with its text-format parser.
if ! "$venv/bin/python3" -c 'import prometheus_client' 2>/dev/null; then
  "$venv/bin/pip" install -q prometheus-client
fi
if ! "$venv/bin/python3" -c 'import websocket' 2>/dev/null; then
  "$venv/bin/pip" install -q websocket-client
fi

# iPXE binaries (Debian trixie's ipxe package, fetched without touching the system's sources).
if [ ! -f "$here/ipxe/bin/snponly.efi" ]; then
  bash "$here/ipxe/fetch.sh" "$here/ipxe/bin"
fi
# cargo-fuzz for fuzz/run.sh (libFuzzer targets; g++ above builds libfuzzer-sys).
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi
