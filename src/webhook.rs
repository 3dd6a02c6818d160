//! Outgoing webhooks: every node state change, signed, delivered per URL in order.
//!
//! The lifecycle queues each change in the `webhook_outbox` table inside the
//! transaction that makes it (see [`crate::lifecycle::apply`]), so nothing is lost to a
//! crash or a restart. One delivery loop per configured URL walks the table from that
//! URL's cursor: it posts the stored body, signed with the URL's secret, and moves the
//! cursor only on a 2xx answer, retrying with doubling backoff (capped) otherwise. A
//! URL that is down holds back only itself. A pruner deletes what every URL is done
//! with and, past `webhooks.queue_cap` rows, the oldest events (counted and logged).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use hmac::{KeyInit, Mac as _};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::{WebhookSettings, WebhookTarget};
use crate::metrics::{CounterFamily, Render};
use crate::model::{Mac, State};
use crate::store::Store;
use crate::store::webhooks::CursorTarget;

/// The header carrying `sha256=<hex HMAC-SHA256 of the exact body>`.
pub const SIGNATURE_HEADER: &str = "X-Pxed-Signature";
/// The header carrying the event id (also in the body).
pub const EVENT_ID_HEADER: &str = "X-Pxed-Event-Id";

/// How often idle loops look at the table even without a wake-up (a wake-up can be
/// missed between a query and the wait; this bounds the delay it costs).
const POLL: Duration = Duration::from_secs(1);

/// How often the pruner runs without a wake-up: it deletes what every URL has had
/// and refreshes the queue-depth gauge. A write transaction, so not every second.
const PRUNE_EVERY: Duration = Duration::from_secs(10);

/// Woken after each commit that queued an event.
static WAKE: Notify = Notify::const_new();

/// Tells the delivery loops that an event was queued (call after the commit).
pub fn wake() {
    WAKE.notify_waiters();
}

/// The JSON body of one event, as receivers get it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WebhookEvent {
    /// Monotonic event id (per pxed database); a receiver may drop ids it has seen.
    pub id: i64,
    /// What happened (`health_passed`, `deadline_expired`, ...): the audit log's name.
    pub event: String,
    pub node: WebhookNode,
    /// The node's generation after the change (a reinstall bumps it).
    pub generation: i64,
    pub from: State,
    pub to: State,
    /// In `failed` and `quarantined`: why; otherwise the event's detail, if any.
    pub reason: Option<String>,
    /// When the change was committed (RFC 3339, UTC).
    pub at: String,
}

/// The node in a [`WebhookEvent`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WebhookNode {
    pub id: i64,
    pub name: Option<String>,
    pub hostname: Option<String>,
    /// Boot NIC first.
    pub macs: Vec<Mac>,
}

impl WebhookEvent {
    /// The exact body text.
    pub fn body(&self) -> String {
        serde_json::to_string(self).expect("plain data serializes")
    }
}

/// `sha256=<hex>`: HMAC-SHA256 of `body` under `secret`.
pub fn sign(secret: &[u8], body: &[u8]) -> String {
    let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret)
        .expect("HMAC accepts keys of any length");
    m.update(body);
    format!("sha256={}", hex::encode(m.finalize().into_bytes()))
}

/// Whether `header` is a valid signature of `body` (constant-time comparison).
pub fn verify(secret: &[u8], body: &[u8], header: &str) -> bool {
    let Some(hex_sig) = header.strip_prefix("sha256=") else {
        return false;
    };
    let Ok(sig) = hex::decode(hex_sig) else {
        return false;
    };
    let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret)
        .expect("HMAC accepts keys of any length");
    m.update(body);
    m.verify_slice(&sig).is_ok()
}

/// The delay before retry `attempt` (0-based): `base * 2^attempt`, at most `max`.
pub fn backoff(base: Duration, max: Duration, attempt: u32) -> Duration {
    base.checked_mul(1u32 << attempt.min(30))
        .unwrap_or(max)
        .min(max)
}

/// A URL fit for logs: no user, password, query or fragment (they may hold tokens).
pub fn display_url(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.set_query(None);
            u.set_fragment(None);
            u.to_string()
        }
        Err(_) => "(unparsable url)".into(),
    }
}

/// Webhook counters for `/metrics`. URLs are labelled by their index in
/// `[[webhooks.targets]]` (a URL may hold a token).
#[derive(Debug)]
pub struct WebhookStats {
    deliveries: CounterFamily<1>,
    /// Per target: (events waiting, events dropped).
    per_target: Mutex<Vec<(u64, u64)>>,
}

impl WebhookStats {
    pub fn new(targets: usize) -> Self {
        WebhookStats {
            deliveries: CounterFamily::new(
                "pxed_webhook_deliveries_total",
                "Webhook delivery attempts by result (delivered, refused: a non-2xx answer, unreachable)",
                ["result"],
            ),
            per_target: Mutex::new(vec![(0, 0); targets]),
        }
    }

    /// Delivery attempts with this result.
    pub fn deliveries(&self, result: &'static str) -> u64 {
        self.deliveries.get([result])
    }

    /// Events dropped for target `i`.
    pub fn dropped(&self, i: usize) -> u64 {
        self.per_target
            .lock()
            .expect("lock")
            .get(i)
            .map_or(0, |t| t.1)
    }
}

impl Render for WebhookStats {
    fn render(&self, out: &mut String) {
        use std::fmt::Write;
        self.deliveries.render(out);
        let t = self.per_target.lock().expect("lock");
        let _ = writeln!(
            out,
            "# HELP pxed_webhook_queue_depth Events waiting for delivery, per target index\n# TYPE pxed_webhook_queue_depth gauge"
        );
        for (i, (depth, _)) in t.iter().enumerate() {
            let _ = writeln!(out, "pxed_webhook_queue_depth{{target=\"{i}\"}} {depth}");
        }
        let _ = writeln!(
            out,
            "# HELP pxed_webhook_dropped_total Events dropped past webhooks.queue_cap, per target index\n# TYPE pxed_webhook_dropped_total counter"
        );
        for (i, (_, dropped)) in t.iter().enumerate() {
            let _ = writeln!(
                out,
                "pxed_webhook_dropped_total{{target=\"{i}\"}} {dropped}"
            );
        }
    }
}

/// Webhook errors (delivery failures are retried, not errors).
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error("HTTP client: {0}")]
    Client(#[from] reqwest::Error),
}

/// Delivers queued events to every configured URL until `cancel` fires.
pub async fn run(
    store: Store,
    settings: WebhookSettings,
    stats: Arc<WebhookStats>,
    cancel: CancellationToken,
) -> Result<(), WebhookError> {
    let urls: Vec<&str> = settings.targets.iter().map(|t| t.url.as_str()).collect();
    store.webhook_sync_cursors(&urls).await?;
    crate::net::install_crypto_provider();
    let client = reqwest::Client::builder()
        .timeout(settings.timeout)
        .user_agent(concat!("pxed/", env!("CARGO_PKG_VERSION")))
        .build()?;
    let mut loops = tokio::task::JoinSet::new();
    for t in &settings.targets {
        let d = Delivery {
            store: store.clone(),
            client: client.clone(),
            target: t.clone(),
            backoff: settings.backoff,
            max_backoff: settings.max_backoff,
            stats: stats.clone(),
        };
        loops.spawn(d.run(cancel.clone()));
    }
    prune_loop(&store, &settings, &stats, &cancel).await;
    while loops.join_next().await.is_some() {}
    Ok(())
}

async fn prune_loop(
    store: &Store,
    settings: &WebhookSettings,
    stats: &WebhookStats,
    cancel: &CancellationToken,
) {
    let targets: Vec<CursorTarget<'_>> = settings
        .targets
        .iter()
        .map(|t| CursorTarget {
            url: &t.url,
            states: &t.states,
        })
        .collect();
    loop {
        let wake = WAKE.notified();
        tokio::pin!(wake);
        wake.as_mut().enable();
        match store.webhook_prune(&targets, settings.queue_cap).await {
            Ok(p) => {
                let mut t = stats.per_target.lock().expect("lock");
                for (i, target) in settings.targets.iter().enumerate() {
                    t[i].0 = p.depth[i];
                    t[i].1 += p.dropped[i];
                    if p.dropped[i] > 0 {
                        tracing::warn!(
                            url = %display_url(&target.url),
                            dropped = p.dropped[i],
                            cap = settings.queue_cap,
                            "webhook queue full: dropped the oldest events this URL had not received"
                        );
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "webhook queue prune failed"),
        }
        tokio::select! {
            // CANCEL-SAFETY: only waits.
            _ = cancel.cancelled() => return,
            // CANCEL-SAFETY: only waits; a missed wake-up is caught by the timer.
            _ = &mut wake => {}
            // CANCEL-SAFETY: only waits.
            _ = tokio::time::sleep(PRUNE_EVERY) => {}
        }
    }
}

struct Delivery {
    store: Store,
    client: reqwest::Client,
    target: WebhookTarget,
    backoff: Duration,
    max_backoff: Duration,
    stats: Arc<WebhookStats>,
}

impl Delivery {
    fn wants(&self, s: State) -> bool {
        self.target.states.is_empty() || self.target.states.contains(&s)
    }

    async fn run(self, cancel: CancellationToken) {
        let url = display_url(&self.target.url);
        loop {
            let wake = WAKE.notified();
            tokio::pin!(wake);
            wake.as_mut().enable();
            let next = match self.store.webhook_cursor(&self.target.url).await {
                Ok(c) => self.store.webhook_next(c).await,
                Err(e) => Err(e),
            };
            match next {
                Ok(Some(row)) if !self.wants(row.to_state) => {
                    if let Err(e) = self.store.webhook_advance(&self.target.url, row.id).await {
                        tracing::warn!(%url, error = %e, "webhook cursor not saved");
                    }
                    continue;
                }
                Ok(Some(row)) => {
                    if !self.deliver(&url, row.id, &row.body, &cancel).await {
                        return;
                    }
                    continue;
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(%url, error = %e, "reading the webhook queue failed"),
            }
            tokio::select! {
                // CANCEL-SAFETY: only waits.
                _ = cancel.cancelled() => return,
                // CANCEL-SAFETY: only waits; a missed wake-up is caught by the poll.
                _ = &mut wake => {}
                // CANCEL-SAFETY: only waits.
                _ = tokio::time::sleep(POLL) => {}
            }
        }
    }

    /// Posts one event until it is accepted or dropped; false when cancelled.
    async fn deliver(&self, url: &str, id: i64, body: &str, cancel: &CancellationToken) -> bool {
        let signature = sign(self.target.secret.as_bytes(), body.as_bytes());
        let mut attempt = 0u32;
        loop {
            let send = self
                .client
                .post(&self.target.url)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .header(EVENT_ID_HEADER, id.to_string())
                .header(SIGNATURE_HEADER, &signature)
                .body(body.to_string())
                .send();
            let result = tokio::select! {
                // CANCEL-SAFETY: the event stays queued; the next start sends it again.
                _ = cancel.cancelled() => return false,
                // CANCEL-SAFETY: dropped only with the cancel branch above.
                r = send => r,
            };
            let why = match result {
                Ok(r) if r.status().is_success() => {
                    self.stats.deliveries.inc(["delivered"]);
                    if let Err(e) = self.store.webhook_advance(&self.target.url, id).await {
                        // Sent again after a restart: receivers drop ids they have seen.
                        tracing::warn!(%url, event = id, error = %e, "webhook cursor not saved");
                    }
                    tracing::debug!(%url, event = id, "webhook delivered");
                    return true;
                }
                Ok(r) => {
                    self.stats.deliveries.inc(["refused"]);
                    format!("answered {}", r.status())
                }
                Err(e) => {
                    self.stats.deliveries.inc(["unreachable"]);
                    // reqwest's error names the URL (it may hold a token): keep the
                    // causes only.
                    crate::error_chain(&e.without_url())
                }
            };
            let delay = backoff(self.backoff, self.max_backoff, attempt);
            attempt = attempt.saturating_add(1);
            tracing::warn!(%url, event = id, attempt, retry_in = ?delay, reason = %why, "webhook not delivered");
            tokio::select! {
                // CANCEL-SAFETY: the event stays queued.
                _ = cancel.cancelled() => return false,
                // CANCEL-SAFETY: only waits.
                _ = tokio::time::sleep(delay) => {}
            }
            // Dropped meanwhile (the queue hit its cap): move on.
            match self.store.webhook_cursor(&self.target.url).await {
                Ok(c) if c >= id => return true,
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The signature is the RFC 4231 HMAC-SHA256 of the exact bytes, and verification
    /// refuses any other body, key or format.
    #[test]
    fn signature_is_hmac_sha256_of_the_exact_body() {
        // RFC 4231 test case 2.
        assert_eq!(
            sign(b"Jefe", b"what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let body = br#"{"id":1,"to":"available"}"#;
        let s = sign(b"k", body);
        assert!(verify(b"k", body, &s));
        assert!(!verify(b"k", br#"{"id":1,"to":"available"} "#, &s));
        assert!(!verify(b"other", body, &s));
        assert!(!verify(b"k", body, s.trim_start_matches("sha256=")));
        assert!(!verify(b"k", body, "sha256=zz"));
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let (b, m) = (Duration::from_millis(100), Duration::from_secs(1));
        let got: Vec<u128> = (0..6).map(|a| backoff(b, m, a).as_millis()).collect();
        assert_eq!(got, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(backoff(b, m, u32::MAX), m);
    }

    #[test]
    fn urls_in_logs_lose_credentials() {
        assert_eq!(
            display_url("https://u:p@hooks.example/x?token=s#f"),
            "https://hooks.example/x"
        );
    }
}
