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
//!
//! "A real client's round trip" is measured, not assumed: a half-open transfer is
//! ended only once it is older than [`GRACE_FACTOR`] times the smoothed time real
//! clients have taken to answer (RFC 6298's SRTT, from admission to the first
//! acknowledgement, so a busy server's own delay counts). Without that, a boot storm
//! is its own flood: 1,000 machines powered on in one second ended 70 genuine
//! transfers whose firmware was a few milliseconds from answering, each a failed
//! boot. A newcomer that finds only younger half-open transfers is refused like one
//! that finds none, and its client's retransmission comes back later.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// Why a request gets no transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Its client already has the per-client number of transfers in flight.
    Client,
    /// Every slot is taken by a transfer whose client has answered.
    Full,
}

/// A half-open transfer is ended for a newcomer once older than this many smoothed
/// answer times (TCP retransmits after SRTT + 4 × RTTVAR; 4 × SRTT is as patient).
pub const GRACE_FACTOR: u32 = 4;
/// Bounds on that age: a flood on an idle LAN still meets the floor; a server so busy
/// that answers take seconds still ends a silent transfer within the ceiling.
pub const GRACE_MIN: Duration = Duration::from_millis(10);
pub const GRACE_MAX: Duration = Duration::from_secs(2);

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
    half_open: BTreeMap<u64, HalfOpen>,
    next: u64,
    /// Smoothed time from admission to the client's first answer (RFC 6298, α = 1/8).
    srtt: Option<Duration>,
}

#[derive(Debug)]
struct HalfOpen {
    ip: IpAddr,
    since: Instant,
    evict: CancellationToken,
}

impl Inner {
    /// How old the oldest half-open transfer must be before a newcomer may end it.
    /// Before any client has answered, the floor: a flood that comes first meets the
    /// strictest test.
    fn grace(&self) -> Duration {
        self.srtt
            .map_or(GRACE_MIN, |s| s * GRACE_FACTOR)
            .clamp(GRACE_MIN, GRACE_MAX)
    }

    fn sample(&mut self, rtt: Duration) {
        self.srtt = Some(match self.srtt {
            None => rtt,
            Some(s) => (s * 7 + rtt) / 8,
        });
    }

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
    /// half-open transfer makes room if it has outlived the grace (see the module
    /// notes): its ticket's [`Ticket::evicted`] fires.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<Ticket, Refused> {
        self.admit_at(ip, Instant::now())
    }

    fn admit_at(self: &Arc<Self>, ip: IpAddr, now: Instant) -> Result<Ticket, Refused> {
        let mut inner = self.lock();
        if inner.clients.get(&ip).copied().unwrap_or(0) >= self.per_client {
            return Err(Refused::Client);
        }
        if inner.total >= self.max {
            let grace = inner.grace();
            let Some(entry) = inner.half_open.first_entry() else {
                return Err(Refused::Full);
            };
            if now.saturating_duration_since(entry.get().since) < grace {
                return Err(Refused::Full);
            }
            let victim = entry.remove();
            // Cancelled under the lock: a cancelled token is how the victim's
            // ticket knows its slot was already given up.
            victim.evict.cancel();
            inner.release(victim.ip);
        }
        inner.total += 1;
        *inner.clients.entry(ip).or_default() += 1;
        let id = inner.next;
        inner.next += 1;
        let evict = CancellationToken::new();
        inner.half_open.insert(
            id,
            HalfOpen {
                ip,
                since: now,
                evict: evict.clone(),
            },
        );
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

    /// The client answered: the transfer can no longer be evicted, and the time it
    /// took is a sample of what real clients take. False if it already was evicted.
    pub fn answered(&self) -> bool {
        self.answered_at(Instant::now())
    }

    fn answered_at(&self, now: Instant) -> bool {
        let mut inner = self.admission.lock();
        if self.evict.is_cancelled() {
            return false;
        }
        if let Some(h) = inner.half_open.remove(&self.id) {
            inner.sample(now.saturating_duration_since(h.since));
        }
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
        let t0 = Instant::now();
        let later = t0 + GRACE_MAX;
        let a = Admission::new(3, 4);
        let answered = a.admit_at(ip(1), t0).unwrap();
        assert!(answered.answered_at(t0));
        let old = a.admit_at(ip(2), t0).unwrap();
        let young = a.admit_at(ip(3), t0).unwrap();
        let new = a.admit_at(ip(4), later).unwrap();
        assert!(old.evicted().is_cancelled());
        assert!(!old.answered_at(later), "an evicted transfer cannot start");
        assert!(!young.evicted().is_cancelled());
        assert!(!answered.evicted().is_cancelled());
        assert_eq!(a.counts(), (3, 3, 2));
        // The victim's ticket gives nothing back twice.
        drop(old);
        assert_eq!(a.counts(), (3, 3, 2));
        assert!(young.answered_at(later));
        assert!(new.answered_at(later));
        assert_eq!(a.admit_at(ip(5), later).unwrap_err(), Refused::Full);
        drop((answered, young, new));
        assert_eq!(a.counts(), (0, 0, 0));
    }

    #[test]
    fn a_half_open_transfer_younger_than_the_grace_is_spared() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let a = Admission::new(1, 4);
        // Before any answer the grace is the floor.
        let first = a.admit_at(ip(1), t0).unwrap();
        assert_eq!(a.admit_at(ip(2), ms(9)).unwrap_err(), Refused::Full);
        assert!(!first.evicted().is_cancelled());
        assert!(a.admit_at(ip(2), ms(10)).is_ok());
        assert!(first.evicted().is_cancelled());
    }

    #[test]
    fn the_grace_follows_how_long_real_clients_take_to_answer() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let a = Admission::new(1, 4);
        // A loaded server: clients answer 300 ms after their request.
        let t = a.admit_at(ip(1), t0).unwrap();
        assert!(t.answered_at(ms(300)));
        drop(t);
        assert_eq!(a.lock().grace(), Duration::from_millis(1200));
        let waiting = a.admit_at(ip(2), ms(1000)).unwrap();
        // 1.1 s old: far past the floor, still inside 4 × 300 ms.
        assert_eq!(a.admit_at(ip(3), ms(2100)).unwrap_err(), Refused::Full);
        assert!(
            waiting.answered_at(ms(2150)),
            "the slow client kept its transfer"
        );
        drop(waiting);
        // Fast answers bring it down, never below the floor.
        for i in 0..64 {
            let t = a.admit_at(ip(4), ms(3000 + i)).unwrap();
            assert!(t.answered_at(ms(3000 + i)));
        }
        assert_eq!(a.lock().grace(), GRACE_MIN);
        // A client that never answers is ended after that floor, not before.
        let silent = a.admit_at(ip(5), ms(4000)).unwrap();
        assert_eq!(a.admit_at(ip(6), ms(4009)).unwrap_err(), Refused::Full);
        let _newcomer = a.admit_at(ip(6), ms(4010)).unwrap();
        assert!(silent.evicted().is_cancelled());
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
