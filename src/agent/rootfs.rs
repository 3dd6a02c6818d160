//! Configuring the deployed root filesystem, mounted at any directory: hostname, hosts,
//! root's SSH keys, the plan's files and enabled units.
//!
//! Paths are resolved as if chrooted: a symlink in the image (`/lib -> /usr/lib`, or an
//! absolute one) is followed inside the root, never into the ramdisk's own tree.

use std::ffi::OsString;
use std::fs::{self, DirBuilder, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use crate::wire::DeployPlan;

/// Symlinks followed while resolving one path, as the kernel allows (`ELOOP`).
const MAX_LINKS: usize = 40;

/// Why the root filesystem could not be configured.
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    /// A plan path that could escape the root or is not a path in it.
    #[error("refusing plan path {path:?}: {why}")]
    BadPath {
        /// The path as planned.
        path: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A unit name that is not a plain file name.
    #[error("refusing unit name {unit:?}: not a plain unit file name")]
    BadUnit {
        /// The unit as planned.
        unit: String,
    },
    /// A hostname that cannot go into /etc/hostname.
    #[error("refusing hostname {0:?}: not a host name")]
    BadHostname(String),
    /// Too many symlinks while resolving a path inside the root.
    #[error("{path}: too many levels of symbolic links inside the root")]
    Loop {
        /// The path being resolved.
        path: String,
    },
    /// A file operation failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The path on the ramdisk (under the mount point).
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> RootfsError + '_ {
    move |source| RootfsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A plan path must be absolute, name something below `/`, and have no `..`.
pub fn check_plan_path(path: &str) -> Result<(), RootfsError> {
    let bad = |why| {
        Err(RootfsError::BadPath {
            path: path.to_string(),
            why,
        })
    };
    if !path.starts_with('/') {
        return bad("not absolute");
    }
    if path.contains('\0') {
        return bad("contains NUL");
    }
    let p = Path::new(path);
    if p.components().any(|c| c == Component::ParentDir) {
        return bad("contains ..");
    }
    if !p.components().any(|c| matches!(c, Component::Normal(_))) {
        return bad("names the root itself");
    }
    Ok(())
}

fn check_unit(unit: &str) -> Result<(), RootfsError> {
    if unit.is_empty() || unit.starts_with('.') || unit.contains(['/', '\0']) {
        return Err(RootfsError::BadUnit {
            unit: unit.to_string(),
        });
    }
    Ok(())
}

fn check_hostname(h: &str) -> Result<(), RootfsError> {
    let ok = !h.is_empty()
        && h.len() <= 253
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        });
    if ok {
        Ok(())
    } else {
        Err(RootfsError::BadHostname(h.to_string()))
    }
}

/// Where `path` (absolute, inside the deployed system) lives under `root`, following
/// symlinks in its directories the way a chroot would. The last component is not
/// followed: writers replace it.
pub fn resolve(root: &Path, path: &str) -> Result<PathBuf, RootfsError> {
    check_plan_path(path)?;
    let mut done: Vec<OsString> = Vec::new();
    let mut todo: Vec<OsString> = Path::new(path)
        .components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_os_string()),
            _ => None,
        })
        .rev()
        .collect();
    let mut links = 0;
    while let Some(name) = todo.pop() {
        if name == ".." {
            done.pop();
            continue;
        }
        if name == "." {
            continue;
        }
        let here: PathBuf = std::iter::once(root.as_os_str())
            .chain(done.iter().map(|s| s.as_os_str()))
            .chain(std::iter::once(name.as_os_str()))
            .collect();
        let is_last = todo.is_empty();
        let link = match fs::symlink_metadata(&here) {
            Ok(m) if m.file_type().is_symlink() && !is_last => {
                Some(fs::read_link(&here).map_err(io_err(&here))?)
            }
            _ => None,
        };
        match link {
            None => done.push(name),
            Some(target) => {
                links += 1;
                if links > MAX_LINKS {
                    return Err(RootfsError::Loop {
                        path: path.to_string(),
                    });
                }
                if target.is_absolute() {
                    done.clear();
                }
                for c in target.components().rev() {
                    match c {
                        Component::Normal(n) => todo.push(n.to_os_string()),
                        Component::ParentDir => todo.push("..".into()),
                        _ => {}
                    }
                }
            }
        }
    }
    Ok(std::iter::once(root.as_os_str())
        .chain(done.iter().map(|s| s.as_os_str()))
        .collect())
}

/// Creates the directory `path` (and its parents) inside `root`, each new one with `mode`.
fn make_dir(root: &Path, path: &str, mode: u32) -> Result<PathBuf, RootfsError> {
    let dir = resolve(root, path)?;
    DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(&dir)
        .map_err(io_err(&dir))?;
    Ok(dir)
}

/// Writes `content` to `path` inside `root` with exactly `mode`, replacing whatever file
/// or symlink was there; parent directories are created 0755.
pub fn write_file(root: &Path, path: &str, content: &[u8], mode: u32) -> Result<(), RootfsError> {
    let dest = resolve(root, path)?;
    if let Some(parent) = dest.parent() {
        DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(parent)
            .map_err(io_err(parent))?;
    }
    match fs::symlink_metadata(&dest) {
        Ok(m) if !m.is_dir() => fs::remove_file(&dest).map_err(io_err(&dest))?,
        _ => {}
    }
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&dest)
        .map_err(io_err(&dest))?;
    f.write_all(content).map_err(io_err(&dest))?;
    // The umask trimmed `mode` at creation; the plan's bits are what it asked for.
    f.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(io_err(&dest))?;
    f.sync_all().map_err(io_err(&dest))
}

/// `/etc/hosts` with one `127.0.1.1 <hostname>` line (replacing any other 127.0.1.1 line).
fn hosts(existing: Option<&str>, hostname: &str) -> String {
    let mut out = String::new();
    match existing {
        Some(e) => {
            for l in e
                .lines()
                .filter(|l| l.split_whitespace().next() != Some("127.0.1.1"))
            {
                out.push_str(l);
                out.push('\n');
            }
        }
        None => out.push_str("127.0.0.1 localhost\n"),
    }
    out.push_str(&format!("127.0.1.1 {hostname}\n"));
    out
}

/// Checks what [`configure`] would write: the hostname, every file path, every unit name.
pub fn check_plan(plan: &DeployPlan) -> Result<(), RootfsError> {
    check_hostname(&plan.hostname)?;
    for f in &plan.files {
        check_plan_path(&f.path)?;
    }
    for u in &plan.enable_units {
        check_unit(u)?;
    }
    Ok(())
}

/// Writes the plan into the root filesystem mounted at `root`: its files, enabled units,
/// hostname, hosts entry and root's authorized SSH keys. Every path is checked first, so
/// a bad plan writes nothing.
pub fn configure(root: &Path, plan: &DeployPlan) -> Result<(), RootfsError> {
    check_plan(plan)?;
    for f in &plan.files {
        write_file(root, &f.path, f.content.as_bytes(), f.mode & 0o7777)?;
    }
    if !plan.enable_units.is_empty() {
        let wants = "/etc/systemd/system/multi-user.target.wants";
        make_dir(root, wants, 0o755)?;
        for u in &plan.enable_units {
            let link = resolve(root, &format!("{wants}/{u}"))?;
            if fs::symlink_metadata(&link).is_ok() {
                fs::remove_file(&link).map_err(io_err(&link))?;
            }
            std::os::unix::fs::symlink(format!("/etc/systemd/system/{u}"), &link)
                .map_err(io_err(&link))?;
        }
    }
    write_file(
        root,
        "/etc/hostname",
        format!("{}\n", plan.hostname).as_bytes(),
        0o644,
    )?;
    let hosts_path = resolve(root, "/etc/hosts")?;
    let existing = match fs::read_to_string(&hosts_path) {
        Ok(s) => Some(s),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(io_err(&hosts_path)(e)),
    };
    write_file(
        root,
        "/etc/hosts",
        hosts(existing.as_deref(), &plan.hostname).as_bytes(),
        0o644,
    )?;
    if !plan.ssh_authorized_keys.is_empty() {
        let dir = make_dir(root, "/root/.ssh", 0o700)?;
        // An existing directory keeps its mode unless we set it.
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).map_err(io_err(&dir))?;
        let mut keys = String::new();
        for k in &plan.ssh_authorized_keys {
            keys.push_str(k.trim_end());
            keys.push('\n');
        }
        write_file(root, "/root/.ssh/authorized_keys", keys.as_bytes(), 0o600)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Compression, DiskImageRef, PlanFile, WipePolicy};

    fn plan() -> DeployPlan {
        DeployPlan {
            node_id: 7,
            generation: 3,
            hostname: "node7.lab".into(),
            arch: crate::model::Arch::X86_64,
            image: DiskImageRef {
                name: "debian-12".into(),
                url: "http://h/img".into(),
                compression: Compression::Zstd,
                size: 1,
                sha256: "00".into(),
                root_partition: 1,
            },
            wipe: WipePolicy::Signatures,
            target_disk: None,
            ssh_authorized_keys: vec!["ssh-ed25519 AAAA k1".into(), "ssh-rsa BBBB k2\n".into()],
            files: vec![
                PlanFile {
                    path: "/usr/local/bin/pxed-firstboot".into(),
                    mode: 0o755,
                    content: "#!/bin/sh\n".into(),
                },
                PlanFile {
                    path: "/etc/systemd/system/pxed-firstboot.service".into(),
                    mode: 0o644,
                    content: "[Unit]\n".into(),
                },
                PlanFile {
                    path: "/lib/pxed/x".into(),
                    mode: 0o600,
                    content: "via symlink".into(),
                },
            ],
            enable_units: vec!["pxed-firstboot.service".into()],
        }
    }

    fn mode(p: &Path) -> u32 {
        fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn plan_paths() {
        for ok in ["/etc/x", "/a/./b", "//etc/y"] {
            check_plan_path(ok).unwrap();
        }
        for (bad, why) in [
            ("etc/x", "not absolute"),
            ("", "not absolute"),
            ("/etc/../../x", "contains .."),
            ("/..", "contains .."),
            ("/", "names the root"),
            ("/etc/\0", "NUL"),
        ] {
            let e = check_plan_path(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        for bad in ["", "../x.service", "a/b.service", ".hidden"] {
            assert!(check_unit(bad).is_err(), "{bad}");
        }
        for bad in ["", "a b", "a/b", "-x", "a..b"] {
            assert!(check_hostname(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn configures_a_root_tree() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        fs::create_dir_all(r.join("etc")).unwrap();
        fs::create_dir_all(r.join("usr/lib")).unwrap();
        // Absolute symlink as in merged-/usr images: must land inside the root.
        std::os::unix::fs::symlink("/usr/lib", r.join("lib")).unwrap();
        fs::write(
            r.join("etc/hosts"),
            "127.0.0.1 localhost\n127.0.1.1 debian\n::1 localhost\n",
        )
        .unwrap();
        fs::write(r.join("etc/hostname"), "debian\n").unwrap();

        configure(r, &plan()).unwrap();

        assert_eq!(
            fs::read_to_string(r.join("etc/hostname")).unwrap(),
            "node7.lab\n"
        );
        assert_eq!(
            fs::read_to_string(r.join("etc/hosts")).unwrap(),
            "127.0.0.1 localhost\n::1 localhost\n127.0.1.1 node7.lab\n"
        );
        let keys = r.join("root/.ssh/authorized_keys");
        assert_eq!(
            fs::read_to_string(&keys).unwrap(),
            "ssh-ed25519 AAAA k1\nssh-rsa BBBB k2\n"
        );
        assert_eq!(mode(&keys), 0o600);
        assert_eq!(mode(&r.join("root/.ssh")), 0o700);
        let bin = r.join("usr/local/bin/pxed-firstboot");
        assert_eq!(fs::read_to_string(&bin).unwrap(), "#!/bin/sh\n");
        assert_eq!(mode(&bin), 0o755);
        assert_eq!(
            fs::read_to_string(r.join("usr/lib/pxed/x")).unwrap(),
            "via symlink"
        );
        assert_eq!(mode(&r.join("usr/lib/pxed/x")), 0o600);
        let link = r.join("etc/systemd/system/multi-user.target.wants/pxed-firstboot.service");
        assert_eq!(
            fs::read_link(&link).unwrap(),
            PathBuf::from("/etc/systemd/system/pxed-firstboot.service")
        );

        // Idempotent: a second run replaces, it does not fail or duplicate.
        configure(r, &plan()).unwrap();
        assert_eq!(
            fs::read_to_string(r.join("etc/hosts")).unwrap(),
            "127.0.0.1 localhost\n::1 localhost\n127.0.1.1 node7.lab\n"
        );
    }

    #[test]
    fn bare_root_gets_hosts_and_no_ssh_dir_without_keys() {
        let t = tempfile::tempdir().unwrap();
        let p = DeployPlan {
            ssh_authorized_keys: vec![],
            files: vec![],
            enable_units: vec![],
            ..plan()
        };
        configure(t.path(), &p).unwrap();
        assert_eq!(
            fs::read_to_string(t.path().join("etc/hosts")).unwrap(),
            "127.0.0.1 localhost\n127.0.1.1 node7.lab\n"
        );
        assert!(!t.path().join("root/.ssh").exists());
        assert!(!t.path().join("etc/systemd").exists());
    }

    #[test]
    fn a_bad_plan_writes_nothing() {
        let t = tempfile::tempdir().unwrap();
        let mut p = plan();
        p.files.push(PlanFile {
            path: "/etc/../../escape".into(),
            mode: 0o644,
            content: String::new(),
        });
        let e = configure(t.path(), &p).unwrap_err();
        assert!(matches!(e, RootfsError::BadPath { .. }), "{e}");
        assert_eq!(fs::read_dir(t.path()).unwrap().count(), 0);

        let mut p = plan();
        p.enable_units = vec!["../../x".into()];
        assert!(matches!(
            configure(t.path(), &p).unwrap_err(),
            RootfsError::BadUnit { .. }
        ));
        assert_eq!(fs::read_dir(t.path()).unwrap().count(), 0);
    }

    #[test]
    fn symlinks_resolve_inside_the_root() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        fs::create_dir_all(r.join("a/b")).unwrap();
        std::os::unix::fs::symlink("../../..", r.join("a/b/up")).unwrap();
        std::os::unix::fs::symlink("/", r.join("a/abs")).unwrap();
        std::os::unix::fs::symlink("loop", r.join("loop")).unwrap();
        assert_eq!(resolve(r, "/a/b/up/etc/x").unwrap(), r.join("etc/x"));
        assert_eq!(resolve(r, "/a/abs/etc/x").unwrap(), r.join("etc/x"));
        // The last component is not followed: it is what gets replaced.
        assert_eq!(resolve(r, "/a/abs").unwrap(), r.join("a/abs"));
        assert!(matches!(
            resolve(r, "/loop/x").unwrap_err(),
            RootfsError::Loop { .. }
        ));
    }
}
