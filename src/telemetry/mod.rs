//! Installer telemetry: what the vendor installers (debian-installer, Anaconda,
//! subiquity/curtin) say while they run, received by pxed itself.
//!
//! ```text
//!  syslog UDP/TCP (d-i log_host=, Anaconda inst.syslog=)     POST /cb/{token}/events (curtin reporting)
//!        server::serve: frame + parse, count malformed                http::agent: token check
//!                        \                                             /
//!                         +---- Telemetry::submit (bounded channel) --+
//!                                          |
//!     recorder::run: attribute (source address -> node generation), redact, store in batches
//!     (last N lines per generation), recognize::recognize -> milestones on the timeline,
//!     fatal errors -> Event::InstallFailed through the lifecycle
//! ```
//! The receiver never touches the store: it hands lines to the recorder over a bounded
//! channel, and a full channel drops (and counts) lines rather than slowing the socket.

pub mod recognize;
pub mod recorder;
pub mod server;
pub mod syslog;

use std::net::{IpAddr, SocketAddr};
use std::sync::{Mutex, OnceLock};

use serde::Deserialize;
use tokio::sync::mpsc;

use crate::metrics::{Counter, Render, sample};

/// Errors of the telemetry servers and recorder.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("syslog socket: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

/// How a line reached pxed (`install_log.source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The syslog receiver (UDP or TCP).
    Syslog,
    /// `POST /cb/{token}/events`.
    Webhook,
}

impl Source {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Syslog => "syslog",
            Source::Webhook => "webhook",
        }
    }
}

/// One line from an installer, before attribution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// The sender's address (syslog: attribution is by it).
    pub peer: Option<IpAddr>,
    /// The node and generation, when the sender proved them (the webhook's token).
    pub node: Option<(i64, i64)>,
    pub source: Source,
    /// `tag: message`, one line.
    pub line: String,
}

/// One curtin / subiquity reporting event (cloud-init's webhook reporter format):
/// `event_type` is `start`, `finish` or `log`; `result` (on `finish`) is `SUCCESS`,
/// `WARN` or `FAIL`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct CurtinEvent {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub event_type: String,
    #[serde(default)]
    pub origin: String,
    #[serde(default)]
    pub result: Option<String>,
    #[serde(default)]
    pub level: Option<String>,
    #[serde(default)]
    pub timestamp: Option<f64>,
}

/// An event as one stored line: `<origin>: <event_type> <name>: [<RESULT>: ]<description>`.
pub fn event_line(ev: &CurtinEvent) -> String {
    let origin = if ev.origin.is_empty() {
        "curtin"
    } else {
        ev.origin.as_str()
    };
    let kind = if ev.event_type.is_empty() {
        "log"
    } else {
        ev.event_type.as_str()
    };
    let mut s = format!("{origin}: {kind} {}: ", ev.name);
    if let Some(r) = ev.result.as_deref().filter(|r| !r.is_empty()) {
        s.push_str(r);
        s.push_str(": ");
    }
    s.push_str(&ev.description);
    one_line(&s, MAX_LINE)
}

/// Longest stored line, in bytes.
pub const MAX_LINE: usize = 2048;

/// Longest failure reason taken from a line, in bytes.
pub const MAX_REASON: usize = 400;

/// `s` as one line of at most `max` bytes: control characters become spaces, runs of
/// spaces stay, and a cut line ends with `…` (cut on a character boundary).
pub fn one_line(s: &str, max: usize) -> String {
    let mut out = String::with_capacity(s.len().min(max));
    for c in s.trim().chars() {
        let c = if c.is_control() { ' ' } else { c };
        if out.len() + c.len_utf8() > max.saturating_sub('…'.len_utf8()) {
            out.push('…');
            return out;
        }
        out.push(c);
    }
    out
}

const REDACTED: &str = "<redacted>";

/// Removes secrets an installer may echo: its command line's `pxed.token=...`, the
/// token segment of `/cb/<token>` and `/cfg/<token>` URLs, crypt(3) password hashes,
/// long base64 blobs (the preseed's late command carries the first-boot agent, whose
/// agent token it encodes), and any of `secrets` verbatim (the node's own tokens).
pub fn redact(line: &str, secrets: &[&str]) -> String {
    let mut s = line.to_string();
    for secret in secrets.iter().filter(|t| t.len() >= 8) {
        if s.contains(secret) {
            s = s.replace(secret, REDACTED);
        }
    }
    for marker in ["pxed.token=", "/cb/", "/cfg/"] {
        s = redact_after(&s, marker);
    }
    s.split(' ')
        .map(|w| {
            let hash = [
                "$1$", "$2a$", "$2b$", "$2y$", "$5$", "$6$", "$y$", "$gy$", "$7$",
            ]
            .iter()
            .any(|p| w.trim_start_matches(['\'', '"']).starts_with(p));
            let blob = w.len() >= 64
                && w.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '/' | '='));
            if hash || blob { REDACTED } else { w }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Replaces the word after each `marker` (up to `/`, whitespace, a quote or `;`).
fn redact_after(s: &str, marker: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find(marker) {
        let (head, tail) = rest.split_at(i + marker.len());
        out.push_str(head);
        let end = tail
            .find(|c: char| c == '/' || c.is_whitespace() || matches!(c, '\'' | '"' | ';'))
            .unwrap_or(tail.len());
        if end > 0 && &tail[..end] != REDACTED {
            out.push_str(REDACTED);
        } else {
            out.push_str(&tail[..end]);
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// Counters of the receiver and recorder (`/metrics`).
#[derive(Debug, Default)]
pub struct TelemetryStats {
    pub udp_messages: Counter,
    pub tcp_messages: Counter,
    pub webhook_events: Counter,
    /// Not syslog (unparseable, not UTF-8, empty, too long): dropped.
    pub malformed: Counter,
    /// From an address that is no node being installed: dropped.
    pub unattributed: Counter,
    /// Dropped because the recorder fell behind (channel or batch full).
    pub overloaded: Counter,
    pub stored: Counter,
    pub milestones: Counter,
    pub fatal: Counter,
    /// TCP connections refused at the connection cap.
    pub tcp_refused: Counter,
    /// TCP connections closed for idling past the idle timeout.
    pub tcp_idle_closed: Counter,
    /// Batches the store refused (lines lost).
    pub store_errors: Counter,
}

impl Render for TelemetryStats {
    fn render(&self, out: &mut String) {
        for (name, help, c) in [
            (
                "pxed_syslog_udp_messages_total",
                "Syslog datagrams received",
                &self.udp_messages,
            ),
            (
                "pxed_syslog_tcp_messages_total",
                "Syslog messages received over TCP",
                &self.tcp_messages,
            ),
            (
                "pxed_installer_events_total",
                "Reporting events received at /cb/{token}/events",
                &self.webhook_events,
            ),
            (
                "pxed_syslog_malformed_total",
                "Syslog messages dropped as malformed",
                &self.malformed,
            ),
            (
                "pxed_syslog_unattributed_total",
                "Installer lines dropped: the sender is no node being installed",
                &self.unattributed,
            ),
            (
                "pxed_syslog_overloaded_total",
                "Installer lines dropped because the recorder fell behind",
                &self.overloaded,
            ),
            (
                "pxed_install_log_lines_total",
                "Installer lines stored",
                &self.stored,
            ),
            (
                "pxed_installer_milestones_total",
                "Installer milestones recognised",
                &self.milestones,
            ),
            (
                "pxed_installer_fatal_total",
                "Fatal installer errors recognised",
                &self.fatal,
            ),
            (
                "pxed_syslog_tcp_refused_total",
                "Syslog TCP connections refused at the connection cap",
                &self.tcp_refused,
            ),
            (
                "pxed_syslog_tcp_idle_closed_total",
                "Syslog TCP connections closed after the idle timeout",
                &self.tcp_idle_closed,
            ),
            (
                "pxed_install_log_store_errors_total",
                "Batches of installer lines the store refused",
                &self.store_errors,
            ),
        ] {
            sample(out, name, help, "counter", c.get());
        }
    }
}

/// How many received lines may wait for the recorder.
pub const QUEUE: usize = 4096;

/// The telemetry side of the shared state: counters, the queue to the recorder and
/// where the syslog receiver listens (for the installers' command lines).
#[derive(Debug)]
pub struct Telemetry {
    pub stats: std::sync::Arc<TelemetryStats>,
    tx: mpsc::Sender<Received>,
    rx: Mutex<Option<mpsc::Receiver<Received>>>,
    addr: OnceLock<SocketAddr>,
}

impl Default for Telemetry {
    fn default() -> Self {
        let (tx, rx) = mpsc::channel(QUEUE);
        Telemetry {
            stats: Default::default(),
            tx,
            rx: Mutex::new(Some(rx)),
            addr: OnceLock::new(),
        }
    }
}

impl Telemetry {
    /// Queues a line for the recorder; a full queue drops it (counted).
    pub fn submit(&self, r: Received) {
        if self.tx.try_send(r).is_err() {
            self.stats.overloaded.inc();
        }
    }

    /// The recorder's end of the queue (once).
    pub fn take_receiver(&self) -> Option<mpsc::Receiver<Received>> {
        self.rx.lock().expect("lock").take()
    }

    /// Records where the receiver listens (the bound address, real port).
    pub fn set_listening(&self, addr: SocketAddr) {
        let _ = self.addr.set(addr);
    }

    /// Where the receiver listens, if it runs.
    pub fn listening(&self) -> Option<SocketAddr> {
        self.addr.get().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_redacted() {
        let rows = [
            (
                "Kernel command line: auto=true url=http://10.0.0.1/cfg/Tk3x9abcdef/preseed pxed.token=Tk3x9abcdef log_host=10.0.0.1",
                "Kernel command line: auto=true url=http://10.0.0.1/cfg/<redacted>/preseed pxed.token=<redacted> log_host=10.0.0.1",
            ),
            (
                "ds=nocloud;s=http://10.0.0.1:8080/cfg/abcdefgh123/ autoinstall",
                "ds=nocloud;s=http://10.0.0.1:8080/cfg/<redacted>/ autoinstall",
            ),
            (
                "in-target: curl -X POST 'http://10.0.0.1/cb/abcdefgh123/installed'",
                "in-target: curl -X POST 'http://10.0.0.1/cb/<redacted>/installed'",
            ),
            (
                "debconf: --> SET passwd/root-password-crypted $6$rounds=4096$salt$hash",
                "debconf: --> SET passwd/root-password-crypted <redacted>",
            ),
            ("nothing secret here", "nothing secret here"),
        ];
        for (line, want) in rows {
            assert_eq!(redact(line, &[]), want);
        }
        let blob = "A".repeat(80);
        assert_eq!(
            redact(&format!("echo {blob} | base64 -d"), &[]),
            "echo <redacted> | base64 -d"
        );
        assert_eq!(
            redact("token agent-0123456789 seen", &["agent-0123456789"]),
            "token <redacted> seen"
        );
    }

    #[test]
    fn one_line_bounds_and_flattens() {
        assert_eq!(one_line("a\nb\tc", 100), "a b c");
        let long = "é".repeat(300);
        let cut = one_line(&long, 101);
        assert!(cut.len() <= 101 && cut.ends_with('…'), "{}", cut.len());
    }

    #[test]
    fn event_lines() {
        let ev = CurtinEvent {
            name: "cmd-install/stage-partitioning".into(),
            description: "configuring storage".into(),
            event_type: "finish".into(),
            origin: "curtin".into(),
            result: Some("FAIL".into()),
            ..Default::default()
        };
        assert_eq!(
            event_line(&ev),
            "curtin: finish cmd-install/stage-partitioning: FAIL: configuring storage"
        );
    }
}
