//! Redfish drivers kept per BMC across the steps of a reinstall.
//!
//! A reinstall talks to a node's BMC four times within seconds (set the network boot,
//! power cycle, the out-of-band inventory beside it, clear the override after the
//! netboot). Built afresh for each step, a Redfish driver pays each time for a TLS
//! configuration, a connection (a TLS handshake on a real BMC), the service root, a
//! session (which takes a second or more on some BMCs) and its logout. The pool keeps
//! one driver per endpoint while it is used: its HTTP connections, its session and the
//! system path it found carry over from one step to the next. This is what Ironic does
//! with its sushy connection cache; unlike that cache, a driver idle for
//! [`Pool::IDLE`] is logged out and dropped, since BMCs have few session slots.
//!
//! The key is everything that makes up the endpoint, the password included (hashed):
//! an operator who changes the address, credentials, system id or certificate pin gets
//! a new driver at the next step. IPMI drivers are not pooled (an idle IPMI session
//! expires on the BMC within a minute and is noticed only as silence).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::redfish::RedfishBmc;
use super::{Bmc, BmcEndpoint, BmcError, Driver};

type Key = [u8; 32];

struct Entry {
    bmc: Arc<RedfishBmc>,
    used: Instant,
}

struct Inner {
    /// [`Pool::IDLE`] but in tests.
    idle: Duration,
    map: Mutex<HashMap<Key, Entry>>,
    /// A sweeper task runs (one at most; it ends when the pool is empty).
    sweeping: AtomicBool,
}

/// Redfish drivers by endpoint, one per daemon (see the module docs).
pub struct Pool {
    inner: Arc<Inner>,
}

impl Default for Pool {
    fn default() -> Self {
        Pool::with_idle(Pool::IDLE)
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("drivers", &self.len())
            .finish()
    }
}

/// The pool's key of an endpoint: its debug form (the password redacted) and the
/// password, hashed together.
fn key(ep: &BmcEndpoint) -> Key {
    let mut h = Sha256::new();
    h.update(format!("{ep:?}").as_bytes());
    h.update([0]);
    h.update(ep.password.expose().as_bytes());
    h.finalize().into()
}

impl Pool {
    /// How long an unused driver is kept before its session is closed.
    pub const IDLE: Duration = Duration::from_secs(60);
    /// Drivers kept at most; beyond, the least recently used idle one is closed.
    pub const MAX: usize = 4096;

    /// A pool whose drivers are logged out after `idle` unused ([`Pool::IDLE`] in the
    /// daemon).
    pub fn with_idle(idle: Duration) -> Self {
        Pool {
            inner: Arc::new(Inner {
                idle,
                map: Mutex::default(),
                sweeping: AtomicBool::new(false),
            }),
        }
    }

    /// The driver for `ep`: the pooled one for a Redfish endpoint seen within
    /// [`Pool::IDLE`], else a new one (pooled when Redfish). `close` on a pooled driver
    /// keeps its session; the pool closes it when it goes idle.
    pub fn connect(&self, ep: &BmcEndpoint) -> Result<Arc<dyn Bmc>, BmcError> {
        if ep.driver != Driver::Redfish {
            return super::connect(ep);
        }
        let k = key(ep);
        if let Some(e) = self.lock().get_mut(&k) {
            e.used = Instant::now();
            return Ok(e.bmc.clone());
        }
        // Built outside the lock (a TLS configuration and an HTTP client); should
        // another step have pooled one meanwhile, that one is used.
        let new = Arc::new(RedfishBmc::new(ep)?.pooled());
        let (bmc, spill) = {
            let mut map = self.lock();
            let now = Instant::now();
            if let Some(e) = map.get_mut(&k) {
                e.used = now;
                return Ok(e.bmc.clone());
            }
            let bmc = new;
            let spill = if map.len() >= Self::MAX {
                lru_idle(&map).and_then(|k| map.remove(&k))
            } else {
                None
            };
            map.insert(
                k,
                Entry {
                    bmc: bmc.clone(),
                    used: now,
                },
            );
            (bmc, spill)
        };
        if let Some(e) = spill {
            tokio::spawn(async move { e.bmc.logout().await });
        }
        self.sweep_later();
        Ok(bmc)
    }

    /// Takes `bmc` out of the pool after a step failed with it: the retry starts from
    /// a new driver (connection, login, system found again), as it would without the
    /// pool. Its session ends once no other step holds it.
    pub fn discard(&self, bmc: &Arc<dyn Bmc>) {
        let target = Arc::as_ptr(bmc).cast::<()>();
        let gone = {
            let mut map = self.lock();
            let k = map
                .iter()
                .find(|(_, e)| Arc::as_ptr(&e.bmc).cast::<()>() == target)
                .map(|(k, _)| *k);
            k.and_then(|k| map.remove(&k))
        };
        if let Some(e) = gone {
            let idle = self.inner.idle;
            tokio::spawn(async move {
                // The caller's own reference goes when its step ends; another step
                // (the inventory beside a power cycle) may still be running on it.
                let until = Instant::now() + idle;
                while in_use(&e) > 0 && Instant::now() < until {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                e.bmc.logout().await;
            });
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Entry>> {
        self.inner.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drivers held now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no driver is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Logs every held driver out (shutdown). A driver still in use finishes its
    /// step; its session stays until the BMC expires it.
    pub async fn close_all(&self) {
        let all: Vec<Entry> = {
            let mut map = self.lock();
            map.drain().map(|(_, e)| e).collect()
        };
        futures::future::join_all(all.iter().map(|e| e.bmc.logout())).await;
    }

    /// Starts the sweeper unless one runs: every half idle time it closes the drivers
    /// idle that long; it ends when the pool is empty or dropped.
    fn sweep_later(&self) {
        if self.inner.sweeping.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let every = self.inner.idle / 2;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(inner) = weak.upgrade() else { return };
                let (idle, empty) = inner.take_idle(Instant::now());
                drop(inner);
                futures::future::join_all(idle.iter().map(|b| b.logout())).await;
                if empty {
                    return;
                }
            }
        });
    }
}

impl Inner {
    /// Removes the drivers unused for the idle time and held by no step; returns them and
    /// whether the pool is now empty, in which case the sweeper ends (marked under the
    /// lock, so a driver pooled after it starts a new one).
    fn take_idle(&self, now: Instant) -> (Vec<Arc<RedfishBmc>>, bool) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let gone: Vec<Key> = map
            .iter()
            .filter(|(_, e)| now.duration_since(e.used) >= self.idle && in_use(e) == 0)
            .map(|(k, _)| *k)
            .collect();
        let out = gone
            .iter()
            .filter_map(|k| map.remove(k))
            .map(|e| e.bmc)
            .collect();
        let empty = map.is_empty();
        if empty {
            self.sweeping.store(false, Ordering::Release);
        }
        (out, empty)
    }
}

/// Steps holding the driver now (the pool's own reference aside).
fn in_use(e: &Entry) -> usize {
    Arc::strong_count(&e.bmc) - 1
}

/// The least recently used driver no step holds.
fn lru_idle(map: &HashMap<Key, Entry>) -> Option<Key> {
    map.iter()
        .filter(|(_, e)| in_use(e) == 0)
        .min_by_key(|(_, e)| e.used)
        .map(|(k, _)| *k)
}
