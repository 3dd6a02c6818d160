#!/usr/bin/env bash
# Builds pxed's deploy ramdisk: a Debian kernel and a busybox initrd that brings up the
# network and runs `pxed agent deploy`.
#
#   images/build/deploy-ramdisk.sh --pxed PATH [--arch amd64] [--out DIR] [--cache DIR] [--force] [--verify]
#
# Output in DIR (default images/cache under the repo):
#   deploy-<arch>/kernel         Debian bookworm's vmlinuz (linux-image-<arch>, fetched with
#                                `apt-get download`, never installed on this host)
#   deploy-<arch>/initrd         zstd newc cpio: busybox-static, the kernel modules below,
#                                util-linux/e2fsprogs/gdisk tools with their libraries,
#                                /usr/bin/pxed (stripped) with its libraries, /init
#   deploy-<arch>/manifest.json  sizes, sha256s, kernel version, recipe and pxed hashes
#
# Kernel command line read by /init:
#   pxed.selftest=1        run every tool once, print PXED-SELFTEST PASS/FAIL, power off (CI)
#   pxed.modules=a,b       extra modules to load after the built-in list
# and by the agent itself (from /proc/cmdline): pxed.url=  pxed.token=
#
# A second run skips the build when the script and the pxed binary are unchanged.
# --verify boots the result under QEMU (TCG) twice: once with pxed.selftest=1, once normally.
set -euo pipefail

SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1717200000} # 2024-06-01T00:00:00Z
export SOURCE_DATE_EPOCH
SUITE=bookworm
# Loaded in this order by /init; modprobe pulls in each one's dependencies.
MODULES=(virtio_pci virtio_net virtio_blk virtio_scsi e1000 e1000e igb ixgbe
         nvme ahci sd_mod crc32c_generic ext4)
# Tools the agent shells out to; busybox provides everything else (mount, ip, udhcpc, ...).
TOOLS=(sfdisk wipefs blkid blockdev e2fsck resize2fs tune2fs sgdisk)

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
script_path="$here/$(basename "${BASH_SOURCE[0]}")"

arch=amd64
out="$repo/images/cache"
cache=/var/cache/pxed-images
pxed=""
force=0
verify=0

usage() {
  sed -n '2,/^set -euo/p' "$script_path" | sed '$d; s/^# \{0,1\}//'
  exit "${1:-0}"
}
die() { echo "deploy-ramdisk.sh: $*" >&2; exit 1; }
log() { echo "[$(date +%T)] $*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --pxed) pxed=${2:?}; shift 2 ;;
    --arch) arch=${2:?}; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    --cache) cache=${2:?}; shift 2 ;;
    --force) force=1; shift ;;
    --verify) verify=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "unknown argument: $1" >&2; usage 2 ;;
  esac
done
[ -n "$pxed" ] || { echo "--pxed PATH is required" >&2; usage 2; }
[ -x "$pxed" ] || die "$pxed is not an executable"
[ "$(id -u)" = 0 ] || die "must run as root (apt-get download, device nodes in the cpio)"
host_arch=$(dpkg --print-architecture)
case "$arch" in
  amd64) ;;
  arm64) die "arm64: the ramdisk copies this host's binaries and libraries (busybox, util-linux, pxed), so it must be built on an arm64 host; this host is $host_arch" ;;
  *) die "unsupported --arch $arch" ;;
esac
[ "$arch" = "$host_arch" ] || die "--arch $arch must match this host ($host_arch)"

mkdir -p "$out" "$cache"
out=$(cd "$out" && pwd)
cache=$(cd "$cache" && pwd)
dest="$out/deploy-$arch"
manifest="$dest/manifest.json"
recipe_sha256=$(sha256sum "$script_path" | cut -d' ' -f1)
pxed_sha256=$(sha256sum "$pxed" | cut -d' ' -f1)

ensure_pkgs() {
  local missing=() p
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]}"
  if [ ! -f /var/lib/pxed-images.apt-updated ]; then
    apt-get update -qq && touch /var/lib/pxed-images.apt-updated
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

# --- QEMU boot check -------------------------------------------------------------------
# boot_qemu NAME APPEND SECONDS PATTERN...: boots the kernel+initrd with a blank virtio disk
# and waits until every PATTERN is on the serial console (or QEMU exits / time runs out).
boot_qemu() {
  local name=$1 append=$2 secs=$3 vdir qpid start i p ok
  shift 3
  vdir=$(mktemp -d /var/tmp/pxed-verify.XXXXXX)
  qemu-img create -q -f raw "$vdir/blank.raw" 2G
  start=$(date +%s)
  qemu-system-x86_64 -accel tcg -m 1024 -machine q35 -no-reboot \
    -kernel "$dest/kernel" -initrd "$dest/initrd" -append "$append" \
    -drive "file=$vdir/blank.raw,format=raw,if=virtio" \
    -nic user,model=virtio-net-pci -nographic -serial mon:stdio \
    </dev/null >"$vdir/console.log" 2>&1 &
  qpid=$!
  for ((i = 0; i < secs; i++)); do
    ok=1
    for p in "$@"; do grep -aq -e "$p" "$vdir/console.log" || { ok=0; break; }; done
    [ "$ok" = 1 ] && break
    kill -0 "$qpid" 2>/dev/null || break
    sleep 1
  done
  kill "$qpid" 2>/dev/null || true
  wait "$qpid" 2>/dev/null || true
  grep -a -e '^pxed-ramdisk' -e 'PXED-SELFTEST' -e '^pxed' -e '^error' -e '^Usage' "$vdir/console.log" >&2 || true
  if [ "$ok" != 1 ]; then
    tail -n 30 "$vdir/console.log" >&2
    die "verify $name: '$p' not seen within ${secs}s (console log kept in $vdir/console.log)"
  fi
  log "verify $name: ok after $(($(date +%s) - start))s"
  rm -rf "$vdir"
}
verify_ramdisk() {
  command -v qemu-system-x86_64 >/dev/null \
    || ensure_pkgs qemu-system-x86 \
    || die "verify needs qemu-system-x86 (install it, or match the installed qemu-utils version)"
  command -v qemu-img >/dev/null || ensure_pkgs qemu-utils
  boot_qemu selftest 'console=ttyS0 pxed.selftest=1' 180 'PXED-SELFTEST PASS' 'reboot: Power down'
  boot_qemu agent 'console=ttyS0 pxed.url=http://10.0.2.2:1 pxed.token=x' 180 \
    'modules loaded' 'pxed-ramdisk: eth[0-9]* address' 'pxed-ramdisk: starting' 'pxed-ramdisk: pxed exited'
}

if [ "$force" = 0 ] && [ -f "$manifest" ] && [ -f "$dest/kernel" ] && [ -f "$dest/initrd" ] \
   && grep -q "\"recipe_sha256\":\"$recipe_sha256\"" "$manifest" \
   && grep -q "\"pxed_sha256\":\"$pxed_sha256\"" "$manifest"; then
  log "$dest is up to date (same recipe and pxed); --force rebuilds"
  [ "$verify" = 0 ] || verify_ramdisk
  exit 0
fi

t0=$(date +%s)
ensure_pkgs cpio zstd kmod binutils fdisk util-linux e2fsprogs gdisk

work=$(mktemp -d /var/tmp/pxed-ramdisk.XXXXXX)
trap 'rm -rf "$work"' EXIT
ird="$work/initrd"

# --- kernel and busybox, downloaded, never installed on the host ------------------------
debs="$cache/debs-$SUITE-$arch"
mkdir -p "$debs"
kpkg=$(apt-cache depends "linux-image-$arch" | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
[ -n "$kpkg" ] || { apt-get update -qq; kpkg=$(apt-cache depends "linux-image-$arch" | awk '/Depends: linux-image-[0-9]/ {print $2; exit}'); }
[ -n "$kpkg" ] || die "cannot resolve linux-image-$arch to a kernel package"
for p in "$kpkg" busybox-static; do
  if ! ls "$debs/${p}_"*.deb >/dev/null 2>&1; then
    log "apt-get download $p"
    (cd "$debs" && apt-get download -q -o APT::Sandbox::User=root "$p" >/dev/null)
  fi
done
kdeb=$(find "$debs" -name "${kpkg}_*.deb" | sort -V | tail -n1)
bdeb=$(find "$debs" -name "busybox-static_*.deb" | sort -V | tail -n1)
dpkg-deb -x "$kdeb" "$work/kernel"
dpkg-deb -x "$bdeb" "$work/busybox"
kver=$(basename "$(dirname "$(find "$work/kernel" -path '*/lib/modules/*/modules.builtin' | head -n1)")")
kmods=$(find "$work/kernel" -type d -path "*/lib/modules/$kver" | head -n1)
if [ -z "$kver" ] || [ ! -d "$kmods" ]; then die "no modules in $kdeb"; fi

mkdir -p "$ird"/{bin,sbin,usr/bin,usr/sbin,lib,lib64,etc,proc,sys,dev,run,tmp,root,var/run}
chmod 1777 "$ird/tmp"

# --- busybox with applet links --------------------------------------------------------
install -m 0755 "$work/busybox/bin/busybox" "$ird/bin/busybox"
for a in $("$ird/bin/busybox" --list-full); do
  [ -e "$ird/$a" ] || [ -L "$ird/$a" ] || ln -s /bin/busybox "$ird/$a"
done

# --- binaries with their shared libraries -----------------------------------------------
copy_lib() {
  # Keeps the path the dynamic loader asks for, with the real file's content.
  local lib=$1
  [ -e "$ird$lib" ] && return 0
  mkdir -p "$ird$(dirname "$lib")"
  cp -L "$lib" "$ird$lib"
}
copy_bin() {
  local src=$1 dst=$2 lib
  rm -f "$ird$dst"
  mkdir -p "$ird$(dirname "$dst")"
  cp -L "$src" "$ird$dst"
  for lib in $(ldd "$src" 2>/dev/null | grep -o '/[^ ]*' || true); do copy_lib "$lib"; done
}
for t in "${TOOLS[@]}"; do
  p=$(command -v "$t") || die "$t not found on this host"
  # The real tool replaces busybox's applet of the same name wherever busybox put it.
  rm -f "$ird/bin/$t" "$ird/sbin/$t" "$ird/usr/bin/$t" "$ird/usr/sbin/$t"
  copy_bin "$p" "/usr/sbin/$t"
done
copy_bin "$pxed" /usr/bin/pxed
strip --strip-unneeded "$ird/usr/bin/pxed"

# --- kernel modules ---------------------------------------------------------------------
depmod -b "$work/kernel" "$kver"
: >"$work/modules.list"
for m in "${MODULES[@]}"; do
  modprobe -d "$work/kernel" -S "$kver" --show-depends "$m" >>"$work/modules.list" \
    || die "module $m not found in $kpkg"
done
awk '$1 == "insmod" {print $2}' "$work/modules.list" | sort -u | while read -r ko; do
  rel=${ko#"$kmods"/}
  mkdir -p "$ird/lib/modules/$kver/$(dirname "$rel")"
  cp "$ko" "$ird/lib/modules/$kver/$rel"
done
cp "$kmods"/modules.{order,builtin,builtin.modinfo} "$ird/lib/modules/$kver/"
depmod -b "$ird" "$kver"
printf '%s\n' "${MODULES[@]}" >"$ird/etc/pxed-modules"

# --- configuration and /init ---------------------------------------------------------------
printf 'root:x:0:0:root:/root:/bin/sh\n' >"$ird/etc/passwd"
printf 'root:x:0:\n' >"$ird/etc/group"
printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost\n' >"$ird/etc/hosts"
printf 'hosts: files dns\n' >"$ird/etc/nsswitch.conf"

cat >"$ird/etc/udhcpc.script" <<'EOF'
#!/bin/sh
# udhcpc hook: address, default route and DNS from the lease.
case "$1" in
  deconfig)
    ip -4 addr flush dev "$interface"
    ip link set "$interface" up
    ;;
  bound|renew)
    ip -4 addr flush dev "$interface"
    ip addr add "$ip/${mask:-24}" dev "$interface"
    if [ -n "$router" ]; then
      ip route replace default via "${router%% *}" dev "$interface"
    fi
    if [ -n "$dns" ]; then
      : >/etc/resolv.conf
      for s in $dns; do echo "nameserver $s" >>/etc/resolv.conf; done
      [ -n "$domain" ] && echo "search $domain" >>/etc/resolv.conf
    fi
    # /init silences udhcpc itself; this line goes to the console.
    echo "pxed-ramdisk: $interface address $ip/${mask:-24} router ${router:-none} dns ${dns:-none}" >/dev/console
    ;;
esac
exit 0
EOF

cat >"$ird/init" <<'EOF'
#!/bin/sh
# pxed deploy ramdisk: modules, DHCP on every ethernet port, then `pxed agent deploy`.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=0755 tmpfs /run
echo "pxed-ramdisk: kernel $(uname -r), up $(cut -d' ' -f1 /proc/uptime)s"

selftest=0
extra=""
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    pxed.selftest=1) selftest=1 ;;
    pxed.modules=*) extra=$(echo "${arg#pxed.modules=}" | tr ',' ' ') ;;
  esac
done

loaded=""
for m in $(cat /etc/pxed-modules) $extra; do
  if modprobe "$m"; then loaded="$loaded $m"; else echo "pxed-ramdisk: modprobe $m failed"; fi
done
echo "pxed-ramdisk: modules loaded:$loaded"

# NIC drivers register their interfaces asynchronously: give them up to 5 s.
i=0
while [ $i -lt 50 ]; do
  for n in /sys/class/net/*; do [ "${n##*/}" != lo ] && [ -e "$n" ] && break 2; done
  sleep 0.1; i=$((i + 1))
done
ip link set lo up
ifaces=""
for n in /sys/class/net/*; do
  [ "$(cat "$n/type" 2>/dev/null)" = 1 ] || continue  # ARPHRD_ETHER only
  ifaces="$ifaces ${n##*/}"
  ip link set "${n##*/}" up
done
echo "pxed-ramdisk: ethernet interfaces:${ifaces:- none}"
# All ports at once: an unplugged port must not hold up the one that has a lease.
for ifc in $ifaces; do
  udhcpc -i "$ifc" -n -q -t 10 -s /etc/udhcpc.script >/dev/null 2>&1 \
    || echo "pxed-ramdisk: $ifc no DHCP lease" &
done
wait

if [ "$selftest" = 1 ]; then
  fail=""
  check() { name=$1; shift; if out=$("$@" 2>&1); then echo "pxed-selftest: $name ok: $(echo "$out" | head -n1)"; else echo "pxed-selftest: $name FAILED: $(echo "$out" | head -n2)"; fail="$fail $name"; fi; }
  # Full paths: this busybox runs its own applets (blockdev, ...) before searching PATH.
  check sfdisk /usr/sbin/sfdisk --version
  check wipefs /usr/sbin/wipefs --version
  check blkid /usr/sbin/blkid -V
  check blockdev /usr/sbin/blockdev --version
  check e2fsck /usr/sbin/e2fsck -V
  check resize2fs sh -c '/usr/sbin/resize2fs 2>&1 | grep "^resize2fs [0-9]"'
  check tune2fs sh -c '/usr/sbin/tune2fs 2>&1 | grep "^Usage: [^ ]*tune2fs"'
  check sgdisk /usr/sbin/sgdisk --version
  check pxed sh -c '/usr/bin/pxed --version || /usr/bin/pxed --help >/dev/null'
  check disk sh -c 'ls /sys/block | grep -E "^(vd|sd|nvme)"'
  check address sh -c 'ip -4 -o addr show scope global | grep inet'
  if [ -z "$fail" ]; then echo "PXED-SELFTEST PASS"; else echo "PXED-SELFTEST FAIL:$fail"; fi
  sync
  poweroff -f
fi

echo "pxed-ramdisk: starting pxed agent deploy (up $(cut -d' ' -f1 /proc/uptime)s)"
/usr/bin/pxed agent deploy
rc=$?
echo
echo "pxed-ramdisk: pxed exited with status $rc; the node was not deployed."
echo "pxed-ramdisk: a shell follows on this console (dmesg, ip addr, /proc/cmdline)."
while true; do
  setsid cttyhack sh
  sleep 1
done
EOF
chmod 0755 "$ird/init" "$ird/etc/udhcpc.script"
# The kernel opens /dev/console before devtmpfs is mounted.
mknod -m 0600 "$ird/dev/console" c 5 1

# --- pack ---------------------------------------------------------------------------------
find "$ird" -newermt "@$SOURCE_DATE_EPOCH" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
mkdir -p "$dest"
(cd "$ird" && find . | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0 --reproducible) \
  | zstd -q -T0 -19 >"$work/initrd.zst"
unpacked=$(du -s -k "$ird" | cut -f1)
install -m 0644 "$(find "$work/kernel" -path "*/boot/vmlinuz-$kver")" "$dest/kernel"
install -m 0644 "$work/initrd.zst" "$dest/initrd"
kernel_size=$(stat -c %s "$dest/kernel")
initrd_size=$(stat -c %s "$dest/initrd")
printf '{"name":"deploy","arch":"%s","kernel":"kernel","kernel_version":"%s","kernel_size":%s,"kernel_sha256":"%s","initrd":"initrd","initrd_size":%s,"initrd_sha256":"%s","pxed_sha256":"%s","recipe_sha256":"%s"}\n' \
  "x86_64" "$kver" "$kernel_size" "$(sha256sum "$dest/kernel" | cut -d' ' -f1)" \
  "$initrd_size" "$(sha256sum "$dest/initrd" | cut -d' ' -f1)" "$pxed_sha256" "$recipe_sha256" \
  >"$manifest.tmp"
mv -f "$manifest.tmp" "$manifest"
log "built $dest in $(($(date +%s) - t0))s: kernel $kernel_size bytes, initrd $initrd_size bytes (${unpacked} KiB unpacked)"
cat "$manifest"
[ "$verify" = 0 ] || verify_ramdisk
