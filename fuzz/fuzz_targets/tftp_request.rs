//! TFTP: datagram bytes → `tftp::packet::parse_request` (the listening port) and
//! `parse_client` (a transfer's port); a parsed read request's options →
//! `tftp::negotiate`; its file name → `tftp::path::resolve` in a scratch root that has
//! a symlink leading out of it, a FIFO and a directory, and `tftp::path::open`.
//!
//! Invariants, besides "no panic":
//! - a parsed request has a NUL-free file name and non-empty ASCII option names;
//! - the negotiated block size is in 8..=65464, the window in 1..=64, the timeout the
//!   default or 1..=255 s; the OACK names each option once, only options the client
//!   sent, tsize as the file's real size, and encodes to what it says;
//! - a resolved path is inside the root, never the file outside it; `open` returns
//!   only a regular file inside the root (never waiting on the FIFO: a hang would be
//!   a libFuzzer timeout), and refuses the FIFO and the directory as not regular.
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use pxed::tftp::negotiate;
use pxed::tftp::packet::{ClientPacket, encode_oack, parse_client, parse_request};
use pxed::tftp::path::{Refusal, open, resolve};

const SIZE: u64 = 1_058_816;
const TIMEOUT: Duration = Duration::from_millis(700);

struct Root {
    root: PathBuf,
    secret: PathBuf,
}

/// `<tmp>/root/{undionly.kpxe, snponly.efi, sub/f, fifo, in -> sub/f, out -> ../secret,
/// up -> ..}`.
fn root() -> &'static Root {
    static ROOT: OnceLock<Root> = OnceLock::new();
    ROOT.get_or_init(|| {
        // One tree for every run (same content each time): nothing piles up in /tmp.
        let base = std::env::temp_dir().join("pxed-fuzz-tftp");
        let root = base.join("root");
        std::fs::create_dir_all(root.join("sub")).unwrap();
        for f in ["undionly.kpxe", "snponly.efi", "sub/f"] {
            std::fs::write(root.join(f), b"x").unwrap();
        }
        let secret = base.join("secret");
        std::fs::write(&secret, b"secret").unwrap();
        // Symlinks may be there from an earlier run (or a concurrent one).
        let _ = std::os::unix::fs::symlink(&secret, root.join("out"));
        let _ = std::os::unix::fs::symlink("sub/f", root.join("in"));
        let _ = std::os::unix::fs::symlink("..", root.join("up"));
        let fifo = std::ffi::CString::new(root.join("fifo").into_os_string().into_encoded_bytes())
            .unwrap();
        // SAFETY: a NUL-terminated path; an existing FIFO (EEXIST) is fine.
        unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) };
        Root {
            root: root.canonicalize().unwrap(),
            secret: secret.canonicalize().unwrap(),
        }
    })
}

fn check_resolve(name: &[u8]) {
    let r = root();
    if let Ok(p) = resolve(&r.root, name) {
        assert!(
            p.starts_with(&r.root),
            "{name:?} resolved out of the root: {p:?}"
        );
        assert_ne!(p, r.secret, "{name:?} reached the file outside the root");
        assert!(!Path::new(&p).components().any(|c| c.as_os_str() == ".."));
    }
    match open(&r.root, name) {
        Ok((_, meta)) => {
            let p = resolve(&r.root, name).expect("open resolved it");
            assert!(
                meta.is_file() && p.starts_with(&r.root),
                "{name:?} opened {p:?}"
            );
            assert_ne!(p, r.secret);
        }
        Err(Refusal::NotRegular) => {
            let p = resolve(&r.root, name).expect("refused as not regular, so resolved");
            assert!(!p.is_file(), "{p:?} refused although regular");
        }
        Err(_) => {}
    }
}

fuzz_target!(|data: &[u8]| {
    match parse_client(data) {
        ClientPacket::Ack(_) => assert!(data.len() >= 4 && data[..2] == [0, 4]),
        ClientPacket::Error { message, .. } => {
            assert!(data[..2] == [0, 5] && !message.contains(&0));
        }
        ClientPacket::Other => {}
    }
    let Ok(req) = parse_request(data) else {
        return;
    };
    assert!(!req.filename.contains(&0));
    assert!(
        req.options
            .iter()
            .all(|(k, v)| !k.is_empty() && k.is_ascii() && v.is_ascii())
    );

    let n = negotiate(&req.options, SIZE, TIMEOUT);
    assert!((8..=65464).contains(&n.blksize), "blksize {}", n.blksize);
    assert!(
        (1..=64).contains(&n.windowsize),
        "windowsize {}",
        n.windowsize
    );
    assert!(
        n.timeout == TIMEOUT
            || (Duration::from_secs(1)..=Duration::from_secs(255)).contains(&n.timeout),
        "timeout {:?}",
        n.timeout
    );
    let sent = |key: &str| req.options.iter().any(|(k, _)| k.eq_ignore_ascii_case(key));
    for (i, (k, v)) in n.oack.iter().enumerate() {
        assert!(sent(k), "OACK names {k}, which the client did not send");
        assert!(
            !n.oack[..i].iter().any(|(k2, _)| k2 == k),
            "{k} twice in the OACK"
        );
        assert!(
            !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()),
            "{k}={v}"
        );
        match *k {
            "blksize" => assert_eq!(v.parse::<usize>().ok(), Some(n.blksize)),
            "windowsize" => assert_eq!(v.parse::<u16>().ok(), Some(n.windowsize)),
            "timeout" => assert_eq!(v.parse::<u64>().ok(), Some(n.timeout.as_secs())),
            "tsize" => assert_eq!(v.parse::<u64>().ok(), Some(SIZE)),
            other => panic!("unknown option {other} acknowledged"),
        }
    }
    let mut out = Vec::new();
    encode_oack(&mut out, &n.oack);
    let fields: Vec<&[u8]> = out[2..].split(|&b| b == 0).collect();
    assert_eq!(fields.len(), n.oack.len() * 2 + 1, "OACK fields");

    check_resolve(req.filename);
});
