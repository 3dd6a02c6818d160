//! Confines requested file names to the served root.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

/// Why a file name is not served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Nothing there (answered with ERROR 1).
    NotFound,
    /// `..`, NUL, a symlink out of the root, or not a regular file (ERROR 2).
    Forbidden,
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
}
