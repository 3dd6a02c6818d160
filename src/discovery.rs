//! Discovery: every netboot client the DHCP server sees that pxed does not know yet
//! becomes a `discovered` node, with the architecture its option 93 implies.
//!
//! Only DHCP-seen netboot clients are registered: a script fetch for an unknown MAC
//! is answered (with the discovery script) and counted, never stored, so nobody on the
//! VLAN can fill the inventory over HTTP. The cache of known MACs is bounded.

use std::collections::HashSet;
use std::sync::Mutex;

use crate::lifecycle::worker::Lifecycle;
use crate::metrics::Counter;
use crate::model::{Arch, Mac, State};
use crate::store::Store;

/// How many MACs the known-MAC cache holds before it starts over. The store decides
/// what is known; the cache only spares it repeated lookups.
pub const KNOWN_MACS_CAP: usize = 65_536;

/// The known-MAC cache and the discovery counter.
#[derive(Debug, Default)]
pub struct Discovery {
    known: Mutex<HashSet<Mac>>,
    /// Machines registered as discovered.
    pub discovered: Counter,
}

impl Discovery {
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

    /// How many MACs the cache holds now.
    pub fn cached(&self) -> usize {
        self.known.lock().expect("lock").len()
    }

    /// Registers what DHCP saw, batched: a burst of new machines is one transaction,
    /// so discovery never holds up lease commits. Ends when the DHCP server drops its
    /// sender.
    pub async fn run(
        &self,
        store: &Store,
        lifecycle: &Lifecycle,
        mut rx: tokio::sync::mpsc::Receiver<crate::dhcp::DhcpSeen>,
    ) {
        let mut batch = Vec::new();
        while rx.recv_many(&mut batch, 256).await > 0 {
            let mut new: Vec<(Mac, Option<Arch>)> = Vec::new();
            {
                let known = self.known.lock().expect("lock");
                for seen in batch.drain(..) {
                    let mac = seen.mac;
                    if !known.contains(&mac) && !new.iter().any(|(m, _)| *m == mac) {
                        new.push((mac, seen.arch.and_then(Arch::from_client_arch)));
                    }
                }
            }
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
}
