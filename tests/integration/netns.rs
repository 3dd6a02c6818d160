//! Network-namespace fixture: a server namespace with a bridge and clients on veths.
//!
//! ```ignore
//! let lan = Lan::new("dhcp", "10.77.0.1/24", 2);   // pxs + 2 clients, eth0 in each
//! lan.clients[0].command("busybox").args(["udhcpc", "-i", "eth0", ...]);
//! let sock = lan.server.enter(|| std::net::UdpSocket::bind("0.0.0.0:67"));
//! ```
//! Names carry the process id and a counter so parallel tests never collide; every
//! namespace is deleted on drop (which also removes its veths). Needs root.

#![allow(dead_code)]

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// Runs a command, panicking with its output if it fails.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e} (is it installed?)"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// One network namespace, deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates `pxt-<tag>-<pid>-<n>` with loopback up.
    pub fn new(tag: &str) -> Netns {
        static SWEEP: std::sync::Once = std::sync::Once::new();
        SWEEP.call_once(sweep_stale);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("pxt-{tag}-{}-{n}", std::process::id());
        run(Command::new("ip").args(["netns", "add", &name]));
        let ns = Netns { name };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// The namespace name (for `ip netns exec`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `ip -n <ns> <args>`; panics on failure.
    pub fn ip(&self, args: &[&str]) -> String {
        run(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }

    /// A command that runs `program` inside the namespace.
    pub fn command(&self, program: &str) -> tokio::process::Command {
        let mut c = tokio::process::Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c.kill_on_drop(true);
        c
    }

    /// Same as [`Netns::command`], blocking flavour.
    pub fn std_command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c
    }

    /// Runs `f` on a thread that has entered this namespace: sockets it opens and
    /// interfaces it looks up belong to the namespace (sockets stay there for life).
    pub fn enter<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/var/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let fd = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            // SAFETY: setns on a valid namespace fd; affects only this thread.
            let r = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(r, 0, "setns {path}: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .expect("thread inside the namespace panicked")
    }

    /// The MAC address of `iface`.
    pub fn mac(&self, iface: &str) -> String {
        let out = self.ip(&["-o", "link", "show", iface]);
        out.split_whitespace()
            .skip_while(|w| *w != "link/ether")
            .nth(1)
            .unwrap_or_else(|| panic!("no MAC in {out}"))
            .to_string()
    }
}

/// Deletes namespace `name`, retrying: `ip netns del` can fail with EBUSY while
/// another test's `ip netns add` or `exec` is copying the mount table.
fn delete(name: &str) -> Result<(), String> {
    let mut err = String::new();
    for _ in 0..10 {
        match Command::new("ip").args(["netns", "del", name]).output() {
            Ok(o) if o.status.success() => return Ok(()),
            Ok(o) => err = String::from_utf8_lossy(&o.stderr).into_owned(),
            Err(e) => err = e.to_string(),
        }
        std::thread::park_timeout(std::time::Duration::from_millis(50));
    }
    Err(err)
}

/// Deletes `pxt-*` namespaces left by test processes that no longer run (killed
/// runs, or a delete that failed).
fn sweep_stale() {
    let Ok(dir) = std::fs::read_dir("/var/run/netns") else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let mut parts = name.rsplit('-');
        let (Some(_), Some(pid)) = (parts.next(), parts.next()) else {
            continue;
        };
        let gone = pid
            .parse::<u32>()
            .is_ok_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists());
        if name.starts_with("pxt-") && gone {
            let _ = delete(&name);
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = delete(&self.name) {
            eprintln!("netns {} not deleted: {e}", self.name);
        }
    }
}

/// A server namespace with bridge `br0` holding `server_ip`, and client namespaces
/// whose `eth0` is a veth into the bridge (no address until a test gives one).
#[derive(Debug)]
pub struct Lan {
    // Clients first: they are dropped before the server.
    pub clients: Vec<Netns>,
    pub server: Netns,
    pub server_ip: Ipv4Addr,
}

impl Lan {
    /// `server_cidr` like `10.77.0.1/24`.
    pub fn new(tag: &str, server_cidr: &str, clients: usize) -> Lan {
        let server = Netns::new(&format!("{tag}-s"));
        server.ip(&["link", "add", "br0", "type", "bridge"]);
        server.ip(&["addr", "add", server_cidr, "dev", "br0"]);
        server.ip(&["link", "set", "br0", "up"]);
        let server_ip = server_cidr
            .split('/')
            .next()
            .and_then(|s| s.parse().ok())
            .expect("server_cidr is ADDR/PREFIX");
        let mut lan = Lan {
            clients: Vec::new(),
            server,
            server_ip,
        };
        for _ in 0..clients {
            lan.add_client(tag);
        }
        lan
    }

    /// Adds one more client namespace on the bridge; returns its index.
    pub fn add_client(&mut self, tag: &str) -> usize {
        let i = self.clients.len();
        let c = Netns::new(&format!("{tag}-c"));
        let port = format!("vc{i}");
        run(Command::new("ip").args([
            "link",
            "add",
            &port,
            "netns",
            self.server.name(),
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            c.name(),
        ]));
        self.server.ip(&["link", "set", &port, "master", "br0"]);
        self.server.ip(&["link", "set", &port, "up"]);
        c.ip(&["link", "set", "eth0", "up"]);
        self.clients.push(c);
        i
    }
}
