//! Confines requested file names to the served root, and opens only regular files.

use std::ffi::OsStr;
use std::fs::{File, Metadata};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

/// Why a file name is not served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Nothing there (answered with ERROR 1).
    NotFound,
    /// `..`, NUL, or a symlink out of the root (ERROR 2).
    Forbidden,
    /// A directory, FIFO, socket or device (ERROR 2).
    NotRegular,
}

/// Maps a requested name to a canonical path inside `root`, which must itself be
/// canonical. Leading slashes are stripped (PXE clients often send `/pxelinux.0`),
/// `..` anywhere is refused outright, and the canonical result must stay in `root`
/// so a symlink cannot lead out.
///
/// Blocking: touches the file system.
pub fn resolve(root: &Path, name: &[u8]) -> Result<PathBuf, Refusal> {
    if name.contains(&0) {
        return Err(Refusal::Forbidden);
    }
    let mut rel = name;
    while let [b'/', rest @ ..] = rel {
        rel = rest;
    }
    let rel = Path::new(OsStr::from_bytes(rel));
    let mut any = false;
    for c in rel.components() {
        match c {
            Component::Normal(_) => any = true,
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => {
                return Err(Refusal::Forbidden);
            }
        }
    }
    if !any {
        return Err(Refusal::NotFound);
    }
    let canonical = match std::fs::canonicalize(root.join(rel)) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Refusal::NotFound),
        Err(_) => return Err(Refusal::Forbidden),
    };
    if !canonical.starts_with(root) {
        return Err(Refusal::Forbidden);
    }
    Ok(canonical)
}

/// Opens the regular file `name` under `root` (canonical) for reading. Symlinks are
/// followed while they stay inside `root`. Never waits: a FIFO, device, socket or
/// directory is refused from its metadata without being opened (opening a FIFO
/// waits for a writer, opening a device can act on it), and should the path be
/// swapped between that look and the open, the open does not wait either
/// (`O_NONBLOCK`), does not follow a symlink in the last component (`O_NOFOLLOW`)
/// and the opened file is checked again. (Swapping a directory along the path for
/// a symlink in that instant needs write access to the root, which can place any
/// file there anyway.)
///
/// Blocking: touches the file system, briefly.
pub fn open(root: &Path, name: &[u8]) -> Result<(File, Metadata), Refusal> {
    let path = resolve(root, name)?;
    let io_refusal = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::NotFound => Refusal::NotFound,
        _ => Refusal::Forbidden,
    };
    if !std::fs::metadata(&path).map_err(io_refusal)?.is_file() {
        return Err(Refusal::NotRegular);
    }
    // O_NONBLOCK has no effect on reading a regular file.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_NOCTTY)
        .open(&path)
        .map_err(io_refusal)?;
    let meta = file.metadata().map_err(io_refusal)?;
    if !meta.is_file() {
        return Err(Refusal::NotRegular);
    }
    Ok((file, meta))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confinement() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        std::fs::create_dir(root.join("sub")).unwrap();
        std::fs::write(root.join("sub/f"), b"x").unwrap();
        std::fs::write(root.join("top"), b"x").unwrap();
        std::fs::write(outside.path().join("secret"), b"x").unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), root.join("out")).unwrap();
        std::os::unix::fs::symlink("sub/f", root.join("in")).unwrap();

        assert_eq!(resolve(&root, b"top"), Ok(root.join("top")));
        assert_eq!(resolve(&root, b"//top"), Ok(root.join("top")));
        assert_eq!(resolve(&root, b"./sub/f"), Ok(root.join("sub/f")));
        assert_eq!(resolve(&root, b"in"), Ok(root.join("sub/f")));
        assert_eq!(resolve(&root, b"sub"), Ok(root.join("sub")));
        assert_eq!(resolve(&root, b"nope"), Err(Refusal::NotFound));
        assert_eq!(resolve(&root, b""), Err(Refusal::NotFound));
        assert_eq!(resolve(&root, b"/"), Err(Refusal::NotFound));
        for bad in [
            &b"../x"[..],
            b"/../../etc/passwd",
            b"sub/../top",
            b"a/../../x",
            b"sub/..",
            b"to\0p",
            b"out",
        ] {
            assert_eq!(resolve(&root, bad), Err(Refusal::Forbidden), "{bad:?}");
        }
    }

    #[test]
    fn opens_regular_files_only_and_never_waits() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        std::fs::create_dir(root.join("sub")).unwrap();
        std::fs::write(root.join("sub/f"), b"abc").unwrap();
        nix::unistd::mkfifo(&root.join("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        std::os::unix::fs::symlink("fifo", root.join("to-fifo")).unwrap();
        std::os::unix::fs::symlink("sub/f", root.join("in")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", root.join("zero")).unwrap();
        std::os::unix::net::UnixListener::bind(root.join("sock")).unwrap();
        let (_, meta) = open(&root, b"in").unwrap();
        assert_eq!(meta.len(), 3);
        assert!(open(&root, b"/sub/f").is_ok());
        let table: &[(&[u8], Refusal)] = &[
            (b"fifo", Refusal::NotRegular),
            (b"to-fifo", Refusal::NotRegular),
            (b"sub", Refusal::NotRegular),
            (b"sock", Refusal::NotRegular),
            (b"zero", Refusal::Forbidden),
            (b"nope", Refusal::NotFound),
        ];
        for (name, want) in table {
            assert_eq!(open(&root, name).map(|_| ()), Err(*want), "{name:?}");
        }
    }
}
