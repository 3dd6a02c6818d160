//! Disks: which one to deploy to, wiping signatures off every disk, the partition table
//! re-read, and growing the root partition and filesystem after the image is written.
//! Tools are the ramdisk's util-linux and e2fsprogs; their own words end up in errors.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::wire::DiskFact;

/// Zeroed at both ends of every disk: partition tables, the GPT backup header and RAID
/// superblocks at the end live there.
const END_ZERO: u64 = 1 << 20;
/// Longest tool output kept in an error (it goes into the failed report).
const MAX_OUTPUT: usize = 2000;

/// Why a disk step failed.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// Nothing to deploy to.
    #[error("no disk to deploy to (need a non-removable disk of nonzero size; found: {found})")]
    NoTarget {
        /// The disks seen, for the operator.
        found: String,
    },
    /// The plan or the command line named a disk this machine does not have.
    #[error("target disk {disk} not found (disks: {found})")]
    UnknownTarget {
        /// The disk asked for.
        disk: String,
        /// The disks seen.
        found: String,
    },
    /// The image does not fit.
    #[error("disk {disk} has {size} bytes, the image needs {need}")]
    TooSmall {
        /// The target.
        disk: String,
        /// Its size.
        size: u64,
        /// The raw image size.
        need: u64,
    },
    /// A tool failed.
    #[error("`{cmd}` failed ({status}): {output}")]
    Tool {
        /// The command line.
        cmd: String,
        /// Exit status.
        status: String,
        /// Its stdout and stderr.
        output: String,
    },
    /// Signatures were still found after the wipe.
    #[error("signatures left on {disk} after wipe: {found}")]
    Leftover {
        /// The disk.
        disk: String,
        /// What `wipefs` still reports.
        found: String,
    },
    /// A device node did not appear.
    #[error("{path} did not appear within {secs}s")]
    NoNode {
        /// The device path.
        path: String,
        /// How long we waited.
        secs: u64,
    },
    /// An I/O error on a device.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DiskError {
    let what = what.into();
    move |source| DiskError::Io { what, source }
}

fn summary(disks: &[DiskFact]) -> String {
    if disks.is_empty() {
        return "none".into();
    }
    disks
        .iter()
        .map(|d| {
            format!(
                "{} {}B{}",
                d.name,
                d.size,
                if d.removable { " removable" } else { "" }
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Preference of a disk kind when none is named: NVMe, then virtio, then SCSI/SATA.
fn rank(name: &str) -> u8 {
    if name.starts_with("nvme") {
        0
    } else if name.starts_with("vd") {
        1
    } else if name.starts_with("sd") {
        2
    } else {
        3
    }
}

/// The disk to deploy to, as `/dev/<name>`: the plan's choice, else the command line's,
/// else the first non-removable disk of nonzero size (NVMe, virtio, SCSI; then by name,
/// `sdz` before `sdaa`). A named disk must exist and have media.
pub fn choose_target(
    plan: Option<&str>,
    cmdline: Option<&str>,
    disks: &[DiskFact],
) -> Result<String, DiskError> {
    if let Some(want) = plan.or(cmdline) {
        let name = want.strip_prefix("/dev/").unwrap_or(want);
        return match disks.iter().find(|d| d.name == name) {
            Some(d) if d.size > 0 => Ok(format!("/dev/{}", d.name)),
            _ => Err(DiskError::UnknownTarget {
                disk: want.to_string(),
                found: summary(disks),
            }),
        };
    }
    disks
        .iter()
        .filter(|d| !d.removable && d.size > 0)
        .min_by_key(|d| (rank(&d.name), d.name.len(), d.name.as_str()))
        .map(|d| format!("/dev/{}", d.name))
        .ok_or_else(|| DiskError::NoTarget {
            found: summary(disks),
        })
}

/// Disks to wipe, by kernel name: every non-removable disk with media, and the target.
pub fn wipe_set(target: &str, disks: &[DiskFact]) -> Vec<String> {
    let target = target.strip_prefix("/dev/").unwrap_or(target);
    disks
        .iter()
        .filter(|d| (!d.removable && d.size > 0) || d.name == target)
        .map(|d| d.name.clone())
        .collect()
}

/// The device of partition `n` of `disk`: `/dev/vda` → `/dev/vda2`,
/// `/dev/nvme0n1` → `/dev/nvme0n1p2` (a `p` when the disk name ends in a digit).
pub fn partition_path(disk: &str, n: u32) -> String {
    if disk.ends_with(|c: char| c.is_ascii_digit()) {
        format!("{disk}p{n}")
    } else {
        format!("{disk}{n}")
    }
}

/// Runs a tool, logging it to the console; its output on success, else [`DiskError::Tool`].
/// `ok` decides which exit codes are success.
fn run_with(
    prog: &str,
    args: &[&str],
    stdin: Option<&str>,
    ok: impl Fn(i32) -> bool,
) -> Result<String, DiskError> {
    let cmd = std::iter::once(prog)
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ");
    eprintln!("pxed-agent: + {cmd}");
    let mut child = Command::new(prog)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io_err(format!("`{cmd}`")))?;
    if let (Some(input), Some(mut w)) = (stdin, child.stdin.take()) {
        w.write_all(input.as_bytes())
            .map_err(io_err(format!("`{cmd}` stdin")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(io_err(format!("`{cmd}`")))?;
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    let text = text.trim().to_string();
    match out.status.code() {
        Some(c) if ok(c) => Ok(text),
        _ => Err(DiskError::Tool {
            cmd,
            status: out.status.to_string(),
            output: truncate(&text),
        }),
    }
}

fn run(prog: &str, args: &[&str]) -> Result<String, DiskError> {
    run_with(prog, args, None, |c| c == 0)
}

fn truncate(s: &str) -> String {
    if s.len() <= MAX_OUTPUT {
        return s.to_string();
    }
    let mut end = MAX_OUTPUT;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// Wipes one disk: signatures of each partition, then of the disk, then zeroes the first
/// and last MiB, re-reads the partition table and checks `wipefs` finds nothing left.
pub fn wipe(sys: &Path, name: &str) -> Result<(), DiskError> {
    let dev = format!("/dev/{name}");
    for part in super::facts::partitions(sys, name) {
        let p = format!("/dev/{part}");
        if Path::new(&p).exists() {
            run("wipefs", &["--all", "--force", &p])?;
        }
    }
    run("wipefs", &["--all", "--force", &dev])?;
    zero_ends(&dev)?;
    reread_partitions(&dev)?;
    let left = run("wipefs", &["--no-act", "--noheadings", &dev])?;
    if !left.is_empty() {
        return Err(DiskError::Leftover {
            disk: dev,
            found: truncate(&left),
        });
    }
    Ok(())
}

/// Zeroes the first and last MiB of `dev` with direct (uncached) writes, then syncs.
fn zero_ends(dev: &str) -> Result<(), DiskError> {
    let f = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .or_else(|_| OpenOptions::new().write(true).open(dev))
        .map_err(io_err(format!("open {dev}")))?;
    let size = (&f)
        .seek(SeekFrom::End(0))
        .map_err(io_err(format!("size of {dev}")))?;
    // O_DIRECT wants a buffer aligned to the logical block size; 4096 covers every disk.
    let raw = vec![0u8; END_ZERO as usize + 4096];
    let off = raw.as_ptr().align_offset(4096);
    let buf = &raw[off..off + END_ZERO as usize];
    let mut at = vec![0];
    if size > END_ZERO {
        at.push(size.saturating_sub(END_ZERO).max(END_ZERO));
    }
    for start in at {
        let len = (size - start).min(END_ZERO) as usize;
        f.write_all_at(&buf[..len], start)
            .map_err(io_err(format!("zero {dev} at {start}")))?;
    }
    f.sync_all().map_err(io_err(format!("fsync {dev}")))
}

nix::ioctl_none!(blkrrpart, 0x12, 95);

/// Tells the kernel to re-read `dev`'s partition table (BLKRRPART), retrying while busy.
pub fn reread_partitions(dev: &str) -> Result<(), DiskError> {
    let f = File::open(dev).map_err(io_err(format!("open {dev}")))?;
    let mut tries = 0;
    loop {
        // SAFETY: BLKRRPART takes no argument; the fd is open for the call's duration.
        match unsafe { blkrrpart(f.as_raw_fd()) } {
            Ok(_) => return Ok(()),
            Err(nix::errno::Errno::EBUSY) if tries < 10 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(300));
            }
            Err(e) => {
                return Err(DiskError::Io {
                    what: format!("re-read partition table of {dev} (BLKRRPART)"),
                    source: e.into(),
                });
            }
        }
    }
}

/// Polls until `path` exists (devtmpfs creates partition nodes shortly after a re-read).
pub fn wait_for_node(path: &str, timeout: Duration) -> Result<(), DiskError> {
    let deadline = Instant::now() + timeout;
    while !Path::new(path).exists() {
        if Instant::now() >= deadline {
            return Err(DiskError::NoNode {
                path: path.to_string(),
                secs: timeout.as_secs(),
            });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Opens the target for writing the image, exclusively (fails if anything has it open or
/// mounted), and checks the image fits.
pub fn open_target(dev: &str, need: u64) -> Result<File, DiskError> {
    let mut f = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_EXCL)
        .open(dev)
        .map_err(io_err(format!("open {dev} exclusively")))?;
    let size = f
        .seek(SeekFrom::End(0))
        .map_err(io_err(format!("size of {dev}")))?;
    f.seek(SeekFrom::Start(0))
        .map_err(io_err(format!("seek {dev}")))?;
    if size < need {
        return Err(DiskError::TooSmall {
            disk: dev.to_string(),
            size,
            need,
        });
    }
    Ok(f)
}

/// Grows partition `n` of `disk` and its ext4 filesystem to the end of the disk: the GPT
/// backup header is moved to the real end first (the image was made for a smaller disk).
/// Returns the partition device.
pub fn grow(disk: &str, n: u32) -> Result<String, DiskError> {
    let dump = run("sfdisk", &["--dump", disk])?;
    if dump.lines().any(|l| l.trim() == "label: gpt") {
        run("sfdisk", &["--relocate", "gpt-bak-std", disk])?;
    }
    let num = n.to_string();
    run_with(
        "sfdisk",
        &["--no-reread", "-N", &num, disk],
        Some(", +\n"),
        |c| c == 0,
    )?;
    reread_partitions(disk)?;
    let part = partition_path(disk, n);
    if wait_for_node(&part, Duration::from_secs(3)).is_err() {
        // A kernel without this label's parser ignores BLKRRPART; partx adds the
        // partitions one by one (BLKPG).
        run("partx", &["--update", disk])?;
        wait_for_node(&part, Duration::from_secs(5))?;
    }
    // e2fsck: 1 = errors corrected, 2 = corrected and reboot wanted (it is not mounted).
    run_with("e2fsck", &["-f", "-p", &part], None, |c| c <= 2)?;
    run("resize2fs", &[&part])?;
    Ok(part)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(name: &str, size: u64, removable: bool) -> DiskFact {
        DiskFact {
            name: name.into(),
            size,
            removable,
            ..Default::default()
        }
    }

    #[test]
    fn target_choice() {
        let g = 1 << 30;
        let all = vec![
            disk("mmcblk0", g, false),
            disk("nvme0n1", 0, false),
            disk("nvme1n1", g, false),
            disk("sda", g, true),
            disk("sdaa", g, false),
            disk("sdz", g, false),
            disk("vda", g, false),
        ];
        // (plan's disk, command line's disk, disks seen, chosen or words of the error)
        type Case<'a> = (
            Option<&'a str>,
            Option<&'a str>,
            &'a [DiskFact],
            Result<&'a str, &'a str>,
        );
        let cases: &[Case] = &[
            (None, None, &all, Ok("/dev/nvme1n1")),
            (None, None, &all[3..], Ok("/dev/vda")),
            (None, None, &all[3..6], Ok("/dev/sdz")),
            (None, None, &all[..1], Ok("/dev/mmcblk0")),
            (None, None, &all[1..2], Err("no disk")),
            (None, None, &all[3..4], Err("no disk")),
            (None, None, &[], Err("found: none")),
            (Some("/dev/sdaa"), Some("/dev/vda"), &all, Ok("/dev/sdaa")),
            (None, Some("/dev/vda"), &all, Ok("/dev/vda")),
            (Some("/dev/sda"), None, &all, Ok("/dev/sda")),
            (
                Some("/dev/sdq"),
                None,
                &all,
                Err("target disk /dev/sdq not found"),
            ),
            (Some("/dev/nvme0n1"), None, &all, Err("not found")),
        ];
        for (plan, cmd, disks, want) in cases {
            let got = choose_target(*plan, *cmd, disks);
            match (want, got) {
                (Ok(w), Ok(g)) => assert_eq!(*w, g, "{plan:?} {cmd:?}"),
                (Err(w), Err(e)) => assert!(e.to_string().contains(w), "{e}"),
                (w, g) => panic!("{plan:?} {cmd:?}: want {w:?}, got {g:?}"),
            }
        }
    }

    #[test]
    fn wipes_every_fixed_disk_and_the_target() {
        let all = vec![
            disk("nvme0n1", 0, false),
            disk("sda", 10, true),
            disk("sdb", 10, true),
            disk("vda", 10, false),
            disk("vdb", 10, false),
        ];
        assert_eq!(wipe_set("/dev/vda", &all), vec!["vda", "vdb"]);
        assert_eq!(wipe_set("/dev/sda", &all), vec!["sda", "vda", "vdb"]);
    }

    #[test]
    fn partition_naming() {
        for (disk, n, want) in [
            ("/dev/vda", 2, "/dev/vda2"),
            ("/dev/sdaa", 1, "/dev/sdaa1"),
            ("/dev/nvme0n1", 2, "/dev/nvme0n1p2"),
            ("/dev/mmcblk0", 3, "/dev/mmcblk0p3"),
            ("/dev/loop7", 1, "/dev/loop7p1"),
        ] {
            assert_eq!(partition_path(disk, n), want);
        }
    }

    #[test]
    fn tool_failure_carries_the_tools_words() {
        let e = run("sh", &["-c", "echo oops >&2; exit 3"]).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("`sh -c") && msg.contains("oops"), "{msg}");
        assert_eq!(
            run_with("sh", &["-c", "cat; exit 1"], Some("in"), |c| c <= 1).unwrap(),
            "in"
        );
    }

    #[test]
    fn waiting_for_a_node_times_out() {
        let e = wait_for_node("/nonexistent/pxed", Duration::from_millis(150)).unwrap_err();
        assert!(e.to_string().contains("did not appear"), "{e}");
    }
}
