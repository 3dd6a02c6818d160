#!/usr/bin/env bash
# Builds a whole-disk Debian 12 (bookworm) image for pxed's image-based deploy.
#
#   images/build/debian-12.sh [--arch amd64|arm64] [--out DIR] [--cache DIR] [--force] [--verify]
#
# Output in DIR (default images/cache under the repo):
#   debian-12-<arch>.raw.zst   the raw GPT disk, zstd-compressed
#   debian-12-<arch>.json      manifest: sizes and sha256 of the raw disk and of the .zst,
#                              root_partition, recipe_sha256 (hash of this script)
# Disk: p1 = EFI system partition (FAT, 64 MiB) holding \EFI\BOOT\BOOT{X64,AA64}.EFI, a
# grub-mkstandalone image with an embedded grub.cfg; p2 = ext4 root, the last partition so
# the deploy agent can grow it. Nothing is mounted: the ESP is filled with mtools, the root
# with `mke2fs -d` (this host has no vfat module and no udev).
#
# A second run with the same script content skips the build (recipe_sha256 in the manifest);
# debootstrap's .debs stay in --cache (default /var/cache/pxed-images) so a rebuild
# downloads nothing. --verify boots the result in QEMU/OVMF (TCG) and waits for `login:`.
#
# Reproducibility: SOURCE_DATE_EPOCH is fixed below, and so are the filesystem UUIDs, the GPT
# disk and partition GUIDs, the FAT serial and the ext4 hash seed; file mtimes in the root
# are clamped to SOURCE_DATE_EPOCH and mkfs.vfat runs with --invariant. What still varies
# between two builds: the package versions the mirror serves that day (bookworm point
# releases), inode ctimes and the order mke2fs allocates inodes in (it follows readdir on
# the build host), dpkg/debconf state files that record times, the initramfs (cpio of files
# whose ctimes vary), and the memdisk tarball inside the GRUB EFI image.
set -euo pipefail

SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1717200000} # 2024-06-01T00:00:00Z
export SOURCE_DATE_EPOCH
export MTOOLS_SKIP_CHECK=1
# Fixed identifiers: the embedded grub.cfg and fstab find the root by these.
ROOT_UUID=0f3a6b2e-5d1c-4e8a-9b7f-2c4d6e8fa001
ESP_SERIAL=5E1D0001          # FAT volume id, seen by Linux as 5E1D-0001
DISK_GUID=0f3a6b2e-5d1c-4e8a-9b7f-2c4d6e8fa000
ESP_PARTUUID=0f3a6b2e-5d1c-4e8a-9b7f-2c4d6e8fa011
ROOT_PARTUUID=0f3a6b2e-5d1c-4e8a-9b7f-2c4d6e8fa012
ESP_MIB=64
SUITE=bookworm
NAME=debian-12
ROOT_PARTITION=2

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
script_path="$here/$(basename "${BASH_SOURCE[0]}")"

arch=amd64
out="$repo/images/cache"
cache=/var/cache/pxed-images
force=0
verify=0

usage() {
  sed -n '2,/^set -euo/p' "$script_path" | sed '$d; s/^# \{0,1\}//'
  exit "${1:-0}"
}
die() { echo "debian-12.sh: $*" >&2; exit 1; }
log() { echo "[$(date +%T)] $*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --arch) arch=${2:?}; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    --cache) cache=${2:?}; shift 2 ;;
    --force) force=1; shift ;;
    --verify) verify=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "unknown argument: $1" >&2; usage 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || die "must run as root (debootstrap, chroot)"

case "$arch" in
  amd64) efi_target=x86_64-efi; efi_name=BOOTX64.EFI; arch_json=x86_64
         root_type=4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709  # root-x86-64 (discoverable partitions)
         console=ttyS0; grub_pkg=grub-efi-amd64-bin ;;
  arm64) efi_target=arm64-efi; efi_name=BOOTAA64.EFI; arch_json=arm64
         root_type=B921B045-1DF0-41C3-AF44-4C6F280D3FAE  # root-arm64
         console=ttyAMA0; grub_pkg=grub-efi-arm64-bin ;;
  *) die "unsupported --arch $arch (amd64, arm64)" ;;
esac
mkdir -p "$out" "$cache"
out=$(cd "$out" && pwd)
cache=$(cd "$cache" && pwd)
base="$NAME-$arch"
manifest="$out/$base.json"
zst="$out/$base.raw.zst"
recipe_sha256=$(sha256sum "$script_path" | cut -d' ' -f1)

# --- host tools -------------------------------------------------------------------
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

mirror() {
  # The host's own Debian archive (deb822 or one-line sources), else deb.debian.org.
  local m
  m=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -n1 || true)
  [ -n "$m" ] || m=$(grep -hs '^deb ' /etc/apt/sources.list | grep -v -e security -e '\[' | awk '$3 ~ /^bookworm$/ {print $2}' | head -n1 || true)
  echo "${MIRROR:-${m:-http://deb.debian.org/debian}}"
}

# --- QEMU boot check -------------------------------------------------------------------
verify_image() {
  [ "$arch" = amd64 ] || { log "verify: only amd64 is booted here"; return 0; }
  command -v qemu-system-x86_64 >/dev/null \
    || ensure_pkgs qemu-system-x86 \
    || die "verify needs qemu-system-x86 (install it, or match the installed qemu-utils version)"
  ensure_pkgs ovmf
  local vdir code vars qpid start t i port banner=""
  vdir=$(mktemp -d /var/tmp/pxed-verify.XXXXXX)
  code=/usr/share/OVMF/OVMF_CODE_4M.fd; vars=/usr/share/OVMF/OVMF_VARS_4M.fd
  [ -f "$code" ] || { code=/usr/share/OVMF/OVMF_CODE.fd; vars=/usr/share/OVMF/OVMF_VARS.fd; }
  cp "$vars" "$vdir/vars.fd"
  zstd -q -d -f "$zst" -o "$vdir/disk.raw"
  # sshd answering through QEMU's user network proves DHCP (networkd) and first-boot host keys.
  port=$((20000 + RANDOM % 20000))
  log "verify: booting $base in QEMU (TCG, OVMF); serial console in $vdir/console.log"
  start=$(date +%s)
  qemu-system-x86_64 -accel tcg -m 1024 -machine q35 \
    -drive "if=pflash,format=raw,readonly=on,file=$code" \
    -drive "if=pflash,format=raw,file=$vdir/vars.fd" \
    -drive "file=$vdir/disk.raw,format=raw,if=virtio" \
    -nic "user,model=virtio-net-pci,hostfwd=tcp:127.0.0.1:$port-:22" -nographic -serial mon:stdio \
    </dev/null >"$vdir/console.log" 2>&1 &
  qpid=$!
  t=""
  for ((i = 0; i < 300; i++)); do
    if grep -q 'login:' "$vdir/console.log"; then t=$(($(date +%s) - start)); break; fi
    kill -0 "$qpid" 2>/dev/null || break
    sleep 1
  done
  if [ -n "$t" ]; then
    for ((i = 0; i < 60; i++)); do
      banner=$(timeout 5 bash -c "exec 3<>/dev/tcp/127.0.0.1/$port && head -c 8 <&3" 2>/dev/null || true)
      [ "$banner" = SSH-2.0- ] && break
      sleep 1
    done
  fi
  kill "$qpid" 2>/dev/null || true
  wait "$qpid" 2>/dev/null || true
  if [ -z "$t" ]; then
    tail -n 40 "$vdir/console.log" >&2
    die "verify: no login prompt within 300 s (console log kept in $vdir)"
  fi
  log "verify: login prompt after ${t}s: $(grep -a -m1 -o '[^ ]* login:' "$vdir/console.log")"
  [ "$banner" = SSH-2.0- ] || die "verify: sshd did not answer on the guest's DHCP address (console log kept in $vdir)"
  log "verify: sshd answers (${banner}) after $(($(date +%s) - start))s"
  rm -rf "$vdir"
}

if [ "$force" = 0 ] && [ -f "$manifest" ] && [ -f "$zst" ] \
   && grep -q "\"recipe_sha256\":\"$recipe_sha256\"" "$manifest"; then
  log "$manifest is up to date (same recipe); --force rebuilds"
  [ "$verify" = 0 ] || verify_image
  exit 0
fi

t0=$(date +%s)
ensure_pkgs debootstrap mtools dosfstools grub-common zstd fdisk e2fsprogs debian-archive-keyring
# GRUB's modules for the target: the host package where it exists (grub-efi-arm64-bin is not
# in the amd64 archive), else taken from the target root, where debootstrap installs it.
grub_dir=/usr/lib/grub/$efi_target
if [ "$arch" = "$(dpkg --print-architecture)" ] || [ "$arch" = amd64 ]; then
  ensure_pkgs "$grub_pkg"
else
  grub_dir=""
fi
if [ "$arch" = arm64 ] && [ "$(dpkg --print-architecture)" != arm64 ]; then
  ensure_pkgs qemu-user-static binfmt-support
  if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc \
      || die "arm64: cannot mount binfmt_misc, so arm64 binaries cannot run in the chroot"
  fi
  update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] \
    || die "arm64: qemu-aarch64 is not registered with binfmt_misc (update-binfmts --enable qemu-aarch64 failed)"
fi

# --- work area and cleanup ---------------------------------------------------------
work=$(mktemp -d /var/tmp/pxed-image.XXXXXX)
root="$work/root"
mounts=()
cleanup() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount -l "${mounts[$i]}" 2>/dev/null || true; done
  # Never delete through a mount that is still there.
  if ! grep -q " $work/" /proc/mounts; then rm -rf "$work"; fi
}
trap cleanup EXIT
chroot_mount() {
  mount -t proc proc "$root/proc"; mounts+=("$root/proc")
  mount -t sysfs sysfs "$root/sys"; mounts+=("$root/sys")
  mount --bind /dev "$root/dev"; mounts+=("$root/dev")
  mount -t devpts devpts "$root/dev/pts" -o newinstance,ptmxmode=0666; mounts+=("$root/dev/pts")
}
chroot_umount() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount "${mounts[$i]}"; done
  mounts=()
}
in_root() { LC_ALL=C DEBIAN_FRONTEND=noninteractive chroot "$root" "$@"; }

# --- root filesystem -----------------------------------------------------------------
mirror_url=$(mirror)
debcache="$cache/debootstrap-$SUITE-$arch"
mkdir -p "$debcache"
pkgs=linux-image-$arch,systemd-sysv,systemd-resolved,dbus,openssh-server,curl,pciutils,ca-certificates,iproute2,e2fsprogs,initramfs-tools,kmod,netbase,usr-is-merged,zstd
[ -n "$grub_dir" ] || pkgs="$pkgs,$grub_pkg"
log "debootstrap $SUITE $arch from $mirror_url (debs cached in $debcache)"
if [ "$arch" = amd64 ] || [ "$(dpkg --print-architecture)" = "$arch" ]; then
  debootstrap --arch="$arch" --variant=minbase --include="$pkgs" --cache-dir="$debcache" \
    "$SUITE" "$root" "$mirror_url" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
else
  debootstrap --foreign --arch="$arch" --variant=minbase --include="$pkgs" --cache-dir="$debcache" \
    "$SUITE" "$root" "$mirror_url" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap --foreign failed"; }
  cp /usr/bin/qemu-aarch64-static "$root/usr/bin/"
  in_root /debootstrap/debootstrap --second-stage >>"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; die "arm64: debootstrap --second-stage under qemu-aarch64-static failed"; }
fi
log "debootstrap done in $(($(date +%s) - t0))s"

chroot_mount
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"; chmod +x "$root/usr/sbin/policy-rc.d"

cat >"$root/etc/apt/sources.list" <<EOF
deb http://deb.debian.org/debian $SUITE main
deb http://deb.debian.org/debian $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main
EOF
echo localhost >"$root/etc/hostname"
cat >"$root/etc/hosts" <<'EOF'
127.0.0.1	localhost
::1		localhost ip6-localhost ip6-loopback
ff02::1		ip6-allnodes
ff02::2		ip6-allrouters
EOF
cat >"$root/etc/fstab" <<EOF
# <file system>	<mount point>	<type>	<options>	<dump>	<pass>
UUID=$ROOT_UUID	/	ext4	errors=remount-ro	0	1
EOF
# No /boot/efi: the standalone GRUB reads /vmlinuz and /initrd.img from the root, so kernel
# updates never touch the ESP (and a vfat entry waited 10 s for its by-uuid link under TCG).

# Network: DHCP on every ethernet interface; wait-online returns once any of them is up
# (a server with one cabled port out of four must not wait two minutes).
cat >"$root/etc/systemd/network/80-dhcp.network" <<'EOF'
[Match]
Name=en* eth*

[Network]
DHCP=yes

[DHCPv4]
# The provisioning DHCP server knows nodes by MAC.
ClientIdentifier=mac
EOF
mkdir -p "$root/etc/systemd/system/systemd-networkd-wait-online.service.d"
cat >"$root/etc/systemd/system/systemd-networkd-wait-online.service.d/any.conf" <<'EOF'
[Service]
ExecStart=
ExecStart=/lib/systemd/systemd-networkd-wait-online --any --timeout=60
EOF
ln -sf ../run/systemd/resolve/stub-resolv.conf "$root/etc/resolv.conf"

# SSH host keys are per node: none in the image, generated on first boot before sshd.
rm -f "$root"/etc/ssh/ssh_host_*
cat >"$root/etc/systemd/system/ssh-hostkeys.service" <<'EOF'
[Unit]
Description=Generate SSH host keys on first boot
Before=ssh.service
ConditionPathExists=!/etc/ssh/ssh_host_ed25519_key

[Service]
Type=oneshot
ExecStart=/usr/bin/ssh-keygen -A
RemainAfterExit=yes

[Install]
WantedBy=multi-user.target ssh.service
EOF
in_root systemctl enable systemd-networkd.service systemd-networkd-wait-online.service \
  systemd-resolved.service ssh.service ssh-hostkeys.service >/dev/null 2>&1
in_root systemctl set-default multi-user.target >/dev/null 2>&1
# Root logs in only with the keys the deploy agent writes.
in_root passwd -l root >/dev/null

# Initramfs: every storage driver a target may boot from, whatever the build host has.
sed -i 's/^MODULES=.*/MODULES=most/' "$root/etc/initramfs-tools/initramfs.conf"
cat >>"$root/etc/initramfs-tools/modules" <<'EOF'
virtio_pci
virtio_blk
virtio_scsi
nvme
ahci
sd_mod
ext4
EOF
in_root update-initramfs -u -k all >"$work/initramfs.log" 2>&1 \
  || { tail -n 20 "$work/initramfs.log" >&2; die "update-initramfs failed"; }
if [ ! -e "$root/vmlinuz" ] || [ ! -e "$root/initrd.img" ]; then
  die "kernel symlinks /vmlinuz and /initrd.img missing in the root"
fi

if [ -z "$grub_dir" ]; then
  cp -a "$root/usr/lib/grub/$efi_target" "$work/grub-$efi_target"
  grub_dir="$work/grub-$efi_target"
  in_root dpkg --purge "$grub_pkg" >/dev/null
fi

# Per-node identity and build leftovers out.
rm -f "$root/usr/sbin/policy-rc.d"
: >"$root/etc/machine-id"
rm -f "$root/var/lib/dbus/machine-id" "$root/var/lib/systemd/random-seed"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
  "$root"/var/cache/debconf/*-old "$root"/var/lib/dpkg/*-old "$root"/tmp/* "$root"/var/tmp/* \
  "$root/debootstrap" "$root/usr/bin/qemu-aarch64-static"
find "$root/var/log" -type f -exec truncate -s 0 {} +
chroot_umount
find "$root" -xdev -newermt "@$SOURCE_DATE_EPOCH" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +

# --- boot loader -----------------------------------------------------------------------
cat >"$work/grub.cfg" <<EOF
set timeout=1
serial --unit=0 --speed=115200
terminal_input console serial
terminal_output console serial
insmod part_gpt
insmod ext2
search --no-floppy --fs-uuid --set=root $ROOT_UUID
menuentry 'Debian GNU/Linux 12' {
  linux /vmlinuz root=UUID=$ROOT_UUID ro console=tty0 console=$console,115200
  initrd /initrd.img
}
EOF
grub-mkstandalone -O "$efi_target" -d "$grub_dir" -o "$work/$efi_name" --locales= --fonts= --themes= \
  --install-modules="normal linux part_gpt part_msdos ext2 fat search search_fs_uuid serial terminal echo test configfile all_video efi_gop gzio sleep reboot halt ls cat" \
  --modules="part_gpt ext2 search_fs_uuid serial" \
  "boot/grub/grub.cfg=$work/grub.cfg"
touch -d "@$SOURCE_DATE_EPOCH" "$work/$efi_name"

# --- filesystems and disk ------------------------------------------------------------
mkfs.vfat --invariant -C -F 32 -i "$ESP_SERIAL" -n ESP "$work/esp.img" $((ESP_MIB * 1024)) >/dev/null
mmd -i "$work/esp.img" ::/EFI ::/EFI/BOOT
mcopy -m -i "$work/esp.img" "$work/$efi_name" "::/EFI/BOOT/$efi_name"

# Root size: what the tree uses plus 25 % and 256 MiB free for the first boot (the agent
# grows the partition and the filesystem to the whole disk anyway).
used_mib=$(du -s -m -x "$root" | cut -f1)
root_mib=$(((used_mib * 5 / 4 + 256 + 63) / 64 * 64))
log "root tree ${used_mib} MiB -> ext4 ${root_mib} MiB"
E2FSPROGS_FAKE_TIME=$SOURCE_DATE_EPOCH mke2fs -q -F -t ext4 -d "$root" -U "$ROOT_UUID" -L root \
  -E "hash_seed=$ROOT_UUID,root_owner=0:0" "$work/root.img" "${root_mib}M"

disk="$work/disk.raw"
total_mib=$((1 + ESP_MIB + root_mib + 1)) # 1 MiB for the primary GPT, 1 MiB for the backup
truncate -s "${total_mib}M" "$disk"
sfdisk -q "$disk" <<EOF
label: gpt
label-id: $DISK_GUID
first-lba: 2048
start=2048, size=$((ESP_MIB * 2048)), type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, uuid=$ESP_PARTUUID, name="esp"
start=$((2048 + ESP_MIB * 2048)), size=$((root_mib * 2048)), type=$root_type, uuid=$ROOT_PARTUUID, name="root"
EOF
dd if="$work/esp.img" of="$disk" bs=1M seek=1 conv=notrunc,sparse status=none
dd if="$work/root.img" of="$disk" bs=1M seek=$((1 + ESP_MIB)) conv=notrunc,sparse status=none

# --- compress and manifest -----------------------------------------------------------
# -T0 -12: about a minute on two shared cores; -19 costs several minutes for ~10 % less.
log "compressing"
zstd -q -T0 -"${ZSTD_LEVEL:-12}" -f "$disk" -o "$work/$base.raw.zst"
raw_size=$(stat -c %s "$disk")
raw_sha256=$(sha256sum "$disk" | cut -d' ' -f1)
file_size=$(stat -c %s "$work/$base.raw.zst")
file_sha256=$(sha256sum "$work/$base.raw.zst" | cut -d' ' -f1)
mv -f "$work/$base.raw.zst" "$zst"
printf '{"name":"%s","arch":"%s","raw_size":%s,"raw_sha256":"%s","file":"%s","file_size":%s,"file_sha256":"%s","root_partition":%s,"recipe_sha256":"%s"}\n' \
  "$NAME" "$arch_json" "$raw_size" "$raw_sha256" "$base.raw.zst" "$file_size" "$file_sha256" \
  "$ROOT_PARTITION" "$recipe_sha256" >"$manifest.tmp"
mv -f "$manifest.tmp" "$manifest"
log "built $zst ($file_size bytes, raw $raw_size bytes) in $(($(date +%s) - t0))s"
cat "$manifest"
[ "$verify" = 0 ] || verify_image
