#!/usr/bin/env bash
# Builds a local Debian 12 mirror for debian-installer from the Debian archive, as far as
# the archive reachable from here has it:
#
#   lab/di-mirror.sh --out DIR [--archive URL]
#
# DIR/debian/ then holds
#   dists/bookworm/{InRelease,Release,Release.gpg}             (signed, as published)
#   dists/bookworm/main/binary-amd64/{Release,Packages.xz}    (choose-mirror checks the
#                                                              Release; debootstrap reads
#                                                              the index)
#   dists/bookworm/main/i18n/Translation-en.xz               (apt in the target wants it)
#   dists/bookworm/main/debian-installer/binary-amd64/Packages.{gz,xz}
#   dists/bookworm/main/installer-amd64/current/images/netboot/debian-installer/amd64/
#       {linux,initrd.gz}   from the debian-installer-12-netboot-amd64 package (the
#                           archive's own installer-amd64 tree is not reachable here)
#   pool/...                every installer udeb the index names that the archive serves
# The archive lacks most bookworm installer udebs (finish-install, partman-*, ...): they
# stay missing here too, so an install from this mirror stops where debian-installer
# first needs one of them. Cached: a second run with the same signed Release is a no-op.
set -euo pipefail
OUT='' ARCHIVE=${DEBIAN_ARCHIVE:-http://deb.debian.org/debian}
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift ;;
    --archive) ARCHIVE=$2; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$OUT" ] || { echo "usage: $0 --out DIR [--archive URL]" >&2; exit 2; }
D=$OUT/debian S=bookworm
DI=$D/dists/$S/main/debian-installer/binary-amd64
IMG=$D/dists/$S/main/installer-amd64/current/images/netboot/debian-installer/amd64
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

curl -fsS -o "$tmp/Release" "$ARCHIVE/dists/$S/Release"
if [ -f "$OUT/.complete" ] && cmp -s "$tmp/Release" "$D/dists/$S/Release" \
   && [ -s "$IMG/linux" ] && [ -s "$IMG/initrd.gz" ] && [ -s "$D/dists/$S/main/binary-amd64/Release" ] \
   && [ -s "$D/dists/$S/main/binary-amd64/Packages.xz" ] && [ -s "$D/dists/$S/main/i18n/Translation-en.xz" ]; then
  echo "di-mirror: up to date in $OUT ($(cat "$OUT/.complete"))"
  exit 0
fi
rm -f "$OUT/.complete"
mkdir -p "$D/dists/$S" "$DI" "$IMG"
for f in InRelease Release Release.gpg; do
  curl -fsS -o "$D/dists/$S/$f" "$ARCHIVE/dists/$S/$f"
done
mkdir -p "$D/dists/$S/main/binary-amd64"
for f in binary-amd64/Release binary-amd64/Packages.xz i18n/Translation-en.xz; do
  mkdir -p "$(dirname "$D/dists/$S/main/$f")"
  curl -fsS -o "$D/dists/$S/main/$f" "$ARCHIVE/dists/$S/main/$f"
done
for f in Packages.gz Packages.xz; do
  curl -fsS -o "$DI/$f" "$ARCHIVE/dists/$S/main/debian-installer/binary-amd64/$f" || rm -f "$DI/$f"
done
[ -s "$DI/Packages.gz" ] || { echo "di-mirror: no installer index in $ARCHIVE" >&2; exit 1; }
# The index must be the one the signed Release names (debian-installer checks it).
want=$(awk '/^SHA256:/{s=1; next} /^[^ ]/{s=0} s && $3=="main/debian-installer/binary-amd64/Packages.gz"{print $1}' "$D/dists/$S/Release")
got=$(sha256sum "$DI/Packages.gz" | cut -d' ' -f1)
[ "$want" = "$got" ] || { echo "di-mirror: Packages.gz does not match Release ($got vs $want)" >&2; exit 1; }

# Kernel and initrd: the netboot package of the same point release.
(cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root debian-installer-12-netboot-amd64 >/dev/null)
dpkg-deb -x "$tmp"/debian-installer-12-netboot-amd64_*.deb "$tmp/x"
cp "$tmp/x/usr/lib/debian-installer/images/12/amd64/text/debian-installer/amd64/linux" \
   "$tmp/x/usr/lib/debian-installer/images/12/amd64/text/debian-installer/amd64/initrd.gz" "$IMG/"
rm -rf "$tmp/x" "$tmp"/*.deb

# Every udeb the index names, fetched in parallel; what the archive does not serve stays out.
zcat "$DI/Packages.gz" | awk '/^Filename: /{print $2}' | sort -u > "$tmp/files"
: > "$tmp/curl.cfg"
while read -r f; do
  [ -s "$D/$f" ] && continue
  printf 'url = "%s/%s"\noutput = "%s/%s"\n' "$ARCHIVE" "$f" "$D" "$f" >> "$tmp/curl.cfg"
done < "$tmp/files"
if [ -s "$tmp/curl.cfg" ]; then
  curl -sS --fail --create-dirs --parallel --parallel-max 16 -K "$tmp/curl.cfg" 2> "$tmp/curl.err" || true
fi
have=0 missing=0
while read -r f; do
  if [ -s "$D/$f" ]; then have=$((have+1)); else missing=$((missing+1)); fi
done < "$tmp/files"
summary="$have udebs, $missing named by the index but not served by $ARCHIVE"
echo "$summary" > "$OUT/.complete"
echo "di-mirror: $OUT: $summary; installer $(du -sh "$IMG" | cut -f1)"
