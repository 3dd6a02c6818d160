#!/usr/bin/env bash
# Fetches iPXE binaries from Debian trixie's `ipxe` package (1.21.1, arch all) into $1
# (default: ipxe/bin beside this script) through a private apt configuration, so the
# system's own sources are left untouched. The .deb is verified by apt against
# Debian's archive keyring.
set -euo pipefail
out=${1:-$(dirname "$0")/bin}; mkdir -p "$out"
[ -f "$out/snponly.efi" ] && [ -f "$out/ipxe-arm64.efi" ] && exit 0
A=$(mktemp -d); trap 'rm -rf "$A"' EXIT
mkdir -p "$A/lists/partial" "$A/archives/partial"
URI=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$URI" ] || URI=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list)
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $URI trixie main" > "$A/sources.list"
O=(-o Dir::Etc::sourcelist="$A/sources.list" -o Dir::Etc::sourceparts=/dev/null
   -o Dir::State::Lists="$A/lists" -o Dir::Cache::Archives="$A/archives")
apt-get "${O[@]}" update -qq
(cd "$A" && apt-get "${O[@]}" download ipxe >/dev/null)
dpkg-deb -x "$A"/ipxe_*.deb "$A/x"
cp "$A"/x/usr/lib/ipxe/{undionly.kpxe,snponly.efi,ipxe-amd64.efi,ipxe-arm64.efi} "$out"/
ls -l "$out"
