//! Read-only TFTP server on tokio.
//!
//! RFC 1350 read requests (octet and netascii) with RFC 2347 option negotiation:
//! blksize (2348), timeout and tsize (2349), windowsize (7440). Each transfer runs
//! on its own task and its own ephemeral socket (a new TID) bound to the address
//! the client contacted. The listener never stops on bad input: malformed packets
//! are counted and dropped. A client ERROR (UEFI sends code 8 after its tsize
//! probe) ends the transfer at once.
//!
//! Hostile clients are bounded: a few transfers per client address, a client that
//! never answers gets the first packet twice (not `retries` + 1 times), and until
//! the client answers a transfer holds no thread and can be ended to make room for
//! a newcomer (see `admission`). It still listens for a late first ACK as long as
//! an answered transfer waits: firmware resends only that ACK, seconds later. Only
//! regular files under the root are served, and opening one never waits (see
//! `path`).
//!
//! Written here rather than taken from async-tftp, which leaves dead transfers
//! after such an ERROR and runs a second runtime.

mod admission;
mod options;
pub mod packet;
pub mod path;
mod server;

use std::path::PathBuf;

use crate::metrics::{Counter, Gauge, Render, sample};

pub use options::{Negotiated, negotiate};
pub use server::serve;

/// Errors that stop the TFTP server. Per-request problems never do; they are
/// counted in [`TftpStats`].
#[derive(Debug, thiserror::Error)]
pub enum TftpError {
    #[error("TFTP root {path} is not usable: {source}")]
    Root {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("TFTP listening socket: {source}")]
    Socket { source: std::io::Error },
}

/// Counters of the TFTP server, rendered at `/metrics`.
#[derive(Debug, Default)]
pub struct TftpStats {
    /// Well-formed RRQs and WRQs received.
    pub requests: Counter,
    /// Transfers whose last block was acknowledged.
    pub completed: Counter,
    /// Transfers that timed out, hit an I/O error or were cut by shutdown.
    pub failed: Counter,
    /// Transfers the client ended: an ERROR packet (e.g. after UEFI's tsize probe) or
    /// a closed port (ICMP port unreachable).
    pub client_aborts: Counter,
    /// Requests refused: path traversal, not found, not a regular file, WRQ,
    /// unsupported mode.
    pub refused: Counter,
    /// Of `refused`: a directory, FIFO, socket or device was asked for.
    pub not_regular: Counter,
    /// Requests left unanswered because `max_transfers` were in flight, none of
    /// them half-open (the client's retransmission is served once a slot frees).
    pub busy: Counter,
    /// Requests refused because their client address had its limit of transfers
    /// in flight.
    pub busy_client: Counter,
    /// Transfers given up because the client never acknowledged the OACK or DATA 1
    /// (not counted in `failed`).
    pub first_ack_timeouts: Counter,
    /// Half-open transfers ended to make room for a new request (not counted in
    /// `failed`).
    pub evicted: Counter,
    /// Packets at the listening port that were not a valid request.
    pub malformed_dropped: Counter,
    /// Receive errors on the listening socket that were not transient (logged; the
    /// server goes on).
    pub recv_errors: Counter,
    /// Packets on a transfer socket from a foreign address (answered ERROR 5).
    pub unknown_tid: Counter,
    /// Windows (or OACKs) resent after a timeout.
    pub retransmits: Counter,
    /// Payload bytes sent in DATA packets, retransmissions included.
    pub bytes_sent: Counter,
    /// Transfers in flight.
    pub active: Gauge,
    /// Told of every completed transfer (the stage recorder), when set.
    pub observer: std::sync::OnceLock<std::sync::Arc<dyn TransferObserver>>,
    /// Counts each transfer as a first-stage slot for DHCP pacing, when set.
    pub slots: std::sync::OnceLock<std::sync::Arc<crate::pacing::Slots>>,
}

/// Something told of completed transfers (who fetched what, how much, how fast).
pub trait TransferObserver: Send + Sync + std::fmt::Debug {
    /// `peer` fetched `file` whole: `bytes` in `took`.
    fn completed(&self, peer: std::net::IpAddr, file: &str, bytes: u64, took: std::time::Duration);
}

impl Render for TftpStats {
    fn render(&self, out: &mut String) {
        let c = |out: &mut String, name: &str, help: &str, v: &Counter| {
            sample(
                out,
                &format!("pxed_tftp_{name}_total"),
                help,
                "counter",
                v.get(),
            );
        };
        c(out, "requests", "TFTP requests received.", &self.requests);
        c(
            out,
            "completed",
            "TFTP transfers completed.",
            &self.completed,
        );
        c(
            out,
            "failed",
            "TFTP transfers that timed out or failed.",
            &self.failed,
        );
        c(
            out,
            "client_aborts",
            "TFTP transfers ended by the client (an ERROR, or its port closed).",
            &self.client_aborts,
        );
        c(
            out,
            "refused",
            "TFTP requests refused (not found, access, WRQ).",
            &self.refused,
        );
        c(
            out,
            "not_regular",
            "TFTP requests refused for a directory, FIFO, socket or device (also in refused).",
            &self.not_regular,
        );
        c(
            out,
            "busy",
            "TFTP requests left unanswered at the transfer limit (the client retransmits).",
            &self.busy,
        );
        c(
            out,
            "busy_client",
            "TFTP requests refused at the per-client transfer limit.",
            &self.busy_client,
        );
        c(
            out,
            "first_ack_timeouts",
            "TFTP transfers whose client never acknowledged the first packet.",
            &self.first_ack_timeouts,
        );
        c(
            out,
            "evicted",
            "Half-open TFTP transfers ended to make room for a new request.",
            &self.evicted,
        );
        c(
            out,
            "malformed_dropped",
            "Malformed TFTP packets dropped.",
            &self.malformed_dropped,
        );
        c(
            out,
            "recv_errors",
            "Receive errors on the TFTP listening socket (logged; the server goes on).",
            &self.recv_errors,
        );
        c(
            out,
            "unknown_tid",
            "TFTP packets from an unknown transfer ID.",
            &self.unknown_tid,
        );
        c(
            out,
            "retransmits",
            "TFTP timeouts that resent data.",
            &self.retransmits,
        );
        c(
            out,
            "bytes_sent",
            "TFTP payload bytes sent.",
            &self.bytes_sent,
        );
        sample(
            out,
            "pxed_tftp_active_transfers",
            "TFTP transfers in flight.",
            "gauge",
            self.active.get(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_counter() {
        let s = TftpStats::default();
        s.busy.inc();
        s.active.inc();
        let mut out = String::new();
        s.render(&mut out);
        assert!(out.contains("pxed_tftp_busy_total 1\n"), "{out}");
        assert!(out.contains("pxed_tftp_active_transfers 1\n"), "{out}");
        assert_eq!(out.matches("# TYPE").count(), 16);
    }
}
