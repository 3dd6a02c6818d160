//! Who may use a node's secrets, and from where: a pure decision over what the request
//! presented and what pxed knows about the node (the address its installer was served
//! to, the addresses its DHCP server leased to the node's MACs). The HTTP handlers
//! look those up and act on the answer.
//!
//! Two credentials per generation, each for one stage:
//! - the **boot token** is in the boot script and the kernel command line, so anyone
//!   who can fetch `/boot/<mac>.ipxe` for a MAC can read it. It is bound, when the
//!   installer is served, to the address that fetched the script, and accepted only
//!   from there and only for the installer's calls (configs, deploy plan and reports,
//!   `installed`, `failure`);
//! - the **agent token** is written only into the installed system (by the install
//!   config or the deploy plan, both fetched with the boot token from the bound
//!   address) and accepted only for the first-boot agent's `first-boot` and `health`.
//!   It is not bound to the boot-time address: the installed OS gets its own lease
//!   (another client identifier, often another address), and in proxy mode pxed
//!   cannot know it. In full DHCP mode both tokens must also come from an address
//!   pxed leased to one of the node's MACs, when it leased any; and the installer is
//!   served only to such an address (a netbooting machine always has one).
//!
//! What this does not stop: in proxy mode (no lease known) the first address to fetch
//! the script of a `netbooting` node gets the binding, and anyone who spoofs the
//! node's address and MAC at the right moment can race it. See the README's
//! "Security model".

use std::net::IpAddr;

/// Which of a node's secrets a request presented.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `nodes.boot_token`: the installer's (or deploy agent's).
    Boot,
    /// `nodes.agent_token`: the installed system's first-boot agent's.
    Agent,
}

impl Kind {
    /// For messages and the audit log.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Boot => "boot token",
            Kind::Agent => "agent token",
        }
    }
}

/// What pxed knows about where a node may be.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Whereabouts {
    /// `nodes.boot_ip`: where the installer was served (`None`: not yet).
    pub boot_ip: Option<IpAddr>,
    /// Addresses pxed's DHCP server has bound to the node's MACs now; in proxy mode,
    /// the address the node last asked the site's DHCP server for (its broadcast
    /// DHCPREQUEST, within the hour). Empty when there is none (then no lease check
    /// applies to a token).
    pub leased: Vec<IpAddr>,
    /// pxed is the DHCP server (full mode): a machine that netboots has a lease from
    /// it, so a script fetch from a node without one is not the node.
    pub leases_known: bool,
}

/// Why a secret was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The other kind of token: the boot token for the first-boot agent's calls, or
    /// the agent token for the installer's.
    #[error("the {presented} is not accepted for this call (it needs the {wanted})", presented = .presented.as_str(), wanted = .wanted.as_str())]
    WrongStage { presented: Kind, wanted: Kind },
    /// The right token from an address it is not bound to.
    #[error("{0}")]
    WrongAddress(String),
}

fn addr(ip: Option<IpAddr>) -> String {
    ip.map_or_else(|| "an unknown address".into(), |i| i.to_string())
}

/// The peer as an address comparable to stored ones (an IPv4 client of a dual-stack
/// socket arrives as `::ffff:a.b.c.d`).
pub fn canonical(ip: IpAddr) -> IpAddr {
    ip.to_canonical()
}

/// Whether `peer` is outside the node's leases (when there are any).
fn off_lease(w: &Whereabouts, peer: Option<IpAddr>) -> Option<String> {
    if w.leased.is_empty() || peer.is_some_and(|p| w.leased.contains(&p)) {
        return None;
    }
    let leased: Vec<String> = w.leased.iter().map(|i| i.to_string()).collect();
    Some(format!(
        "request from {}, but pxed leased {} to this node",
        addr(peer),
        leased.join(", ")
    ))
}

/// May a request from `peer` presenting a `presented` token make a call that needs a
/// `wanted` one?
pub fn admit(
    wanted: Kind,
    presented: Kind,
    w: &Whereabouts,
    peer: Option<IpAddr>,
) -> Result<(), Refusal> {
    if presented != wanted {
        return Err(Refusal::WrongStage { presented, wanted });
    }
    if presented == Kind::Boot {
        match (w.boot_ip, peer) {
            (None, _) => {
                return Err(Refusal::WrongAddress(
                    "the boot token is not bound to an address yet (no installer was served for it)"
                        .into(),
                ));
            }
            (Some(bound), Some(p)) if bound == p => {}
            (Some(bound), p) => {
                return Err(Refusal::WrongAddress(format!(
                    "request from {}, but the boot token is bound to {bound}",
                    addr(p)
                )));
            }
        }
    }
    match off_lease(w, peer) {
        Some(why) => Err(Refusal::WrongAddress(why)),
        None => Ok(()),
    }
}

/// May the installer (and so the boot token) be served to `peer`, binding the token
/// to it? `Ok` is the address to bind.
pub fn bind(w: &Whereabouts, peer: Option<IpAddr>) -> Result<IpAddr, Refusal> {
    let Some(p) = peer else {
        return Err(Refusal::WrongAddress(
            "the client's address is unknown: the boot token could not be bound".into(),
        ));
    };
    if w.leases_known && w.leased.is_empty() {
        return Err(Refusal::WrongAddress(format!(
            "script fetched from {p}, but pxed leased no address to this node"
        )));
    }
    if let Some(why) = off_lease(w, peer) {
        return Err(Refusal::WrongAddress(why));
    }
    match w.boot_ip {
        // A script fetched again during the install (an interrupted installer): only
        // the machine it was served to gets it again.
        Some(bound) if bound != p => Err(Refusal::WrongAddress(format!(
            "script fetched from {p}, but this install was served to {bound}"
        ))),
        _ => Ok(p),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn w(boot_ip: Option<&str>, leased: &[&str]) -> Whereabouts {
        Whereabouts {
            boot_ip: boot_ip.map(ip),
            leased: leased.iter().map(|s| ip(s)).collect(),
            leases_known: false,
        }
    }

    /// Every combination that matters: kind, binding, lease, peer.
    #[test]
    fn admit_table() {
        use Kind::*;
        let (a, b, c) = ("10.0.0.5", "10.0.0.9", "10.0.0.7");
        #[rustfmt::skip]
        type Row<'a> = (Kind, Kind, Option<&'a str>, &'a [&'a str], Option<&'a str>, Result<(), &'a str>);
        let rows: &[Row] = &[
            // wanted, presented, boot_ip, leased, peer, verdict
            (Boot, Boot, Some(a), &[], Some(a), Ok(())),
            (Boot, Boot, Some(a), &[], Some(b), Err("address")),
            (Boot, Boot, Some(a), &[], None, Err("address")),
            (Boot, Boot, None, &[], Some(a), Err("address")),
            (Boot, Boot, Some(a), &[a], Some(a), Ok(())),
            // Bound to a, but the lease moved to c: neither is enough alone.
            (Boot, Boot, Some(a), &[c], Some(a), Err("address")),
            (Boot, Boot, Some(a), &[c], Some(c), Err("address")),
            (Boot, Agent, Some(a), &[], Some(a), Err("stage")),
            (Agent, Boot, Some(a), &[], Some(a), Err("stage")),
            // The agent token is not bound to the boot-time address...
            (Agent, Agent, Some(a), &[], Some(b), Ok(())),
            (Agent, Agent, None, &[], None, Ok(())),
            // ...but to the node's leases where pxed leased any.
            (Agent, Agent, Some(a), &[c], Some(c), Ok(())),
            (Agent, Agent, Some(a), &[a, c], Some(c), Ok(())),
            (Agent, Agent, Some(a), &[c], Some(a), Err("address")),
            (Agent, Agent, Some(a), &[c], None, Err("address")),
        ];
        for (i, (wanted, presented, boot_ip, leased, peer, want)) in rows.iter().enumerate() {
            let got = admit(*wanted, *presented, &w(*boot_ip, leased), peer.map(ip));
            let got = got.map_err(|e| match e {
                Refusal::WrongStage { .. } => "stage",
                Refusal::WrongAddress(_) => "address",
            });
            assert_eq!(got, *want, "row {i}");
        }
    }

    #[test]
    fn bind_table() {
        let (a, b) = ("10.0.0.5", "10.0.0.9");
        #[rustfmt::skip]
        type Row<'a> = (Option<&'a str>, &'a [&'a str], Option<&'a str>, Option<&'a str>);
        let rows: &[Row] = &[
            // boot_ip, leased, peer, bound to
            (None, &[], Some(a), Some(a)),
            (None, &[], None, None),
            (None, &[a], Some(a), Some(a)),
            (None, &[a], Some(b), None),
            (Some(a), &[], Some(a), Some(a)),
            (Some(a), &[], Some(b), None),
        ];
        for (i, (boot_ip, leased, peer, want)) in rows.iter().enumerate() {
            let got = bind(&w(*boot_ip, leased), peer.map(ip)).ok();
            assert_eq!(got, want.map(ip), "row {i}");
        }
        // In full DHCP mode a node netboots with a lease from pxed: no lease, no
        // installer (whoever polls the script before the node's DHCP gets nothing).
        let full = |leased: &[&str]| Whereabouts {
            leases_known: true,
            ..w(None, leased)
        };
        assert!(bind(&full(&[]), Some(ip(a))).is_err());
        assert_eq!(bind(&full(&[a]), Some(ip(a))), Ok(ip(a)));
        assert!(bind(&full(&[a]), Some(ip(b))).is_err());
    }

    #[test]
    fn refusals_name_addresses_not_tokens() {
        let e = admit(
            Kind::Boot,
            Kind::Boot,
            &w(Some("10.0.0.5"), &[]),
            Some(ip("10.0.0.9")),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            "request from 10.0.0.9, but the boot token is bound to 10.0.0.5"
        );
        let e = admit(Kind::Agent, Kind::Boot, &w(None, &[]), None)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "the boot token is not accepted for this call (it needs the agent token)"
        );
        assert_eq!(
            canonical(ip("::ffff:10.0.0.5")),
            ip("10.0.0.5"),
            "IPv4 clients of a dual-stack socket compare as IPv4"
        );
    }
}
