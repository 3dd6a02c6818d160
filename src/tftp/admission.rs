//! Which requests get a transfer: a cap on all transfers, a cap per client address,
//! and room made for a newcomer by ending the oldest half-open transfer.
//!
//! A transfer is half-open from its RRQ until the client acknowledges the first OACK
//! or DATA. Anyone on the segment can send RRQs from forged addresses and never
//! acknowledge, so a half-open transfer holds nothing a newcomer cannot take: when
//! every slot is taken, the oldest half-open transfer is ended to make room (as a
//! SYN cache drops its oldest entry). A flood then has to fill every slot within a
//! real client's round trip to refuse it. Transfers whose client has answered are
//! never ended for a newcomer; over the cap those newcomers are refused.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio_util::sync::CancellationToken;

/// Why a request gets no transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Its client already has the per-client number of transfers in flight.
    Client,
    /// Every slot is taken by a transfer whose client has answered.
    Full,
}

/// The counts behind every [`Ticket`].
#[derive(Debug)]
pub struct Admission {
    max: usize,
    per_client: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    total: usize,
    clients: HashMap<IpAddr, usize>,
    /// Half-open transfers by admission order: the first is the oldest.
    half_open: BTreeMap<u64, (IpAddr, CancellationToken)>,
    next: u64,
}

impl Inner {
    fn release(&mut self, ip: IpAddr) {
        self.total -= 1;
        if let Some(n) = self.clients.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                self.clients.remove(&ip);
            }
        }
    }
}

impl Admission {
    /// At most `max` transfers, at most `per_client` of them from one address.
    pub fn new(max: usize, per_client: usize) -> Arc<Self> {
        Arc::new(Admission {
            max,
            per_client,
            inner: Mutex::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing panics while holding the lock; a poisoned lock still has
        // consistent counts.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits a half-open transfer for `ip`. When every slot is taken, the oldest
    /// half-open transfer makes room: its ticket's [`Ticket::evicted`] fires.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<Ticket, Refused> {
        let mut inner = self.lock();
        if inner.clients.get(&ip).copied().unwrap_or(0) >= self.per_client {
            return Err(Refused::Client);
        }
        if inner.total >= self.max {
            let Some((_, (victim, token))) = inner.half_open.pop_first() else {
                return Err(Refused::Full);
            };
            // Cancelled under the lock: a cancelled token is how the victim's
            // ticket knows its slot was already given up.
            token.cancel();
            inner.release(victim);
        }
        inner.total += 1;
        *inner.clients.entry(ip).or_default() += 1;
        let id = inner.next;
        inner.next += 1;
        let evict = CancellationToken::new();
        inner.half_open.insert(id, (ip, evict.clone()));
        Ok(Ticket {
            admission: self.clone(),
            id,
            ip,
            evict,
        })
    }

    #[cfg(test)]
    fn counts(&self) -> (usize, usize, usize) {
        let inner = self.lock();
        (inner.total, inner.clients.len(), inner.half_open.len())
    }
}

/// One admitted transfer's slot, given back on drop.
#[derive(Debug)]
pub struct Ticket {
    admission: Arc<Admission>,
    id: u64,
    ip: IpAddr,
    evict: CancellationToken,
}

impl Ticket {
    /// Fires when a newcomer took this half-open transfer's slot; the transfer
    /// must end.
    pub fn evicted(&self) -> &CancellationToken {
        &self.evict
    }

    /// The client answered: the transfer can no longer be evicted. False if it
    /// already was.
    pub fn answered(&self) -> bool {
        let mut inner = self.admission.lock();
        if self.evict.is_cancelled() {
            return false;
        }
        inner.half_open.remove(&self.id);
        true
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut inner = self.admission.lock();
        if self.evict.is_cancelled() {
            return;
        }
        inner.half_open.remove(&self.id);
        inner.release(self.ip);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    #[test]
    fn per_client_cap_then_release() {
        let a = Admission::new(10, 2);
        let t1 = a.admit(ip(1)).unwrap();
        let _t2 = a.admit(ip(1)).unwrap();
        assert_eq!(a.admit(ip(1)).unwrap_err(), Refused::Client);
        let _other = a.admit(ip(2)).unwrap();
        drop(t1);
        let _t3 = a.admit(ip(1)).unwrap();
        assert_eq!(a.counts(), (3, 2, 3));
    }

    #[test]
    fn full_evicts_the_oldest_half_open_only() {
        let a = Admission::new(3, 4);
        let answered = a.admit(ip(1)).unwrap();
        assert!(answered.answered());
        let old = a.admit(ip(2)).unwrap();
        let young = a.admit(ip(3)).unwrap();
        let new = a.admit(ip(4)).unwrap();
        assert!(old.evicted().is_cancelled());
        assert!(!old.answered(), "an evicted transfer cannot start");
        assert!(!young.evicted().is_cancelled());
        assert!(!answered.evicted().is_cancelled());
        assert_eq!(a.counts(), (3, 3, 2));
        // The victim's ticket gives nothing back twice.
        drop(old);
        assert_eq!(a.counts(), (3, 3, 2));
        assert!(young.answered());
        assert!(new.answered());
        assert_eq!(a.admit(ip(5)).unwrap_err(), Refused::Full);
        drop((answered, young, new));
        assert_eq!(a.counts(), (0, 0, 0));
    }

    #[test]
    fn the_per_client_cap_comes_before_eviction() {
        let a = Admission::new(2, 1);
        let _t = a.admit(ip(1)).unwrap();
        assert_eq!(a.admit(ip(1)).unwrap_err(), Refused::Client);
        let _u = a.admit(ip(2)).unwrap();
        assert_eq!(a.counts(), (2, 2, 2));
    }
}
