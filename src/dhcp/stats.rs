//! DHCP counters, rendered at `/metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

use dhcproto::v4::MessageType;

use crate::metrics::{Counter, Render, sample};

/// Counters of the DHCP server.
#[derive(Debug, Default)]
pub struct DhcpStats {
    pub received: Counter,
    pub discover: Counter,
    pub request: Counter,
    pub decline: Counter,
    pub release: Counter,
    pub inform: Counter,
    pub other_type: Counter,
    pub offers: Counter,
    pub acks: Counter,
    pub naks: Counter,
    /// Malformed packets dropped (truncated, oversized, wrong op, bad hlen, no type...).
    pub malformed: Counter,
    /// Receive errors that were not transient (logged; the server goes on).
    pub recv_errors: Counter,
    /// Well-formed packets we chose not to answer (other server, not a boot client...).
    pub ignored: Counter,
    pub pool_exhausted: Counter,
    /// `DhcpSeen` events dropped because the channel was full.
    pub seen_dropped: Counter,
    pub commits: Counter,
    pub commit_errors: Counter,
    /// Leases the database refused because another instance holds the address.
    pub lease_conflicts: Counter,
    /// Leases other instances on the database changed, read back into the table.
    pub leases_followed: Counter,
    pub send_errors: Counter,
    /// Boot clients of an architecture we have no file for (`None`: no arch sent).
    unknown_arch: Mutex<BTreeMap<Option<u16>, u64>>,
}

impl DhcpStats {
    /// Counts a received message by type.
    pub fn count_type(&self, t: MessageType) {
        match t {
            MessageType::Discover => self.discover.inc(),
            MessageType::Request => self.request.inc(),
            MessageType::Decline => self.decline.inc(),
            MessageType::Release => self.release.inc(),
            MessageType::Inform => self.inform.inc(),
            _ => self.other_type.inc(),
        }
    }

    /// Counts a boot client of an unknown architecture.
    pub fn count_unknown_arch(&self, arch: Option<u16>) {
        let mut m = self.unknown_arch.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry(arch).or_default() += 1;
    }

    /// How many unknown-architecture clients were seen with `arch`.
    pub fn unknown_arch(&self, arch: Option<u16>) -> u64 {
        let m = self.unknown_arch.lock().unwrap_or_else(|e| e.into_inner());
        m.get(&arch).copied().unwrap_or(0)
    }
}

impl Render for DhcpStats {
    fn render(&self, out: &mut String) {
        let c = |out: &mut String, name: &str, help: &str, v: &Counter| {
            sample(out, name, help, "counter", v.get());
        };
        c(
            out,
            "pxed_dhcp_received_total",
            "DHCP packets received",
            &self.received,
        );
        let _ = writeln!(
            out,
            "# HELP pxed_dhcp_messages_total Valid DHCP requests by message type\n# TYPE pxed_dhcp_messages_total counter"
        );
        for (t, v) in [
            ("discover", &self.discover),
            ("request", &self.request),
            ("decline", &self.decline),
            ("release", &self.release),
            ("inform", &self.inform),
            ("other", &self.other_type),
        ] {
            let _ = writeln!(out, "pxed_dhcp_messages_total{{type=\"{t}\"}} {}", v.get());
        }
        c(
            out,
            "pxed_dhcp_offers_total",
            "DHCPOFFERs sent",
            &self.offers,
        );
        c(out, "pxed_dhcp_acks_total", "DHCPACKs sent", &self.acks);
        c(out, "pxed_dhcp_naks_total", "DHCPNAKs sent", &self.naks);
        c(
            out,
            "pxed_dhcp_malformed_total",
            "Malformed packets dropped",
            &self.malformed,
        );
        c(
            out,
            "pxed_dhcp_recv_errors_total",
            "Receive errors that were not transient (logged; the server goes on)",
            &self.recv_errors,
        );
        c(
            out,
            "pxed_dhcp_ignored_total",
            "Valid packets not answered",
            &self.ignored,
        );
        c(
            out,
            "pxed_dhcp_pool_exhausted_total",
            "DISCOVERs with no free address",
            &self.pool_exhausted,
        );
        c(
            out,
            "pxed_dhcp_seen_dropped_total",
            "Discovery events dropped (channel full)",
            &self.seen_dropped,
        );
        c(
            out,
            "pxed_dhcp_commits_total",
            "Lease batches committed",
            &self.commits,
        );
        c(
            out,
            "pxed_dhcp_commit_errors_total",
            "Lease batches that failed to commit",
            &self.commit_errors,
        );
        c(
            out,
            "pxed_dhcp_lease_conflicts_total",
            "Leases not bound (reply withheld) because another instance on the database holds the address",
            &self.lease_conflicts,
        );
        c(
            out,
            "pxed_dhcp_leases_followed_total",
            "Lease changes other instances on the database committed, read back into this instance's lease table",
            &self.leases_followed,
        );
        c(
            out,
            "pxed_dhcp_send_errors_total",
            "Replies that failed to send",
            &self.send_errors,
        );
        let _ = writeln!(
            out,
            "# HELP pxed_dhcp_unknown_arch_total Boot clients of an architecture with no boot file\n# TYPE pxed_dhcp_unknown_arch_total counter"
        );
        let m = self.unknown_arch.lock().unwrap_or_else(|e| e.into_inner());
        for (arch, v) in m.iter() {
            let a = arch.map_or_else(|| "none".to_string(), |a| a.to_string());
            let _ = writeln!(out, "pxed_dhcp_unknown_arch_total{{arch=\"{a}\"}} {v}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_labels() {
        let s = DhcpStats::default();
        s.count_type(MessageType::Discover);
        s.count_unknown_arch(Some(10));
        s.count_unknown_arch(None);
        s.malformed.inc();
        let mut out = String::new();
        s.render(&mut out);
        assert!(
            out.contains("pxed_dhcp_messages_total{type=\"discover\"} 1"),
            "{out}"
        );
        assert!(out.contains("pxed_dhcp_unknown_arch_total{arch=\"10\"} 1"));
        assert!(out.contains("pxed_dhcp_unknown_arch_total{arch=\"none\"} 1"));
        assert!(out.contains("pxed_dhcp_malformed_total 1"));
        assert_eq!(s.unknown_arch(Some(10)), 1);
    }
}
