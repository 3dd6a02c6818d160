//! The in-memory lease table: the source of truth while running, mirrored to SQLite.
//!
//! `decide` only reads it; the receive loop applies the [`Change`] a decision carries
//! and hands the resulting [`PersistOp`]s to the writer. Times are Unix seconds.

use std::collections::HashMap;
use std::net::Ipv4Addr;

use crate::config::{Pool, Reservation};

use super::packet::Mac;

/// What an address is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    /// Offered and held briefly (memory only, never persisted).
    Offered,
    /// Acknowledged and persisted.
    Bound,
    /// A client said the address is in use by someone else (DHCPDECLINE).
    Declined,
}

impl LeaseState {
    /// The `leases.state` column value (offers are never stored).
    pub fn as_db(self) -> &'static str {
        match self {
            LeaseState::Offered | LeaseState::Bound => "bound",
            LeaseState::Declined => "declined",
        }
    }

    /// Parses a stored `leases.state` (only `bound` and `declined` are ever stored).
    pub fn from_db(s: &str) -> Option<LeaseState> {
        [LeaseState::Bound, LeaseState::Declined]
            .into_iter()
            .find(|l| l.as_db() == s)
    }
}

/// One address and who has it until when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub ip: Ipv4Addr,
    pub mac: Mac,
    pub client_id: Option<Vec<u8>>,
    pub hostname: Option<String>,
    pub state: LeaseState,
    pub expires: u64,
}

/// A change a decision asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Hold `ip` for `mac` until `until` (DISCOVER → OFFER).
    Offer { ip: Ipv4Addr, mac: Mac, until: u64 },
    /// Bind `ip` to `mac` (REQUEST → ACK).
    Bind {
        ip: Ipv4Addr,
        mac: Mac,
        client_id: Option<Vec<u8>>,
        hostname: Option<String>,
        expires: u64,
    },
    /// The client gave `ip` back.
    Release { ip: Ipv4Addr, mac: Mac },
    /// The client found `ip` in use; keep it out of the pool until `until`.
    Decline { ip: Ipv4Addr, mac: Mac, until: u64 },
}

/// What the store must do for a change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PersistOp {
    Upsert(Lease),
    Delete(Ipv4Addr),
}

/// Leases by address and by MAC, plus the static reservations.
#[derive(Debug, Default)]
pub struct LeaseTable {
    by_ip: HashMap<Ipv4Addr, Lease>,
    by_mac: HashMap<Mac, Ipv4Addr>,
    reserved_ip: HashMap<Ipv4Addr, Mac>,
    reserved_mac: HashMap<Mac, (Ipv4Addr, Option<String>)>,
    /// Next-fit allocation: where the last offer was made.
    hint: u32,
}

impl LeaseTable {
    /// A table with the given reservations and (already loaded) leases.
    pub fn new(reservations: &[Reservation], leases: impl IntoIterator<Item = Lease>) -> Self {
        let mut t = LeaseTable::default();
        for r in reservations {
            if let Ok(mac) = r.mac.parse::<Mac>() {
                t.reserved_ip.insert(r.ip, mac);
                t.reserved_mac.insert(mac, (r.ip, r.hostname.clone()));
            }
        }
        for l in leases {
            if l.state != LeaseState::Declined {
                t.by_mac.insert(l.mac, l.ip);
            }
            t.by_ip.insert(l.ip, l);
        }
        t
    }

    /// The lease (bound, offered or expired) `mac` last had.
    pub fn by_mac(&self, mac: Mac) -> Option<&Lease> {
        self.by_mac.get(&mac).and_then(|ip| self.by_ip.get(ip))
    }

    /// The lease on `ip`, if any.
    pub fn by_ip(&self, ip: Ipv4Addr) -> Option<&Lease> {
        self.by_ip.get(&ip)
    }

    /// The reserved address (and hostname) of `mac`.
    pub fn reservation(&self, mac: Mac) -> Option<(Ipv4Addr, Option<&str>)> {
        self.reserved_mac
            .get(&mac)
            .map(|(ip, h)| (*ip, h.as_deref()))
    }

    /// Number of entries (any state).
    pub fn len(&self) -> usize {
        self.by_ip.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.by_ip.is_empty()
    }

    /// Whether `mac` may have `ip` now: not reserved for another MAC, and not held,
    /// bound or declined by anyone else (expired entries are free).
    pub fn available(&self, ip: Ipv4Addr, mac: Mac, now: u64) -> bool {
        if self.reserved_ip.get(&ip).is_some_and(|m| *m != mac) {
            return false;
        }
        match self.by_ip.get(&ip) {
            None => true,
            Some(l) if l.expires <= now => true,
            Some(l) => l.mac == mac && l.state != LeaseState::Declined,
        }
    }

    /// A free address in `pool` for `mac`, skipping `exclude` (the server itself),
    /// searching on from the last offer so fresh addresses go first.
    pub fn find_free(
        &self,
        pool: &Pool,
        mac: Mac,
        exclude: Ipv4Addr,
        now: u64,
    ) -> Option<Ipv4Addr> {
        let start = u32::from(pool.start);
        let len = pool.len();
        let first = if pool.contains(Ipv4Addr::from(self.hint)) {
            self.hint - start
        } else {
            0
        };
        (0..len)
            .map(|i| Ipv4Addr::from(start + (first + i) % len))
            .find(|ip| *ip != exclude && self.available(*ip, mac, now))
    }

    /// Applies a change; returns what must be written to the store.
    pub fn apply(&mut self, change: &Change) -> Vec<PersistOp> {
        match change {
            Change::Offer { ip, mac, until } => {
                self.hint = u32::from(*ip).wrapping_add(1);
                if let Some(l) = self.by_ip.get(ip)
                    && l.mac == *mac
                    && l.state == LeaseState::Bound
                {
                    // Re-offering a client its own lease: keep it bound.
                    return Vec::new();
                }
                // A previous hold elsewhere is dropped; a bound lease elsewhere stays
                // until the client binds the new one.
                if let Some(old) = self.by_mac.get(mac).copied()
                    && old != *ip
                    && self
                        .by_ip
                        .get(&old)
                        .is_some_and(|l| l.state == LeaseState::Offered)
                {
                    self.by_ip.remove(&old);
                }
                self.insert(Lease {
                    ip: *ip,
                    mac: *mac,
                    client_id: None,
                    hostname: None,
                    state: LeaseState::Offered,
                    expires: *until,
                });
                Vec::new()
            }
            Change::Bind {
                ip,
                mac,
                client_id,
                hostname,
                expires,
            } => {
                let mut ops = Vec::with_capacity(2);
                if let Some(old) = self.by_mac.get(mac).copied()
                    && old != *ip
                    && let Some(l) = self.by_ip.get(&old)
                    && l.mac == *mac
                    && l.state != LeaseState::Declined
                {
                    if l.state == LeaseState::Bound {
                        ops.push(PersistOp::Delete(old));
                    }
                    self.by_ip.remove(&old);
                }
                self.evict_other_owner(*ip, *mac);
                let lease = Lease {
                    ip: *ip,
                    mac: *mac,
                    client_id: client_id.clone(),
                    hostname: hostname.clone(),
                    state: LeaseState::Bound,
                    expires: *expires,
                };
                ops.push(PersistOp::Upsert(lease.clone()));
                self.insert(lease);
                ops
            }
            Change::Release { ip, mac } => {
                if self.by_ip.get(ip).is_some_and(|l| l.mac == *mac) {
                    self.by_ip.remove(ip);
                    if self.by_mac.get(mac) == Some(ip) {
                        self.by_mac.remove(mac);
                    }
                    vec![PersistOp::Delete(*ip)]
                } else {
                    Vec::new()
                }
            }
            Change::Decline { ip, mac, until } => {
                if self.by_mac.get(mac) == Some(ip) {
                    self.by_mac.remove(mac);
                }
                self.evict_other_owner(*ip, *mac);
                let lease = Lease {
                    ip: *ip,
                    mac: *mac,
                    client_id: None,
                    hostname: None,
                    state: LeaseState::Declined,
                    expires: *until,
                };
                self.by_ip.insert(*ip, lease.clone());
                vec![PersistOp::Upsert(lease)]
            }
        }
    }

    /// `ip` is about to be `mac`'s: if it was someone else's (an expired lease), that
    /// client no longer has it.
    fn evict_other_owner(&mut self, ip: Ipv4Addr, mac: Mac) {
        if let Some(prev) = self.by_ip.get(&ip)
            && prev.mac != mac
        {
            self.by_mac.remove(&prev.mac);
        }
    }

    fn insert(&mut self, lease: Lease) {
        self.by_mac.insert(lease.mac, lease.ip);
        self.by_ip.insert(lease.ip, lease);
    }

    /// The store refused to bind `ip` (another pxed on the same database holds it):
    /// the table takes the holder's lease as it is, or, when the store could not say
    /// who holds it, forgets `ip` so that the next offer is checked again. Whoever
    /// this table thought had `ip` no longer has it.
    pub fn learn(&mut self, ip: Ipv4Addr, holder: Option<Lease>) {
        if let Some(prev) = self.by_ip.remove(&ip)
            && self.by_mac.get(&prev.mac) == Some(&ip)
        {
            self.by_mac.remove(&prev.mac);
        }
        if let Some(l) = holder {
            if l.state == LeaseState::Declined {
                self.by_ip.insert(l.ip, l);
            } else {
                self.insert(l);
            }
        }
    }

    /// Another instance changed the lease of `ip` (announced by the database): the
    /// table takes `stored`, the row as it is now, or forgets the lease when there is
    /// none (released or expired there). An offer this instance holds in memory only
    /// stays: the database has no row for it, and the commit decides it anyway.
    pub fn follow(&mut self, ip: Ipv4Addr, stored: Option<Lease>) {
        match stored {
            Some(l) => {
                if self.by_ip.get(&ip) != Some(&l) {
                    self.learn(ip, Some(l));
                }
            }
            None => {
                if self
                    .by_ip
                    .get(&ip)
                    .is_some_and(|l| l.state != LeaseState::Offered)
                {
                    self.learn(ip, None);
                }
            }
        }
    }

    /// Forgets every entry that expired at or before `now`; returns how many.
    pub fn sweep(&mut self, now: u64) -> usize {
        let before = self.by_ip.len();
        self.by_ip.retain(|_, l| l.expires > now);
        let by_ip = &self.by_ip;
        self.by_mac.retain(|_, ip| by_ip.contains_key(ip));
        before - self.by_ip.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mac(n: u8) -> Mac {
        Mac([0x52, 0x54, 0, 0, 0, n])
    }
    fn ip(n: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 0, 0, n)
    }
    fn pool() -> Pool {
        Pool {
            start: ip(10),
            end: ip(12),
        }
    }

    #[test]
    fn holds_keep_two_discovers_apart() {
        let mut t = LeaseTable::default();
        let a = t.find_free(&pool(), mac(1), ip(1), 100).unwrap();
        t.apply(&Change::Offer {
            ip: a,
            mac: mac(1),
            until: 110,
        });
        let b = t.find_free(&pool(), mac(2), ip(1), 100).unwrap();
        assert_ne!(a, b);
        // Once the hold lapses the address is free again.
        assert!(t.available(a, mac(2), 110));
    }

    #[test]
    fn pool_exhaustion_and_reservations() {
        let r = vec![Reservation {
            mac: "52:54:00:00:00:09".into(),
            ip: ip(11),
            hostname: None,
        }];
        let mut t = LeaseTable::new(&r, []);
        assert!(!t.available(ip(11), mac(1), 0));
        assert!(t.available(ip(11), mac(9), 0));
        for m in 1..=2 {
            let a = t.find_free(&pool(), mac(m), ip(1), 0).unwrap();
            assert_ne!(a, ip(11));
            t.apply(&Change::Offer {
                ip: a,
                mac: mac(m),
                until: 10,
            });
        }
        assert_eq!(t.find_free(&pool(), mac(3), ip(1), 0), None);
    }

    #[test]
    fn bind_moves_a_client_and_persists() {
        let mut t = LeaseTable::default();
        let bind = |ip, expires| Change::Bind {
            ip,
            mac: mac(1),
            client_id: None,
            hostname: None,
            expires,
        };
        let ops = t.apply(&bind(ip(10), 100));
        assert!(matches!(&ops[..], [PersistOp::Upsert(l)] if l.ip == ip(10)));
        let ops = t.apply(&bind(ip(11), 100));
        assert_eq!(ops[0], PersistOp::Delete(ip(10)));
        assert!(t.by_ip(ip(10)).is_none());
        assert_eq!(t.by_mac(mac(1)).unwrap().ip, ip(11));
        assert_eq!(
            t.apply(&Change::Release {
                ip: ip(11),
                mac: mac(2)
            }),
            vec![]
        );
        assert_eq!(
            t.apply(&Change::Release {
                ip: ip(11),
                mac: mac(1)
            }),
            vec![PersistOp::Delete(ip(11))]
        );
        assert!(t.is_empty());
    }

    #[test]
    fn declined_addresses_are_skipped_until_they_expire() {
        let mut t = LeaseTable::default();
        t.apply(&Change::Decline {
            ip: ip(10),
            mac: mac(1),
            until: 50,
        });
        assert!(!t.available(ip(10), mac(1), 10));
        assert!(t.by_mac(mac(1)).is_none());
        assert_eq!(t.find_free(&pool(), mac(1), ip(1), 10), Some(ip(11)));
        assert_eq!(t.sweep(50), 1);
        assert!(t.available(ip(10), mac(1), 50));
    }
}
