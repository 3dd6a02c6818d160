//! `pxed image check`: a complete mirror passes; each missing piece is named, exactly.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{pxed_bin, repo, run, write_file};

/// Everything debian-installer fetches for one suite and architectures: the entry's
/// kernel and initrd, the signed release, the package and udeb indexes, the English
/// translations. Returns the paths written, relative to `root`.
pub fn debian_mirror(root: &Path, suite: &str, arches: &[&str]) -> Vec<String> {
    let d = format!("debian/dists/{suite}");
    let mut files = vec![format!("{d}/InRelease")];
    for a in arches {
        let nb = format!("{d}/main/installer-{a}/current/images/netboot/debian-installer/{a}");
        files.extend([
            format!("{nb}/linux"),
            format!("{nb}/initrd.gz"),
            format!("{d}/main/binary-{a}/Release"),
            format!("{d}/main/binary-{a}/Packages.xz"),
            format!("{d}/main/debian-installer/binary-{a}/Packages.gz"),
        ]);
    }
    files.push(format!("{d}/main/i18n/Translation-en.bz2"));
    for f in &files {
        write_file(root, f, format!("{a} {f}", a = f.len()).as_bytes());
    }
    files
}

/// The repository metadata Anaconda reads for rocky-9 (both architectures, BaseOS
/// and AppStream); the kernels and initrds are the caller's. Returns the paths written.
pub fn rocky_repo_metadata(root: &Path) -> Vec<String> {
    let mut files = Vec::new();
    for a in ["x86_64", "aarch64"] {
        let os = format!("rocky/9/BaseOS/{a}/os");
        files.extend([
            format!("{os}/.treeinfo"),
            format!("{os}/repodata/repomd.xml"),
            format!("rocky/9/AppStream/{a}/os/repodata/repomd.xml"),
        ]);
    }
    for f in &files {
        write_file(root, f, f.as_bytes());
    }
    files
}

fn check(mirror: &str, args: &[&str]) -> (bool, String, String) {
    let data = tempfile::tempdir().unwrap();
    run(Command::new(pxed_bin())
        .current_dir(repo())
        .args(["image", "check"])
        .args(args)
        .args(["--demo", "--data-dir"])
        .arg(data.path())
        .env("PXED_MIRROR_BASE", mirror))
}

fn missing_lines(out: &str) -> Vec<&str> {
    out.lines().filter(|l| l.contains("MISSING")).collect()
}

/// Removes each file in turn: the check fails and names that file and nothing else.
fn each_piece_is_named(root: &Path, base: &str, image: &str, files: &[String]) {
    let (ok, out, err) = check(base, &[image]);
    assert!(ok, "{image} on a complete mirror: {out}{err}");
    assert!(missing_lines(&out).is_empty(), "{out}");
    assert_eq!(
        out.lines().filter(|l| l.contains(" ok ")).count(),
        out.lines().count()
    );
    for f in files {
        let p: PathBuf = root.join(f);
        let keep = std::fs::read(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        let (ok, out, err) = check(base, &[image]);
        assert!(!ok, "{image} without {f} passed: {out}");
        let lines = missing_lines(&out);
        assert_eq!(lines.len(), 1, "without {f}: {out}");
        // Named as the missing item, or among its alternatives (`Packages.gz (or
        // Packages.xz)` when the mirror had the .xz).
        let url = format!("{}/{f}", base.trim_end_matches('/'));
        assert!(
            lines[0].contains(&format!("MISSING {url}")) || lines[0].contains(&format!("{url})")),
            "without {f}: {out}"
        );
        assert!(err.contains("lacks 1 item"), "{err}");
        std::fs::write(&p, keep).unwrap();
    }
}

#[test]
fn debian_mirror_complete_then_each_piece_missing() {
    let work = tempfile::tempdir().unwrap();
    let root = work.path();
    let files = debian_mirror(root, "bookworm", &["amd64", "arm64"]);
    let base = format!("file://{}/", root.display());
    each_piece_is_named(root, &base, "debian-12-installer", &files);

    // The alternatives debian-installer accepts: Release + Release.gpg for InRelease,
    // any compression of the indexes and translations.
    let d = root.join("debian/dists/bookworm");
    std::fs::remove_file(d.join("InRelease")).unwrap();
    write_file(&d, "Release", b"r");
    let (ok, out, _) = check(&base, &["debian-12-installer"]);
    assert!(!ok);
    assert_eq!(missing_lines(&out).len(), 1, "{out}");
    assert!(
        out.contains(&format!(
            "MISSING {base}debian/dists/bookworm/Release.gpg (or {base}debian/dists/bookworm/InRelease)"
        )),
        "names the half that is missing: {out}"
    );
    write_file(&d, "Release.gpg", b"s");
    std::fs::rename(
        d.join("main/i18n/Translation-en.bz2"),
        d.join("main/i18n/Translation-en"),
    )
    .unwrap();
    let plain = root.to_str().unwrap();
    let (ok, out, err) = check(plain, &["debian-12-installer", "--arch", "arm64"]);
    assert!(ok, "{out}{err}");
    assert!(out.lines().all(|l| l.starts_with("arm64 ok ")), "{out}");
    // What was found is named, not the first alternative.
    let d_plain = format!("{plain}/debian/dists/bookworm");
    for want in [
        format!("arm64 ok {d_plain}/Release + {d_plain}/Release.gpg"),
        format!("arm64 ok {d_plain}/main/i18n/Translation-en"),
    ] {
        assert!(out.lines().any(|l| l == want), "{want} not in\n{out}");
    }

    // The same mirror over HTTP.
    let (url, _server) = serve(root);
    let (ok, out, err) = check(&url, &["debian-12-installer"]);
    assert!(ok, "{out}{err}");
    std::fs::remove_file(d.join("main/binary-amd64/Packages.xz")).unwrap();
    let (ok, out, _) = check(&url, &["debian-12-installer"]);
    assert!(!ok);
    assert_eq!(
        missing_lines(&out),
        [format!(
            "x86_64 MISSING {url}debian/dists/bookworm/main/binary-amd64/Packages.gz \
             (or {url}debian/dists/bookworm/main/binary-amd64/Packages.xz)"
        )],
        "{out}"
    );

    // `image add` runs the same check and refuses with the list.
    let data = tempfile::tempdir().unwrap();
    let add = |extra: &[&str]| {
        run(Command::new(pxed_bin())
            .current_dir(repo())
            .args(["image", "add", "debian-12-installer"])
            .args(extra)
            .args(["--demo", "--data-dir"])
            .arg(data.path())
            .env("PXED_MIRROR_BASE", &url))
    };
    let (ok, _, err) = add(&[]);
    assert!(!ok, "{err}");
    assert!(
        err.contains("--no-check") && err.contains("binary-amd64/Packages.gz"),
        "{err}"
    );
    assert!(!data.path().join("images/debian-12-installer").exists());
    let (ok, out, err) = add(&["--no-check"]);
    assert!(ok, "{out}{err}");
}

#[test]
fn rocky_mirror_complete_then_each_piece_missing() {
    let work = tempfile::tempdir().unwrap();
    let root = work.path();
    let mut files = rocky_repo_metadata(root);
    for a in ["x86_64", "aarch64"] {
        let p = format!("rocky/9/BaseOS/{a}/os/images/pxeboot");
        for f in [format!("{p}/vmlinuz"), format!("{p}/initrd.img")] {
            write_file(root, &f, f.as_bytes());
            files.push(f);
        }
    }
    each_piece_is_named(root, root.to_str().unwrap(), "rocky-9", &files);
}

/// Serves `root` over HTTP on a port of its own until the guard drops.
fn serve(root: &Path) -> (String, Server) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    let root = root.to_path_buf();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let app =
                axum::Router::new().fallback_service(tower_http::services::ServeDir::new(root));
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = rx.await;
                })
                .await
                .unwrap();
        });
    });
    (url, Server(Some((tx, thread))))
}

pub struct Server(
    Option<(
        tokio::sync::oneshot::Sender<()>,
        std::thread::JoinHandle<()>,
    )>,
);

impl Drop for Server {
    fn drop(&mut self) {
        if let Some((tx, t)) = self.0.take() {
            let _ = tx.send(());
            let _ = t.join();
        }
    }
}
