//! Discovery: every netboot client the DHCP server sees that pxed does not know yet
//! becomes a `discovered` node, with the architecture its option 93 implies.
//!
//! Only DHCP-seen netboot clients are registered: a script fetch for an unknown MAC
//! is answered (with the discovery script) and counted, never stored, so nobody on the
//! VLAN can fill the inventory over HTTP. The cache of known MACs is bounded, and so
//! is registration itself ([`DiscoverySettings`]): spoofed DISCOVERs beyond the cap of
//! pending (unenrolled) nodes or the rate per minute are counted, not stored.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::config::DiscoverySettings;

use crate::lifecycle::worker::Lifecycle;
use crate::metrics::Counter;
use crate::model::{Arch, Mac, State};
use crate::store::Store;

/// How many MACs the known-MAC cache holds before it starts over. The store decides
/// what is known; the cache only spares it repeated lookups.
pub const KNOWN_MACS_CAP: usize = 65_536;

/// The known-MAC cache, the registration bounds and the discovery counters.
#[derive(Debug, Default)]
pub struct Discovery {
    known: Mutex<HashSet<Mac>>,
    settings: DiscoverySettings,
    /// Registrations in the current one-minute window, and when it started.
    window: Mutex<Option<(Instant, u32)>>,
    /// Machines registered as discovered.
    pub discovered: Counter,
    /// Unknown clients not registered because `max_pending` nodes wait already.
    pub refused_cap: Counter,
    /// Unknown clients not registered because of the per-minute rate.
    pub refused_rate: Counter,
    /// The address each netboot MAC last asked for in a DHCPREQUEST, and when.
    sightings: Mutex<HashMap<Mac, (Ipv4Addr, Instant)>>,
    /// Told of every DHCP packet from a netboot client (stages from the wire).
    pub stages: std::sync::OnceLock<std::sync::Arc<crate::stages::Stages>>,
    /// Nodes that netbooted while `available` or `allocated` (something reset them):
    /// node id -> (its state then, the boot MAC, when; RFC 3339). A leftover until an
    /// operator acknowledges it or the node leaves that state (see `crate::leftovers`).
    netboots_at_rest: Mutex<HashMap<i64, (State, Mac, String)>>,
}

/// Most MACs whose requested address is remembered (a spoofed-MAC flood cannot grow
/// memory without bound: past it, sightings older than [`SIGHTING_TTL`] are dropped,
/// then all).
const SIGHTINGS_CAP: usize = 65_536;

/// How long a sighting stands for the node's address: a machine netbooting now asked
/// for its address a few minutes ago at most.
pub const SIGHTING_TTL: Duration = Duration::from_secs(3600);

impl Discovery {
    /// Discovery within `settings`.
    pub fn new(settings: DiscoverySettings) -> Discovery {
        Discovery {
            settings,
            ..Discovery::default()
        }
    }

    /// How many of `wanted` new machines may be registered now, given `pending`
    /// discovered nodes in the store; counts the rest as refused. Takes them from
    /// this minute's budget.
    fn admit(&self, wanted: usize, pending: u64, now: Instant) -> usize {
        let room = u64::from(self.settings.max_pending).saturating_sub(pending);
        let by_cap = wanted.min(usize::try_from(room).unwrap_or(usize::MAX));
        let mut window = self.window.lock().expect("lock");
        let (start, used) = match *window {
            Some((start, used)) if now.duration_since(start) < Duration::from_secs(60) => {
                (start, used)
            }
            _ => (now, 0),
        };
        let budget = self.settings.per_minute.saturating_sub(used) as usize;
        let admitted = by_cap.min(budget);
        *window = Some((start, used + admitted as u32));
        self.refused_cap.add((wanted - by_cap) as u64);
        self.refused_rate.add((by_cap - admitted) as u64);
        admitted
    }
    /// Drops MACs from the cache (their node was deleted, so DHCP may rediscover them).
    pub fn forget(&self, macs: &[Mac]) {
        let mut known = self.known.lock().expect("lock");
        for m in macs {
            known.remove(m);
        }
    }

    fn remember(&self, macs: impl IntoIterator<Item = Mac>) {
        let mut known = self.known.lock().expect("lock");
        for m in macs {
            if known.len() >= KNOWN_MACS_CAP {
                known.clear();
            }
            known.insert(m);
        }
    }

    /// Remembers the address a MAC asked for.
    fn sight(&self, mac: Mac, ip: Ipv4Addr, now: Instant) {
        let mut s = self.sightings.lock().expect("lock");
        if s.len() >= SIGHTINGS_CAP && !s.contains_key(&mac) {
            s.retain(|_, (_, at)| now.duration_since(*at) < SIGHTING_TTL);
            if s.len() >= SIGHTINGS_CAP {
                s.clear();
            }
        }
        s.insert(mac, (ip, now));
    }

    /// The addresses `macs` asked for in the last [`SIGHTING_TTL`] (proxy mode: where
    /// the node is, as the site's DHCP server was told).
    pub fn sighted(&self, macs: &[Mac]) -> Vec<IpAddr> {
        let now = Instant::now();
        let s = self.sightings.lock().expect("lock");
        macs.iter()
            .filter_map(|m| s.get(m))
            .filter(|(_, at)| now.duration_since(*at) < SIGHTING_TTL)
            .map(|(ip, _)| IpAddr::V4(*ip))
            .collect()
    }

    /// How many MACs the cache holds now.
    pub fn cached(&self) -> usize {
        self.known.lock().expect("lock").len()
    }

    /// Nodes that netbooted while resting, as [`Discovery::netboots_at_rest`] holds them.
    pub fn netboots_at_rest(&self) -> Vec<(i64, State, Mac, String)> {
        let m = self.netboots_at_rest.lock().expect("lock");
        let mut v: Vec<_> = m
            .iter()
            .map(|(id, (st, mac, at))| (*id, *st, *mac, at.clone()))
            .collect();
        v.sort_by_key(|x| x.0);
        v
    }

    /// Forgets that node `id` netbooted while resting (acknowledged, or it moved on).
    pub fn forget_netboot_at_rest(&self, id: i64) -> bool {
        self.netboots_at_rest
            .lock()
            .expect("lock")
            .remove(&id)
            .is_some()
    }

    /// DHCP from known nodes' boot MACs: a node `netbooting` has netbooted (the power
    /// action worked: `NetbootObserved`, applied only when the lookup's snapshot says it
    /// can change the node: not before the reset was sent, nor once observed); one
    /// `available` or `allocated` was reset behind pxed's back (a leftover).
    async fn feed_netboots(&self, store: &Store, lifecycle: &Arc<Lifecycle>, macs: &[Mac]) {
        let nodes = match store.nodes_by_boot_macs(macs).await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "looking up netbooting nodes");
                return;
            }
        };
        for n in nodes {
            let (mac, id, state) = (n.mac, n.id, n.state);
            match state {
                State::Netbooting | State::Reclaiming => {
                    if !crate::lifecycle::transition::netboot_sighting_matters(
                        state,
                        n.cycle_sent,
                        n.netboot_observed,
                    ) {
                        continue;
                    }
                    let ev = crate::lifecycle::transition::Event::NetbootObserved {
                        generation: n.generation,
                        after_reset: n.cycle_sent,
                    };
                    if let Err(e) = lifecycle.apply(id, &ev, "dhcp").await {
                        tracing::debug!(node = id, %mac, error = %e, "netboot observed, not applied");
                    }
                }
                State::Available | State::Allocated => {
                    let mut m = self.netboots_at_rest.lock().expect("lock");
                    if m.len() < SIGHTINGS_CAP && !m.contains_key(&id) {
                        tracing::warn!(node = id, %mac, %state, "a resting node netbooted: something reset it");
                        m.insert(id, (state, mac, crate::store::nodes::now()));
                    }
                }
                _ => {}
            }
        }
    }

    /// Registers what DHCP saw, batched: a burst of new machines is one transaction,
    /// so discovery never holds up lease commits. Ends when the DHCP server drops its
    /// sender.
    pub async fn run(
        &self,
        store: &Store,
        lifecycle: &Arc<Lifecycle>,
        mut rx: tokio::sync::mpsc::Receiver<crate::dhcp::DhcpSeen>,
    ) {
        let mut batch = Vec::new();
        while rx.recv_many(&mut batch, 256).await > 0 {
            let mut new: Vec<(Mac, Option<Arch>)> = Vec::new();
            let mut netbooted: Vec<Mac> = Vec::new();
            {
                let known = self.known.lock().expect("lock");
                for seen in batch.drain(..) {
                    let mac = seen.mac;
                    if let Some(stages) = self.stages.get() {
                        stages.dhcp_seen(&seen);
                    }
                    if !netbooted.contains(&mac) {
                        netbooted.push(mac);
                    }
                    if let Some(ip) = seen.address {
                        self.sight(mac, ip, Instant::now());
                    }
                    if !known.contains(&mac) && !new.iter().any(|(m, _)| *m == mac) {
                        new.push((mac, seen.arch.and_then(Arch::from_client_arch)));
                    }
                }
            }
            if !netbooted.is_empty() {
                self.feed_netboots(store, lifecycle, &netbooted).await;
            }
            if new.is_empty() {
                continue;
            }
            // Only machines the store does not know count against the bounds.
            let macs: Vec<Mac> = new.iter().map(|(m, _)| *m).collect();
            let (unknown, pending) =
                match tokio::try_join!(store.unknown_macs(&macs), store.pending_discovered()) {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(error = %e, "checking discovered machines");
                        continue;
                    }
                };
            let admitted = self.admit(unknown.len(), pending, Instant::now());
            if admitted < unknown.len() {
                tracing::debug!(
                    unknown = unknown.len(),
                    admitted,
                    pending,
                    "discovery bounds reached: the rest are counted, not stored"
                );
            }
            // Machines the store knows go to the cache; refused ones stay out of it,
            // so they are registered once there is room.
            self.remember(macs.into_iter().filter(|m| !unknown.contains(m)));
            let admit: HashSet<Mac> = unknown.into_iter().take(admitted).collect();
            new.retain(|(m, _)| admit.contains(m));
            if new.is_empty() {
                continue;
            }
            match store.discover_many(&new).await {
                Ok(created) => {
                    for (id, mac) in &created {
                        self.discovered.inc();
                        lifecycle.notify(*id, "registered", State::Discovered);
                        tracing::info!(node = id, %mac, "discovered a new machine");
                    }
                    self.remember(new.into_iter().map(|(m, _)| m));
                }
                Err(e) => {
                    tracing::warn!(error = %e, n = new.len(), "registering discovered machines")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::config::DiscoverySettings;

    fn mac(i: u32) -> Mac {
        let b = i.to_be_bytes();
        Mac([0x52, 0x54, b[0], b[1], b[2], b[3]])
    }

    /// Runs discovery over `n` spoofed netboot clients (plus every one of them again)
    /// against a real store; returns the store and the discovery.
    async fn flood(settings: DiscoverySettings, n: u32) -> (Store, Discovery, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).await.unwrap();
        let lifecycle = Lifecycle::for_tests(&store);
        let d = Discovery::new(settings);
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        for i in (0..n).chain(0..n) {
            tx.send(crate::dhcp::DhcpSeen {
                mac: mac(i),
                arch: Some(7),
                vendor_class: None,
                user_class_ipxe: false,
                // Every client asks for an address of its own (10.0.x.y).
                address: Some(Ipv4Addr::new(10, 0, (i >> 8) as u8, i as u8)),
            })
            .await
            .unwrap();
        }
        drop(tx);
        d.run(&store, &lifecycle, rx).await;
        (store, d, dir)
    }

    /// Spoofed DISCOVERs fill no more than `max_pending` discovered nodes; the rest
    /// are counted (each time they are seen), not stored.
    #[tokio::test]
    async fn registration_stops_at_the_cap() {
        let settings = DiscoverySettings {
            max_pending: 5,
            per_minute: 1000,
        };
        let (store, d, _dir) = flood(settings, 40).await;
        assert_eq!(store.pending_discovered().await.unwrap(), 5);
        assert_eq!(d.discovered.get(), 5);
        assert_eq!(
            d.refused_cap.get(),
            35,
            "a client seen twice in one batch counts once"
        );
        assert_eq!(d.refused_rate.get(), 0);
    }

    /// No more than `per_minute` registrations a minute.
    #[tokio::test]
    async fn registration_is_rate_limited() {
        let settings = DiscoverySettings {
            max_pending: 1000,
            per_minute: 3,
        };
        let (store, d, _dir) = flood(settings, 20).await;
        assert_eq!(store.pending_discovered().await.unwrap(), 3);
        assert_eq!(d.refused_rate.get(), 17);
    }

    #[test]
    fn the_rate_window_starts_over_after_a_minute() {
        let d = Discovery::new(DiscoverySettings {
            max_pending: 100,
            per_minute: 10,
        });
        let t0 = Instant::now();
        assert_eq!(d.admit(8, 0, t0), 8);
        assert_eq!(d.admit(8, 8, t0 + Duration::from_secs(30)), 2);
        assert_eq!(d.admit(8, 10, t0 + Duration::from_secs(61)), 8);
        assert_eq!(d.admit(200, 18, t0 + Duration::from_secs(200)), 10);
        assert_eq!(d.refused_rate.get(), 6 + 72);
        assert_eq!(d.refused_cap.get(), 118);
    }

    #[test]
    fn the_cache_is_bounded() {
        let d = Discovery::default();
        let mac = |i: usize| {
            let b = (i as u32).to_be_bytes();
            Mac([0x52, 0x54, b[0], b[1], b[2], b[3]])
        };
        d.remember((0..KNOWN_MACS_CAP + 10).map(mac));
        assert!(d.cached() <= KNOWN_MACS_CAP);
        assert!(d.cached() >= 10);
        let last = mac(KNOWN_MACS_CAP + 9);
        assert!(d.known.lock().unwrap().contains(&last));
        d.forget(&[last]);
        assert!(!d.known.lock().unwrap().contains(&last));
    }

    /// Proxy mode's stand-in for a lease: the address each MAC last asked for, for an
    /// hour, bounded in memory.
    #[tokio::test]
    async fn requested_addresses_are_remembered_bounded() {
        let settings = DiscoverySettings {
            max_pending: 5,
            per_minute: 1000,
        };
        let (_s, d, _dir) = flood(settings, 300).await;
        // Remembered for every client heard, registered or not.
        assert_eq!(
            d.sighted(&[mac(7), mac(299), mac(5000)]),
            vec![IpAddr::from([10, 0, 0, 7]), IpAddr::from([10, 0, 1, 43])]
        );
        let now = Instant::now();
        d.sight(mac(7), Ipv4Addr::new(10, 9, 9, 9), now);
        assert_eq!(d.sighted(&[mac(7)]), vec![IpAddr::from([10, 9, 9, 9])]);
        // Old sightings stand for nothing.
        if let Some(old) = now.checked_sub(SIGHTING_TTL) {
            d.sight(mac(8), Ipv4Addr::new(10, 9, 9, 8), old);
            assert!(d.sighted(&[mac(8)]).is_empty());
        }
        // A flood of spoofed MACs cannot grow the map past its cap.
        for i in 0..(SIGHTINGS_CAP as u32 + 10) {
            d.sight(mac(100_000 + i), Ipv4Addr::new(10, 1, 1, 1), now);
        }
        assert!(d.sightings.lock().unwrap().len() <= SIGHTINGS_CAP);
    }
}
