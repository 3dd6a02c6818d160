//! The worker: applies events, runs the effects they return (BMC calls, deadlines) and
//! re-arms everything from the store on start, so a restart in the middle of a
//! reinstall resumes it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::task::AbortHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::apply::{self, Applied, ApplyError, Hooks};
use super::pacing::{self, Booting, Decision, Group, Pacer, Waves};
use super::transition::{BmcStep, Effect, Event, NetbootMethod, Outcome, Policy, State};
use crate::bmc::{self, Bmc, BmcEndpoint, BmcError, NextBoot, Secret, TlsPolicy};
use crate::metrics::CounterFamily;
use crate::store::Store;
use crate::store::intents::Claim;
use crate::store::nodes::parse_time;

/// Why a BMC step could not even start.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(
        "no BMC is configured for this node (add one, or power-cycle it by hand and mark it failed/retry)"
    )]
    NoBmc,
    #[error(transparent)]
    Bmc(#[from] BmcError),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

impl ConnectError {
    /// Short machine-friendly kind, as [`BmcError::kind`] (whose kinds it passes on).
    pub fn kind(&self) -> &'static str {
        match self {
            ConnectError::NoBmc => "no_bmc",
            ConnectError::Bmc(e) => e.kind(),
            ConnectError::Store(_) => "store",
        }
    }
}

/// Why one BMC step of a reclaim failed. Its text, which names the driver, the step,
/// the kind and the BMC's own message (never a secret), is the `bmc_step_failed`
/// reason in the audit log; its labels count it in `pxed_bmc_failures_total`.
#[derive(Debug, thiserror::Error)]
pub enum BmcCallError {
    /// No driver could be had for the node (no BMC, unreadable store).
    #[error("{step} [{}]: {error}", error.kind())]
    Connect {
        /// The step that could not start.
        step: BmcStep,
        /// Why.
        error: ConnectError,
    },
    /// A driver ran the step, or was built for it, and failed.
    #[error("{} {step} [{}]: {error}", error.driver(), error.kind())]
    Bmc {
        /// The step.
        step: BmcStep,
        /// What the driver found.
        error: BmcError,
    },
}

impl BmcCallError {
    fn new(step: BmcStep, error: ConnectError) -> Self {
        match error {
            // Building a driver fails typed (a bad address): keep its driver and kind.
            ConnectError::Bmc(error) => BmcCallError::Bmc { step, error },
            error => BmcCallError::Connect { step, error },
        }
    }

    /// The step that failed.
    pub fn step(&self) -> BmcStep {
        match self {
            BmcCallError::Connect { step, .. } | BmcCallError::Bmc { step, .. } => *step,
        }
    }

    /// The driver, where one was known.
    pub fn driver(&self) -> Option<bmc::Driver> {
        match self {
            BmcCallError::Connect { .. } => None,
            BmcCallError::Bmc { error, .. } => Some(error.driver()),
        }
    }

    /// Short machine-friendly kind ([`BmcError::kind`], [`ConnectError::kind`]).
    pub fn kind(&self) -> &'static str {
        match self {
            BmcCallError::Connect { error, .. } => error.kind(),
            BmcCallError::Bmc { error, .. } => error.kind(),
        }
    }

    /// Label values for `pxed_bmc_failures_total`: driver (`none` before one was
    /// known), step, kind.
    pub fn labels(&self) -> [&'static str; 3] {
        [
            self.driver().map_or("none", bmc::Driver::as_str),
            self.step().as_str(),
            self.kind(),
        ]
    }
}

/// One BMC step of one reclaim attempt, as an effect asked for it.
#[derive(Debug, Clone, Copy)]
struct BmcJob {
    step: BmcStep,
    generation: i64,
    attempt: u32,
    method: NetbootMethod,
}

/// Finds the BMC of a node. The daemon uses [`StoreBmcs`]; tests pass a recording double.
pub trait BmcConnector: Send + Sync {
    /// A driver for node `id`'s BMC.
    fn connect<'a>(
        &'a self,
        store: &'a Store,
        id: i64,
    ) -> BoxFuture<'a, Result<Arc<dyn Bmc>, ConnectError>>;
    /// Ends what the connector keeps open (shutdown).
    fn close_all(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
    /// A step failed with `bmc`: the next one should not reuse it.
    fn discard(&self, _bmc: &Arc<dyn Bmc>) {}
}

/// Reads BMC endpoints and secrets from the store and connects the real drivers.
#[derive(Debug, Default)]
pub struct StoreBmcs {
    pub policy: bmc::CallPolicy,
    /// Redfish drivers kept across a reinstall's steps (see [`bmc::pool`]).
    pub pool: bmc::pool::Pool,
}

impl StoreBmcs {
    /// Connects with `policy`, Redfish drivers pooled.
    pub fn new(policy: bmc::CallPolicy) -> Self {
        StoreBmcs {
            policy,
            pool: bmc::pool::Pool::default(),
        }
    }

    /// The endpoint of node `id` (with its secret: never log it as text).
    pub async fn endpoint(&self, store: &Store, id: i64) -> Result<BmcEndpoint, ConnectError> {
        let (row, password, boot_mac) =
            store.bmc_connection(id).await?.ok_or(ConnectError::NoBmc)?;
        let password = password.unwrap_or_default();
        let boot_mac = boot_mac.map(|m| m.to_string());
        Ok(BmcEndpoint {
            driver: row.driver,
            address: row.address,
            username: row.username,
            password: Secret::new(password),
            match_mac: if row.system_id.is_none() {
                boot_mac
            } else {
                None
            },
            system_id: row.system_id,
            match_uuid: None,
            tls: if row.tls_insecure {
                TlsPolicy::Insecure
            } else {
                TlsPolicy::Pinned(row.tls_pin)
            },
            policy: self.policy.clone(),
        })
    }
}

impl BmcConnector for StoreBmcs {
    fn connect<'a>(
        &'a self,
        store: &'a Store,
        id: i64,
    ) -> BoxFuture<'a, Result<Arc<dyn Bmc>, ConnectError>> {
        Box::pin(async move {
            let ep = self.endpoint(store, id).await?;
            Ok(self.pool.connect(&ep)?)
        })
    }
    fn close_all(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.pool.close_all())
    }
    fn discard(&self, bmc: &Arc<dyn Bmc>) {
        self.pool.discard(bmc);
    }
}

/// How long a power cycle sent before a restart has to show as On before the restarted
/// daemon powers the machine on itself.
const CONFIRM_WINDOW: Duration = Duration::from_secs(30);

/// The `step` label of failed override clears in `pxed_bmc_failures_total`.
const CLEAR_OVERRIDE: &str = "clear_override";

/// How long an event the store could not take is retried (see `apply_logged`).
pub const STORE_RETRY_FOR: Duration = Duration::from_secs(300);

/// Lifecycle changes buffered for each subscriber (the stage recorder, the status
/// page's live stream); a change is about a hundred bytes.
const CHANGES_BUFFERED: usize = 4096;

/// The lifecycle service: one per daemon.
pub struct Lifecycle {
    pub store: Store,
    /// Deadlines, retries and backoff; replaced on SIGHUP (see [`Lifecycle::set_policy`]).
    policy: std::sync::RwLock<Policy>,
    bmcs: Arc<dyn BmcConnector>,
    deadlines: Mutex<HashMap<i64, AbortHandle>>,
    tasks: TaskTracker,
    cancel: CancellationToken,
    changes: tokio::sync::broadcast::Sender<NodeChange>,
    /// Failed BMC steps by driver, step and kind (`/metrics`).
    pub bmc_failures: CounterFamily<3>,
    /// Observe windows that passed without a DHCP from a boot MAC, by the method that
    /// was in use (`/metrics`).
    pub netboot_not_observed: CounterFamily<1>,
    /// Netboots observed, by the method that made the machine netboot (`/metrics`).
    pub netboot_observed: CounterFamily<1>,
    /// Nodes stopped in a boot loop (`/metrics`).
    pub boot_loops: crate::metrics::Counter,
    /// Power-on waves: every power cycle of a reclaim asks it first. In memory only: a
    /// restart loses the waves, and each interrupted power cycle simply asks again
    /// (waves restart from then, which paces the resumed burst as well).
    pacer: Mutex<Pacer>,
    /// Nodes powered on and not yet at their installer: at most `pacing.max_booting`
    /// (see [`pacing::Booting`]). In memory only, like the waves.
    booting: Mutex<Booting>,
    /// Waiting, granted and delayed power cycles (`/metrics`, registered in
    /// `AppState::renders`).
    pub pacing: Arc<pacing::Stats>,
    /// This run of this instance, as node claims name it (several pxed on one
    /// PostgreSQL database; see `store::cluster`).
    owner: String,
    /// How long a claim lasts without renewal.
    owner_ttl: std::sync::RwLock<Duration>,
    /// Nodes taken over from an instance that died (`/metrics`).
    pub taken_over: crate::metrics::Counter,
    /// Queue each change of state for webhooks (see [`Lifecycle::set_queue_webhooks`]).
    queue_webhooks: std::sync::atomic::AtomicBool,
}

/// A power-on slot the pacer gave a power cycle.
#[derive(Debug, Clone)]
struct Paced {
    group: Group,
    wave: u64,
    /// How long the power cycle waited for its wave and for a booting place, in all
    /// (zero: it went at once).
    waited: Duration,
    /// The part of `waited` spent waiting for a booting node to reach its installer.
    boot_waited: Duration,
    /// This power cycle took a booting place (the node held none before): given back
    /// if the cycle is not sent.
    took_place: bool,
}

/// A committed change, published to the status page's live stream.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeChange {
    pub node_id: i64,
    pub event: String,
    pub state: State,
    pub at: String,
    /// Made by another instance on the database (shown on the board; its stages are
    /// that instance's to record).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub remote: bool,
}

impl std::fmt::Debug for Lifecycle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lifecycle")
            .field("policy", &self.policy())
            .finish_non_exhaustive()
    }
}

impl Lifecycle {
    /// A new service; call [`Lifecycle::resume`] once the servers are up.
    pub fn new(
        store: Store,
        policy: Policy,
        bmcs: Arc<dyn BmcConnector>,
        cancel: CancellationToken,
    ) -> Arc<Self> {
        Arc::new(Lifecycle {
            store,
            policy: std::sync::RwLock::new(policy),
            bmcs,
            deadlines: Mutex::new(HashMap::new()),
            tasks: TaskTracker::new(),
            cancel,
            // Room for several seconds of a boot storm's changes (about 500 a second
            // at 5,000 nodes) while a subscriber awaits a store write: the stage
            // recorder lagged behind 256 and lost sightings.
            changes: tokio::sync::broadcast::channel(CHANGES_BUFFERED).0,
            bmc_failures: CounterFamily::new(
                "pxed_bmc_failures_total",
                "Failed BMC steps (every attempt) by driver, step and error kind",
                ["driver", "step", "kind"],
            ),
            netboot_not_observed: CounterFamily::new(
                "pxed_netboot_not_observed_total",
                "Power actions not followed by a DHCP packet from a boot MAC within the observe window, by netboot method",
                ["method"],
            ),
            netboot_observed: CounterFamily::new(
                "pxed_netboot_observed_total",
                "Netboots observed after a power action, by the netboot method that did it",
                ["method"],
            ),
            boot_loops: Default::default(),
            pacer: Mutex::new(Pacer::new(Waves::default())),
            booting: Mutex::new(Booting::new(crate::config::Pacing::default().max_booting)),
            pacing: Arc::default(),
            owner: format!(
                "{}:{}:{:08x}",
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|h| h.trim().to_string())
                    .unwrap_or_default(),
                std::process::id(),
                rand::random::<u32>()
            ),
            owner_ttl: std::sync::RwLock::new(Duration::from_secs(10)),
            taken_over: Default::default(),
            queue_webhooks: std::sync::atomic::AtomicBool::new(true),
        })
    }

    /// Sets how long this instance's claims on nodes last without renewal.
    pub fn set_owner_ttl(&self, ttl: Duration) {
        *self.owner_ttl.write().expect("lock") = ttl;
    }

    /// A service with the default configuration's policy and the store's BMCs.
    #[cfg(test)]
    pub(crate) fn for_tests(store: &Store) -> Arc<Self> {
        let cfg = crate::config::load(None, Vec::<(String, String)>::new(), &Default::default())
            .expect("default configuration");
        Lifecycle::new(
            store.clone(),
            Policy::from_config(&cfg.lifecycle),
            Arc::new(StoreBmcs::default()),
            CancellationToken::new(),
        )
    }

    /// Whether changes of state are queued in the webhook outbox (on by default). Off
    /// when no URL is configured: the outbox would only be emptied again, and a URL
    /// added later (a restart) starts with the changes after it anyway.
    pub fn set_queue_webhooks(&self, on: bool) {
        self.queue_webhooks
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    fn owner_ttl(&self) -> Duration {
        *self.owner_ttl.read().expect("lock")
    }

    /// With other instances on the database: keeps this instance's claims on the nodes
    /// it is running alive, drops the deadlines of nodes another instance took, and
    /// takes over (resumes) nodes whose holder died. Every third of the claims'
    /// lifetime, until `cancel` (on SQLite it only waits for it: the daemon treats a
    /// task that ends early as a server that stopped).
    pub async fn keep_claims(self: &Arc<Self>, cancel: CancellationToken) {
        if !self.store.is_shared() {
            cancel.cancelled().await;
            return;
        }
        loop {
            let every = self.owner_ttl() / 3;
            tokio::select! {
                // CANCEL-SAFETY: only waits.
                _ = cancel.cancelled() => return,
                // CANCEL-SAFETY: a sleep.
                _ = tokio::time::sleep(every) => {}
            }
            match self.store.renew_nodes(&self.owner, self.owner_ttl()).await {
                Ok(Some(held)) => {
                    let mut deadlines = self.deadlines.lock().expect("lock");
                    deadlines.retain(|id, h| {
                        let keep = held.contains(id);
                        if !keep {
                            tracing::info!(
                                node = id,
                                "node taken by another instance: its deadline here is dropped"
                            );
                            h.abort();
                        }
                        keep
                    });
                }
                Ok(None) => {}
                Err(e) => {
                    // Cannot renew: the database is away. Claims lapse on its clock;
                    // nothing runs there until it is back.
                    tracing::warn!(error = %e, "renewing node claims");
                    continue;
                }
            }
            match self.resume().await {
                Ok(0) => {}
                Ok(n) => {
                    self.taken_over.add(n as u64);
                    tracing::warn!(
                        nodes = n,
                        "took over nodes whose instance stopped answering for them"
                    );
                }
                Err(e) => tracing::warn!(error = %e, "looking for nodes without a live instance"),
            }
        }
    }

    /// Makes this instance answer for node `id` after it applied an event there (it
    /// runs the effects), or gives the node up when it came to rest.
    async fn own(&self, id: i64, state: State) {
        if !self.store.is_shared() {
            return;
        }
        let r = if state.in_progress() {
            self.store
                .take_node(id, &self.owner, self.owner_ttl())
                .await
        } else {
            self.store.release_node(id, &self.owner).await
        };
        if let Err(e) = r {
            tracing::warn!(node = id, error = %e, "recording which instance answers for the node");
        }
    }

    /// Replaces the power-on wave settings (at start and when the configuration is
    /// reloaded); power cycles already waiting keep their slot.
    pub fn set_waves(&self, waves: Waves) {
        self.pacer.lock().expect("lock").set_waves(waves);
    }

    /// The power-on wave settings in force.
    pub fn waves(&self) -> Waves {
        self.pacer.lock().expect("lock").waves().clone()
    }

    /// Sets how many nodes may boot at once (`pacing.max_booting`, already capped by
    /// the caller to what the HTTP connection cap can hold); 0: no limit.
    pub fn set_max_booting(&self, limit: u32) {
        self.with_booting(|b| b.set_limit(limit));
    }

    /// The booting limit in force (0: none).
    pub fn max_booting(&self) -> u32 {
        self.with_booting(|b| b.limit())
    }

    /// Runs `f` on the booting places, then sets `pxed_power_on_booting` to their count
    /// (every change, aging out included, goes through here).
    fn with_booting<R>(&self, f: impl FnOnce(&mut Booting) -> R) -> R {
        let mut b = self.booting.lock().expect("lock");
        let r = f(&mut b);
        self.pacing.booting.set(b.len() as i64);
        r
    }

    /// Node `id` reached its installer (fetched its installer configuration, or its
    /// deploy agent asked for its plan) or left the reinstall: its booting place, if
    /// it held one, goes to the next power-on waiting.
    pub fn booted(&self, id: i64) {
        self.with_booting(|b| b.done(id));
    }

    /// Waits for a booting place for node `id` (none while the limit is reached; see
    /// [`pacing::Booting`]) and takes it. Returns how long it waited and whether it
    /// took a place. A node booting already, or no limit, goes at once; after
    /// [`pacing::BOOT_WAIT_MAX`] it goes without a place.
    async fn take_booting_place(&self, id: i64) -> (Duration, bool) {
        let Some(gate) = self.with_booting(|b| b.gate_for(id, tokio::time::Instant::now())) else {
            return (Duration::ZERO, false);
        };
        let asked = tokio::time::Instant::now();
        let (place, waited) = match gate.clone().try_acquire_owned() {
            Ok(p) => (Some(p), Duration::ZERO),
            Err(_) => {
                self.pacing.boot_delayed.inc();
                let _waiting = pacing::Waiting::new(self.pacing.clone());
                tracing::info!(
                    node = id,
                    max_booting = self.max_booting(),
                    "power-on paced: waiting for a booting node to reach its installer"
                );
                let place =
                    match tokio::time::timeout(pacing::BOOT_WAIT_MAX, gate.acquire_owned()).await {
                        Ok(Ok(p)) => Some(p),
                        // Timed out (a semaphore is never closed here): go without one.
                        _ => {
                            self.pacing.boot_wait_expired.inc();
                            tracing::warn!(
                                node = id,
                                waited_s = pacing::BOOT_WAIT_MAX.as_secs(),
                                "power-on paced: every booting place still taken; powering on"
                            );
                            None
                        }
                    };
                (place, asked.elapsed())
            }
        };
        let took = place.is_some();
        if let Some(place) = place {
            self.with_booting(|b| b.hold(id, place, tokio::time::Instant::now()));
        }
        (waited, took)
    }

    /// Waits until the pacer lets node `id` power on. Holds no transaction and no
    /// lock while it waits; cancelled with the step (shutdown), it leaves nothing
    /// behind but a reserved slot in memory.
    async fn pace_power_on(&self, id: i64) -> Paced {
        let group = match self.waves().by_label {
            None => None,
            Some(key) => match self.store.labels(id).await {
                Ok(mut labels) => labels.remove(&key),
                Err(e) => {
                    // Unreadable labels: pace with the unlabelled nodes rather than not at all.
                    tracing::warn!(node = id, error = %e, "reading labels for power-on waves");
                    None
                }
            },
        };
        let asked = tokio::time::Instant::now();
        let decision = self.pacer.lock().expect("lock").request(&group, asked);
        if let Decision::Wait { wave, until } = decision {
            self.pacing.delayed.inc();
            let _waiting = pacing::Waiting::new(self.pacing.clone());
            tracing::info!(node = id, wave, group = ?group, wait_ms = (until - asked).as_millis() as u64, "power-on paced: waiting for its wave");
            tokio::time::sleep_until(until).await;
        }
        let wave_waited = match decision {
            Decision::Go { .. } => Duration::ZERO,
            Decision::Wait { .. } => asked.elapsed(),
        };
        let (boot_waited, took_place) = self.take_booting_place(id).await;
        self.pacing.granted.inc();
        self.pacing
            .wait
            .observe((wave_waited + boot_waited).as_secs_f64());
        Paced {
            group,
            wave: decision.wave(),
            waited: wave_waited + boot_waited,
            boot_waited,
            took_place,
        }
    }

    /// Writes the wait of a paced power cycle into the node's timeline.
    async fn note_paced(&self, id: i64, generation: i64, paced: &Paced) {
        if paced.waited.is_zero() {
            return;
        }
        let group = match &paced.group {
            Some(v) => format!(" ({v})"),
            None => String::new(),
        };
        let mut detail = format!(
            "power-on paced: wave {}{group}, waited {:.1} s",
            paced.wave,
            paced.waited.as_secs_f64()
        );
        if !paced.boot_waited.is_zero() {
            detail.push_str(&format!(
                ", {:.1} s of it for a booting node to reach its installer (max_booting {})",
                paced.boot_waited.as_secs_f64(),
                self.max_booting()
            ));
        }
        match self.store.node(id).await {
            Ok(Some(n)) if n.generation == generation => {
                if let Err(e) = self
                    .store
                    .note(id, generation, n.state, "power_on_paced", "pacer", &detail)
                    .await
                {
                    tracing::warn!(node = id, error = %e, "recording the power-on wait");
                }
            }
            _ => {}
        }
    }

    /// Applies `event` and starts its effects.
    pub async fn apply(
        self: &Arc<Self>,
        id: i64,
        event: &Event,
        actor: &str,
    ) -> Result<Applied, ApplyError> {
        self.apply_with(id, event, actor, Hooks::default()).await
    }

    /// [`Lifecycle::apply`] with hooks (hostname assignment, idempotency).
    pub async fn apply_with(
        self: &Arc<Self>,
        id: i64,
        event: &Event,
        actor: &str,
        hooks: Hooks<'_>,
    ) -> Result<Applied, ApplyError> {
        let webhook = self
            .queue_webhooks
            .load(std::sync::atomic::Ordering::Relaxed);
        let (applied, effects) = apply::apply(
            &self.store,
            &self.policy(),
            id,
            event,
            actor,
            hooks,
            webhook,
        )
        .await?;
        if let Outcome::Changed(t) = &applied.outcome {
            self.own(id, applied.node.state).await;
            self.notify(id, event.name(), applied.node.state);
            match event {
                Event::NetbootNotObserved { method, .. } => {
                    self.netboot_not_observed.inc([method.as_str()]);
                }
                Event::NetbootObserved { .. } => {
                    self.netboot_observed.inc([t.node.netboot.method.as_str()]);
                }
                Event::InstallerServed { .. } if t.node.state == State::Failed => {
                    self.boot_loops.inc();
                }
                _ => {}
            }
        }
        if !effects.is_empty() {
            tracing::debug!(node = id, event = event.name(), to = %applied.node.state, ?effects, "applied");
        }
        for e in effects {
            self.run_effect(id, e, Duration::ZERO);
        }
        Ok(applied)
    }

    /// Publishes a change (also used for registrations and deletions). A node out of
    /// the reinstall's states no longer counts as booting.
    pub fn notify(&self, id: i64, event: &str, state: State) {
        if !matches!(
            state,
            State::Reclaiming | State::Netbooting | State::Installing
        ) {
            self.booted(id);
        }
        // No subscribers is fine: nobody is watching the status page.
        let _ = self.changes.send(NodeChange {
            node_id: id,
            event: event.to_string(),
            state,
            at: crate::store::nodes::now(),
            remote: false,
        });
    }

    /// Publishes what other instances on the database commit (their audit rows) to
    /// this instance's status pages, until `cancel` (on SQLite it only waits for it: a
    /// task that ends is a stopped server).
    pub async fn follow_others(self: &Arc<Self>, cancel: CancellationToken) {
        use store_pg::coord::Change;
        let mut changes = loop {
            match self.store.changes(store_pg::coord::Channel::Events).await {
                Ok(Some(c)) => break c,
                Ok(None) => {
                    cancel.cancelled().await;
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "listening for other instances' changes; again in 1 s")
                }
            }
            tokio::select! {
                // CANCEL-SAFETY: only waits.
                _ = cancel.cancelled() => return,
                // CANCEL-SAFETY: a sleep.
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        };
        loop {
            let c = tokio::select! {
                // CANCEL-SAFETY: only waits.
                _ = cancel.cancelled() => return,
                // CANCEL-SAFETY: a notification is consumed only when next() completes.
                c = changes.next() => c,
            };
            match c {
                Ok(Change::Event { id, .. }) => match self.store.event(id).await {
                    Ok(Some(e)) => {
                        let _ = self.changes.send(NodeChange {
                            node_id: e.node_id,
                            event: e.event,
                            state: e.to_state,
                            at: e.at,
                            remote: true,
                        });
                    }
                    Ok(None) => {}
                    Err(e) => tracing::warn!(error = %e, "reading another instance's audit row"),
                },
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "listening for other instances' changes; again in 1 s");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    /// A live stream of changes.
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<NodeChange> {
        self.changes.subscribe()
    }

    /// The policy in force.
    pub fn policy(&self) -> Policy {
        self.policy.read().expect("lock").clone()
    }

    /// Replaces the policy (configuration reloaded): later transitions use it;
    /// deadlines already armed keep their time.
    pub fn set_policy(&self, policy: Policy) {
        *self.policy.write().expect("lock") = policy;
    }

    /// How many nodes have a deadline armed.
    pub fn armed_deadlines(&self) -> usize {
        self.deadlines.lock().expect("lock").len()
    }

    /// Waits for running effects (shutdown).
    pub async fn drain(&self) {
        self.tasks.close();
        self.tasks.wait().await;
        // Sessions held for the next step end now; a BMC that does not answer keeps its
        // own until it expires it, rather than hold up the shutdown.
        if tokio::time::timeout(Duration::from_secs(5), self.bmcs.close_all())
            .await
            .is_err()
        {
            tracing::info!("BMC sessions not all logged out within 5 s; the BMCs expire them");
        }
        // Its deadlines die with it: another instance takes its nodes over now.
        match self.store.release_nodes(&self.owner).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(nodes = n, "nodes given up to the other instances"),
            Err(e) => {
                tracing::warn!(error = %e, "giving nodes up (they pass to another instance when the claims lapse)")
            }
        }
    }

    fn run_effect(self: &Arc<Self>, id: i64, effect: Effect, elapsed: Duration) {
        match effect {
            Effect::ClearDeadline => {
                if let Some(h) = self.deadlines.lock().expect("lock").remove(&id) {
                    h.abort();
                }
            }
            Effect::ArmDeadline {
                state,
                generation,
                attempt,
                after,
            } => {
                let ev = Event::DeadlineExpired {
                    state,
                    generation,
                    attempt,
                };
                self.arm_timer(id, after.saturating_sub(elapsed), ev);
            }
            Effect::ArmObserveWindow {
                generation,
                attempt,
                method,
                after,
            } => {
                let ev = Event::NetbootNotObserved {
                    generation,
                    attempt,
                    method,
                };
                self.arm_timer(id, after.saturating_sub(elapsed), ev);
            }
            Effect::RecordNetbootMethod { generation, method } => {
                let me = self.clone();
                self.tasks.spawn(async move {
                    me.record_method(id, generation, method).await;
                });
            }
            Effect::SetNetboot {
                generation,
                attempt,
                delay,
                method,
            } => self.spawn_bmc(
                id,
                BmcJob {
                    step: BmcStep::SetNetboot,
                    generation,
                    attempt,
                    method,
                },
                delay,
            ),
            Effect::PowerCycle {
                generation,
                attempt,
                delay,
                method,
            } => self.spawn_bmc(
                id,
                BmcJob {
                    step: BmcStep::PowerCycle,
                    generation,
                    attempt,
                    method,
                },
                delay,
            ),
            Effect::ClearBootOverride { generation } => {
                let me = self.clone();
                self.tasks.spawn(async move {
                    tokio::select! {
                        // CANCEL-SAFETY: best effort; a BMC left with the override is read again at the next netboot.
                        _ = me.cancel.cancelled() => {}
                        // CANCEL-SAFETY: see above.
                        _ = me.clear_override(id, generation) => {}
                    }
                });
            }
        }
    }

    /// Replaces node `id`'s timer (deadline or observe window): after `wait`, apply `ev`.
    fn arm_timer(self: &Arc<Self>, id: i64, wait: Duration, ev: Event) {
        let me = self.clone();
        let h = self.tasks.spawn(async move {
            tokio::select! {
                // CANCEL-SAFETY: a timer not fired at shutdown is re-armed from the store on start.
                _ = me.cancel.cancelled() => {}
                // CANCEL-SAFETY: sleeping holds no state.
                _ = tokio::time::sleep(wait) => {
                    me.deadlines.lock().expect("lock").remove(&id);
                    // Paused past its claim (or cut off): another instance answers for
                    // the node now and runs its timers. A failed check fires: the
                    // event's own version check still decides.
                    if let Ok(false) = me.store.answers_for(id, &me.owner).await {
                        tracing::info!(node = id, event = ev.name(), "timer not fired: another instance answers for the node");
                        return;
                    }
                    tracing::info!(node = id, event = ev.name(), detail = ?ev.detail(), "timer fired");
                    me.apply_logged(id, ev, "deadline").await;
                }
            }
        });
        if let Some(old) = self
            .deadlines
            .lock()
            .expect("lock")
            .insert(id, h.abort_handle())
        {
            old.abort();
        }
    }

    /// The node netbooted with `method`: remember it for its BMC's model, and say so in
    /// its audit log.
    async fn record_method(&self, id: i64, generation: i64, method: NetbootMethod) {
        let detail = match self.store.record_netboot_method(id, method).await {
            Ok(Some(model)) => format!("{method} made it netboot; preferred next time for {model}"),
            Ok(None) => format!("{method} made it netboot (BMC model unknown: not remembered)"),
            Err(e) => {
                tracing::warn!(node = id, %method, error = %e, "recording the netboot method");
                return;
            }
        };
        tracing::info!(node = id, %method, %detail, "netboot observed");
        if let Ok(Some(n)) = self.store.node(id).await
            && n.generation == generation
            && let Err(e) = self
                .store
                .note(
                    id,
                    generation,
                    n.state,
                    "netboot_method_recorded",
                    "dhcp",
                    &detail,
                )
                .await
        {
            tracing::warn!(node = id, error = %e, "recording the netboot method in the audit log");
        }
    }

    fn spawn_bmc(self: &Arc<Self>, id: i64, job: BmcJob, delay: Duration) {
        let me = self.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                // CANCEL-SAFETY: an interrupted BMC step is re-run from the store on start.
                _ = me.cancel.cancelled() => {}
                // CANCEL-SAFETY: see above; the step is idempotent (set netboot then cycle again).
                _ = me.bmc_step(id, job, delay) => {}
            }
        });
    }

    async fn bmc_step(self: &Arc<Self>, id: i64, job: BmcJob, delay: Duration) {
        let BmcJob {
            step,
            generation,
            attempt,
            method,
        } = job;
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        // Power-ons go in waves (retries too); setting netboot is not paced. The wait
        // comes before the claim: a restart during it finds the cycle not sent, and the
        // resumed step asks the pacer again.
        let paced = match step {
            BmcStep::PowerCycle => Some(self.pace_power_on(id).await),
            BmcStep::SetNetboot => None,
        };
        // A backoff may have outlived the plan (quarantined, retried, new generation).
        // Still current, the step is recorded as sent before it is sent: a restart
        // then checks the machine instead of cycling it a second time.
        let claim = match self
            .store
            .claim_bmc_step(
                id,
                generation,
                attempt,
                step,
                Some(store_pg::steps::Holder {
                    owner: &self.owner,
                    // The claim is renewed every third of its lifetime.
                    margin: self.owner_ttl() / 2,
                }),
            )
            .await
        {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(node = id, %step, error = %e, "recording BMC step; not sent (the reclaiming deadline retries)");
                self.give_back(id, paced.as_ref());
                return;
            }
        };
        let sent = match claim {
            Claim::Send => {
                if let Some(p) = &paced {
                    self.note_paced(id, generation, p).await;
                }
                self.bmc_call(id, step, method).await
            }
            Claim::AlreadySent { at } => {
                // Sent before a restart: only checked now, so no power-on uses the slot.
                self.release(paced.as_ref());
                self.confirm_cycle(id, &at).await
            }
            Claim::NotCurrent => {
                tracing::debug!(node = id, %step, "BMC step no longer current; skipped");
                self.give_back(id, paced.as_ref());
                return;
            }
            Claim::NotHeld => {
                tracing::warn!(node = id, %step, "another instance answers for the node now: BMC step not sent here");
                self.release(paced.as_ref());
                self.booted(id);
                return;
            }
        };
        let event = match sent {
            Ok(driver) => {
                tracing::info!(node = id, %step, %driver, generation, attempt, "BMC step done");
                if step == BmcStep::SetNetboot && attempt == 0 {
                    self.collect_bmc_inventory(id, generation, driver);
                }
                match step {
                    BmcStep::SetNetboot => Event::NetbootSet {
                        generation,
                        attempt,
                    },
                    BmcStep::PowerCycle => Event::PowerCycled {
                        generation,
                        attempt,
                    },
                }
            }
            Err(e) => {
                self.bmc_failures.inc(e.labels());
                let kind = e.kind();
                tracing::warn!(node = id, %step, kind, generation, attempt, reason = %e, "BMC step failed");
                Event::BmcStepFailed {
                    step,
                    generation,
                    attempt,
                    reason: e.to_string(),
                }
            }
        };
        self.apply_logged(id, event, "bmc").await;
    }

    /// Gives an unused power-on slot back to the pacer.
    fn release(&self, paced: Option<&Paced>) {
        if let Some(p) = paced {
            self.pacer.lock().expect("lock").release(&p.group, p.wave);
        }
    }

    /// A power cycle that will not be sent: gives back its wave slot, and the booting
    /// place it took (the node left the reinstall or moved on while it waited; a place
    /// it held from before stays with the attempt that holds it).
    fn give_back(&self, id: i64, paced: Option<&Paced>) {
        self.release(paced);
        if paced.is_some_and(|p| p.took_place) {
            self.booted(id);
        }
    }

    /// Reads what the BMC knows of the machine (Redfish resources, IPMI FRU) in its own
    /// session, beside the power cycle, and stores it as this generation's out-of-band
    /// inventory. Best effort: a BMC that lists nothing or fails is logged, never fails
    /// the reinstall.
    pub fn collect_bmc_inventory(self: &Arc<Self>, id: i64, generation: i64, driver: bmc::Driver) {
        let me = self.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                // CANCEL-SAFETY: only reads the BMC; the next reinstall collects again.
                _ = me.cancel.cancelled() => {}
                // CANCEL-SAFETY: see above.
                _ = me.collect_inventory(id, generation, driver) => {}
            }
        });
    }

    async fn collect_inventory(&self, id: i64, generation: i64, driver: bmc::Driver) {
        let b = match self.bmcs.connect(&self.store, id).await {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!(node = id, error = %e, "BMC inventory: cannot connect");
                return;
            }
        };
        let started = std::time::Instant::now();
        let r = b.inventory().await;
        b.close().await;
        let took = started.elapsed().as_millis().min(i64::MAX as u128) as i64;
        let source = match driver {
            bmc::Driver::Redfish => crate::model::InventorySource::Redfish,
            bmc::Driver::Ipmi => crate::model::InventorySource::Ipmi,
        };
        match r {
            Ok(Some(inv)) => {
                if let Err(e) = self
                    .store
                    .put_inventory(id, generation, source, Some(took), &inv)
                    .await
                {
                    tracing::warn!(node = id, error = %e, "storing the BMC inventory");
                } else {
                    tracing::info!(node = id, generation, took_ms = took, %source, "BMC inventory stored");
                }
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(node = id, error = %e, "BMC inventory"),
        }
    }

    /// Runs one BMC step the way `method` says; returns the driver that did it.
    async fn bmc_call(
        &self,
        id: i64,
        step: BmcStep,
        method: NetbootMethod,
    ) -> Result<bmc::Driver, BmcCallError> {
        let b = self
            .bmcs
            .connect(&self.store, id)
            .await
            .map_err(|e| BmcCallError::new(step, e))?;
        let r = match (step, method) {
            (BmcStep::SetNetboot, NetbootMethod::Standard) => {
                b.set_next_boot(NextBoot::pxe_once()).await.map(|_| ())
            }
            (BmcStep::SetNetboot, NetbootMethod::UefiOverride | NetbootMethod::OffOn) => b
                .set_next_boot_with_mode(NextBoot::pxe_once())
                .await
                .map(|_| ()),
            (BmcStep::PowerCycle, NetbootMethod::Standard | NetbootMethod::UefiOverride) => {
                b.power_cycle().await
            }
            (BmcStep::PowerCycle, NetbootMethod::OffOn) => match b.power_off().await {
                Ok(()) => b.power_on().await,
                Err(e) => Err(e),
            },
        };
        // The model keys the method that works: learn it once the BMC answers.
        if step == BmcStep::SetNetboot && r.is_ok() {
            match b.model().await {
                Ok(Some(model)) => {
                    if let Err(e) = self.store.set_bmc_model(id, &model).await {
                        tracing::warn!(node = id, error = %e, "recording the BMC model");
                    }
                }
                Ok(None) => {}
                Err(e) => tracing::debug!(node = id, error = %e, "reading the BMC model"),
            }
        }
        if let Some(fp) = b.tls_fingerprint()
            && let Ok(Some(row)) = self.store.bmc(id).await
            && row.tls_pin.is_none()
        {
            tracing::info!(node = id, fingerprint = %fp, "pinned BMC TLS certificate on first use");
            let _ = self.store.pin_bmc_cert(id, &fp).await;
        }
        self.end_step(&b, step, r).await
    }

    /// The end of a reclaim's BMC step: the driver closed, and dropped from the pool
    /// when the step failed (its retry starts from a new one).
    async fn end_step(
        &self,
        b: &Arc<dyn Bmc>,
        step: BmcStep,
        r: Result<(), bmc::BmcError>,
    ) -> Result<bmc::Driver, BmcCallError> {
        b.close().await;
        if r.is_err() {
            self.bmcs.discard(b);
        }
        r.map(|()| b.driver())
            .map_err(|error| BmcCallError::Bmc { step, error })
    }

    /// A power cycle an earlier run recorded as sent (at `at`) and then died before its
    /// answer was applied: the machine may have restarted already, so it is not cycled
    /// again. A machine that reads On (within [`CONFIRM_WINDOW`]) is taken as cycled (if
    /// the reset never reached it, no netboot follows and the `netbooting` deadline
    /// retries); one that stays Off (the cycle was cut between off and on) is powered on.
    async fn confirm_cycle(&self, id: i64, at: &str) -> Result<bmc::Driver, BmcCallError> {
        let step = BmcStep::PowerCycle;
        let b = self
            .bmcs
            .connect(&self.store, id)
            .await
            .map_err(|e| BmcCallError::new(step, e))?;
        let r = async {
            // A power action takes a while to show (seconds on real BMCs): watch for
            // the On the cycle would bring before asking for one.
            let started = tokio::time::Instant::now();
            loop {
                let state = b.power_state().await?;
                if state == bmc::PowerState::On {
                    tracing::info!(
                        node = id,
                        sent_at = at,
                        "power cycle was sent before a restart: not sent again"
                    );
                    return Ok(());
                }
                if started.elapsed() >= CONFIRM_WINDOW {
                    tracing::info!(
                        node = id,
                        sent_at = at,
                        ?state,
                        "power cycle sent before a restart left the node off: powering on"
                    );
                    return b.power_on().await;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
        .await;
        self.end_step(&b, step, r).await
    }

    /// The node netbooted: take away a network boot override its BMC still holds (see
    /// [`Effect::ClearBootOverride`]). Best effort, never an event: the outcome is
    /// logged, noted in the node's audit log when something was cleared or failed, and
    /// counted in `pxed_bmc_failures_total{step="clear_override"}` on failure.
    async fn clear_override(&self, id: i64, generation: i64) {
        let b = match self.bmcs.connect(&self.store, id).await {
            Ok(b) => b,
            Err(ConnectError::NoBmc) => return,
            Err(e) => {
                self.bmc_failures.inc(["none", CLEAR_OVERRIDE, e.kind()]);
                tracing::warn!(node = id, error = %e, "clearing the boot override: no BMC connection");
                return;
            }
        };
        let before = b.boot_override().await;
        let (event, detail) = match before {
            Ok(o) if !o.boots_network() => {
                tracing::debug!(node = id, %o, "boot override already consumed");
                b.close().await;
                return;
            }
            Ok(o) => match b.clear_boot_override().await {
                Ok(after) => {
                    tracing::info!(node = id, before = %o, after = %after, "cleared a network boot override the BMC kept after the netboot");
                    ("boot_override_cleared", format!("{o} -> {after}"))
                }
                Err(e) => {
                    self.bmc_failures
                        .inc([b.driver().as_str(), CLEAR_OVERRIDE, e.kind()]);
                    tracing::warn!(node = id, override_ = %o, error = %e, "could not clear the network boot override");
                    ("boot_override_clear_failed", format!("{o}: {e}"))
                }
            },
            Err(e) => {
                self.bmc_failures
                    .inc([b.driver().as_str(), CLEAR_OVERRIDE, e.kind()]);
                tracing::warn!(node = id, error = %e, "could not read the boot override after the netboot");
                ("boot_override_clear_failed", e.to_string())
            }
        };
        b.close().await;
        match self.store.node(id).await {
            Ok(Some(n)) if n.generation == generation => {
                if let Err(e) = self
                    .store
                    .note(id, generation, n.state, event, "bmc", &detail)
                    .await
                {
                    tracing::warn!(node = id, error = %e, "recording the boot override outcome");
                }
            }
            _ => {}
        }
    }

    /// Node `id`'s power state as its BMC reports it (`None`: the node has no BMC).
    pub async fn power_state(&self, id: i64) -> Result<Option<bmc::PowerState>, ConnectError> {
        let b = match self.bmcs.connect(&self.store, id).await {
            Ok(b) => b,
            Err(ConnectError::NoBmc) => return Ok(None),
            Err(e) => return Err(e),
        };
        let r = b.power_state().await;
        b.close().await;
        Ok(Some(r?))
    }

    /// Powers node `id` on through its BMC (a leftover's resolution).
    pub async fn power_on(&self, id: i64) -> Result<(), ConnectError> {
        let b = self.bmcs.connect(&self.store, id).await?;
        let r = b.power_on().await;
        b.close().await;
        Ok(r?)
    }

    /// `pxed bmc check`: connects to node `id`'s BMC as the worker would (same
    /// connector, same call policy) and reports what it offers. Nothing is pinned or
    /// stored: this only looks.
    pub async fn check_bmc(&self, id: i64) -> Result<bmc::CheckReport, ConnectError> {
        let b = self.bmcs.connect(&self.store, id).await?;
        let r = b.check().await;
        b.close().await;
        Ok(r?)
    }

    /// An operator's power cycle of node `id` (a hung machine), outside any reinstall:
    /// the state does not change, the audit log records who asked and what the BMC
    /// said. A node in the middle of a reclaim is left to the worker's own cycle.
    pub async fn operator_power_cycle(&self, id: i64, actor: &str) -> Result<(), ConnectError> {
        let b = self.bmcs.connect(&self.store, id).await?;
        let r = b.power_cycle().await;
        b.close().await;
        if let Some(n) = self.store.node(id).await? {
            let detail = match &r {
                Ok(()) => "power cycle sent by an operator".to_string(),
                Err(e) => format!("operator power cycle failed: {e}"),
            };
            self.store
                .note(
                    id,
                    n.generation,
                    n.state,
                    "operator_power_cycle",
                    actor,
                    &detail,
                )
                .await?;
        }
        Ok(r?)
    }

    /// Applies an event the worker produced (a BMC answer, a deadline). A concurrent
    /// writer (an agent callback) may win the version check: retried a few times. A
    /// store that cannot write (full disk, I/O error) is retried with backoff until
    /// it can, for up to [`STORE_RETRY_FOR`]: the BMC step really happened, and
    /// dropping its event would leave the node waiting for its deadline.
    async fn apply_logged(self: &Arc<Self>, id: i64, event: Event, actor: &str) {
        let mut conflicts = 0;
        let mut wait = Duration::from_millis(200);
        let started = tokio::time::Instant::now();
        loop {
            match self.apply(id, &event, actor).await {
                Ok(_) => return,
                Err(ApplyError::Conflict(_)) if conflicts < 5 => conflicts += 1,
                Err(ApplyError::Conflict(_)) => {
                    tracing::error!(
                        node = id,
                        event = event.name(),
                        "event lost to repeated conflicts"
                    );
                    return;
                }
                Err(ApplyError::Store(e)) if started.elapsed() < STORE_RETRY_FOR => {
                    tracing::warn!(node = id, event = event.name(), error = %e, retry_in = ?wait, "store did not take the event; retrying");
                    tokio::select! {
                        // CANCEL-SAFETY: nothing held; on restart the node resumes from the store.
                        _ = self.cancel.cancelled() => return,
                        // CANCEL-SAFETY: sleeping holds no state.
                        _ = tokio::time::sleep(wait) => {}
                    }
                    wait = (wait * 2).min(Duration::from_secs(10));
                }
                Err(e) => {
                    tracing::warn!(node = id, event = event.name(), error = %e, "event not applied");
                    return;
                }
            }
        }
    }

    /// Re-arms deadlines and re-runs interrupted BMC steps from the store (after a
    /// restart). A node in `reclaiming` starts its reclaim again from "set netboot"
    /// (the override is consumed by a power cycle, so cycling again without setting it
    /// would boot the disk), unless its power cycle was already sent: then the machine
    /// is checked, not cycled twice.
    pub async fn resume(self: &Arc<Self>) -> Result<usize, crate::store::StoreError> {
        let states: Vec<State> = State::ALL.into_iter().filter(|s| s.in_progress()).collect();
        // With other instances on the database, only the nodes no live instance
        // answers for are this one's to resume (checked every few seconds: mostly
        // none).
        let names: Vec<&str> = states.iter().map(|s| s.as_str()).collect();
        let mine = self
            .store
            .claim_orphans(&self.owner, self.owner_ttl(), &names)
            .await?;
        if mine.as_ref().is_some_and(|m| m.is_empty()) {
            return Ok(0);
        }
        let mut nodes = self.store.nodes_in_states(&states).await?;
        if let Some(mine) = mine {
            nodes.retain(|n| mine.contains(&n.id));
        }
        let now = chrono::Utc::now();
        let mut n = 0;
        for row in nodes {
            let state = row.state;
            let attempt = u32::try_from(row.attempt).unwrap_or(0);
            let elapsed = parse_time(&row.state_since)
                .and_then(|t| (now - t).to_std().ok())
                .unwrap_or_default();
            let mut node = super::apply::to_node(&row, false);
            node.netboot = self.store.netboot(row.id, row.generation).await?;
            let method = node.netboot.method;
            if let Some(timer) = self.policy().timer_for(&node) {
                self.run_effect(row.id, timer, elapsed);
            }
            if state == State::Reclaiming {
                // A power cycle recorded as sent for this very attempt is checked, not
                // repeated (`confirm_cycle`); setting netboot again would also leave a
                // fresh override for the installed system's first reboot.
                let cycle_sent = self
                    .store
                    .bmc_intent(row.id)
                    .await?
                    .is_some_and(|i| i.is_cycle_of(row.generation, row.attempt));
                let (generation, delay) = (row.generation, Duration::ZERO);
                let step = if cycle_sent {
                    Effect::PowerCycle {
                        generation,
                        attempt,
                        delay,
                        method,
                    }
                } else {
                    Effect::SetNetboot {
                        generation,
                        attempt,
                        delay,
                        method,
                    }
                };
                self.run_effect(row.id, step, Duration::ZERO);
            }
            tracing::info!(node = row.id, %state, elapsed_s = elapsed.as_secs(), "resumed");
            n += 1;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bmc::Driver;
    use crate::model::{Mac, NodeArch};
    use crate::store::nodes::NewNode;

    /// A daemon with no webhook URL queues nothing (the outbox would only be emptied
    /// again); with one, every change of state is queued in its transaction.
    #[tokio::test]
    async fn changes_are_queued_for_webhooks_only_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).await.unwrap();
        let lc = Lifecycle::for_tests(&store);
        let id = store
            .create_node(
                &NewNode {
                    name: Some("r1u1".into()),
                    arch: NodeArch::UNKNOWN,
                    state: State::Available,
                    macs: vec![Mac([0x52, 0x54, 0, 0, 0, 1])],
                    boot_mac: None,
                    bmc: None,
                    ssh_authorized_keys: vec![],
                },
                "test",
            )
            .await
            .unwrap();

        lc.set_queue_webhooks(false);
        let a = lc.apply(id, &Event::Allocated, "test").await.unwrap();
        assert_eq!(a.node.state, State::Allocated);
        assert_eq!(store.webhook_next(0).await.unwrap(), None);

        lc.set_queue_webhooks(true);
        let a = lc.apply(id, &Event::Released, "test").await.unwrap();
        assert_eq!(a.node.state, State::Available);
        let row = store.webhook_next(0).await.unwrap().expect("queued");
        assert_eq!((row.node_id, row.to_state), (id, State::Available));
        let body: serde_json::Value = serde_json::from_str(&row.body).unwrap();
        assert_eq!(body["id"], row.id);
        assert_eq!(body["node"]["macs"][0], "52:54:00:00:00:01");
        assert_eq!(store.webhook_next(row.id).await.unwrap(), None);
    }

    #[test]
    fn bmc_call_error_text_and_labels() {
        let e = BmcCallError::new(
            BmcStep::SetNetboot,
            ConnectError::Bmc(BmcError::OverrideNotApplied {
                driver: Driver::Redfish,
                wanted: "Pxe".into(),
                got: "target=Hdd".into(),
                attempts: 3,
            }),
        );
        assert_eq!(
            e.to_string(),
            "redfish set_netboot [override_not_applied]: redfish BMC did not apply the boot \
             override after 3 attempts: wanted Pxe, reads back target=Hdd"
        );
        assert_eq!(
            e.labels(),
            [
                Driver::Redfish.as_str(),
                BmcStep::SetNetboot.as_str(),
                "override_not_applied"
            ]
        );

        let e = BmcCallError::new(BmcStep::PowerCycle, ConnectError::NoBmc);
        assert!(
            e.to_string()
                .starts_with("power_cycle [no_bmc]: no BMC is configured"),
            "{e}"
        );
        assert_eq!(e.labels(), ["none", "power_cycle", "no_bmc"]);
    }
}
