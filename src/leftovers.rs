//! Leftovers: nodes and leases that need an operator, found by a periodic check.
//!
//! - `powered_off`: a node `available` whose BMC reports power off (it cannot take a
//!   job); resolved by powering it on.
//! - `netbooted_at_rest`: a node that netbooted (DHCP from its boot MAC) while
//!   `available` or `allocated`: something reset it behind pxed's back; resolved by an
//!   acknowledgement (or a reinstall, which moves it on anyway).
//! - `stale_lease`: a bound lease whose MAC is no node's (its node was deleted);
//!   resolved by releasing the lease.
//!
//! The check runs every `lifecycle.leftovers_interval`; `GET /api/v1/leftovers` lists
//! what the last check found, `/metrics` counts it by kind (`pxed_leftovers`).

use std::fmt::Write;
use std::sync::{Arc, Mutex};

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::bmc::PowerState;
use crate::model::State;
use crate::state::AppState;

/// What kind of leftover.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// `available`, but its BMC reports power off.
    PoweredOff,
    /// Netbooted while `available` or `allocated`.
    NetbootedAtRest,
    /// A lease whose MAC is no node's.
    StaleLease,
}

impl Kind {
    /// Every kind, in listing order.
    pub const ALL: [Kind; 3] = [Kind::PoweredOff, Kind::NetbootedAtRest, Kind::StaleLease];

    /// Snake-case name (API path, metrics label).
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::PoweredOff => "powered_off",
            Kind::NetbootedAtRest => "netbooted_at_rest",
            Kind::StaleLease => "stale_lease",
        }
    }

    /// The kind named `s`.
    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// The one operator action that resolves it (`POST .../resolve`).
    pub fn action(self) -> &'static str {
        match self {
            Kind::PoweredOff => "power_on",
            Kind::NetbootedAtRest => "acknowledge",
            Kind::StaleLease => "release_lease",
        }
    }
}

/// One leftover, as `GET /api/v1/leftovers` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Leftover {
    pub kind: Kind,
    /// The node (none for a stale lease).
    pub node: Option<i64>,
    /// What `POST /api/v1/leftovers/{kind}/{subject}/resolve` names: the node id, or
    /// the lease's address.
    pub subject: String,
    /// When it was first seen (RFC 3339).
    pub since: String,
    /// What was seen, in words.
    pub detail: String,
    /// The resolving action.
    pub action: &'static str,
}

/// The last check's findings.
#[derive(Debug, Default)]
pub struct Leftovers {
    found: Mutex<Vec<Leftover>>,
    checked_at: Mutex<Option<String>>,
}

/// Why a leftover could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("no {kind} leftover for {subject}")]
    NotFound { kind: &'static str, subject: String },
    #[error("resolving: {0}")]
    Bmc(#[from] crate::lifecycle::worker::ConnectError),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

impl Leftovers {
    /// What the last check found, and when it ran.
    pub fn list(&self) -> (Vec<Leftover>, Option<String>) {
        (
            self.found.lock().expect("lock").clone(),
            self.checked_at.lock().expect("lock").clone(),
        )
    }

    fn find(&self, kind: Kind, subject: &str) -> Option<Leftover> {
        self.found
            .lock()
            .expect("lock")
            .iter()
            .find(|l| l.kind == kind && l.subject == subject)
            .cloned()
    }

    fn remove(&self, kind: Kind, subject: &str) {
        self.found
            .lock()
            .expect("lock")
            .retain(|l| !(l.kind == kind && l.subject == subject));
    }

    /// Runs the check once and keeps its findings.
    pub async fn check(&self, st: &AppState) {
        let before = self.found.lock().expect("lock").clone();
        let since = |kind: Kind, subject: &str, now: &str| {
            before
                .iter()
                .find(|l| l.kind == kind && l.subject == subject)
                .map_or_else(|| now.to_string(), |l| l.since.clone())
        };
        let now = crate::store::nodes::now();
        let mut found = Vec::new();

        match st.store.nodes_in_states(&[State::Available]).await {
            Ok(nodes) => {
                for n in nodes {
                    match st.lifecycle.power_state(n.id).await {
                        Ok(Some(PowerState::Off)) => {
                            let subject = n.id.to_string();
                            found.push(Leftover {
                                kind: Kind::PoweredOff,
                                node: Some(n.id),
                                since: since(Kind::PoweredOff, &subject, &now),
                                subject,
                                detail: "available, but its BMC reports power off".into(),
                                action: Kind::PoweredOff.action(),
                            });
                        }
                        Ok(_) => {}
                        Err(e) => {
                            tracing::debug!(node = n.id, error = %e, "leftovers: power state unknown")
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "leftovers: listing available nodes"),
        }

        for (id, state, mac, at) in st.discovery.netboots_at_rest() {
            match st.store.node(id).await {
                Ok(Some(n)) if n.state == state => found.push(Leftover {
                    kind: Kind::NetbootedAtRest,
                    node: Some(id),
                    subject: id.to_string(),
                    since: at,
                    detail: format!(
                        "netbooted (DHCP from boot MAC {mac}) while {state}: something reset it"
                    ),
                    action: Kind::NetbootedAtRest.action(),
                }),
                // It moved on (reinstalled, failed, deleted): nothing left over.
                Ok(_) => {
                    st.discovery.forget_netboot_at_rest(id);
                }
                Err(e) => tracing::warn!(node = id, error = %e, "leftovers: loading node"),
            }
        }

        let unix = i64::try_from(crate::dhcp::unix_now()).unwrap_or(i64::MAX);
        match st.store.stale_leases(unix).await {
            Ok(leases) => {
                for (ip, mac) in leases {
                    found.push(Leftover {
                        kind: Kind::StaleLease,
                        node: None,
                        since: since(Kind::StaleLease, &ip, &now),
                        detail: format!("{ip} is leased to {mac}, which is no node's"),
                        subject: ip,
                        action: Kind::StaleLease.action(),
                    });
                }
            }
            Err(e) => tracing::warn!(error = %e, "leftovers: listing leases"),
        }

        *self.found.lock().expect("lock") = found;
        *self.checked_at.lock().expect("lock") = Some(now);
    }

    /// The operator action for one leftover. Returns what was done, in words; the
    /// node's audit log records it too.
    pub async fn resolve(
        &self,
        st: &AppState,
        kind: Kind,
        subject: &str,
        actor: &str,
    ) -> Result<String, ResolveError> {
        let not_found = || ResolveError::NotFound {
            kind: kind.as_str(),
            subject: subject.to_string(),
        };
        let l = self.find(kind, subject).ok_or_else(not_found)?;
        let done = match kind {
            Kind::PoweredOff => {
                let id = l.node.ok_or_else(not_found)?;
                st.lifecycle.power_on(id).await?;
                "powered on".to_string()
            }
            Kind::NetbootedAtRest => {
                let id = l.node.ok_or_else(not_found)?;
                st.discovery.forget_netboot_at_rest(id);
                "acknowledged".to_string()
            }
            Kind::StaleLease => {
                if !st.store.release_stale_lease(subject).await? {
                    return Err(not_found());
                }
                format!("lease {subject} released")
            }
        };
        if let Some(id) = l.node
            && let Ok(Some(n)) = st.store.node(id).await
        {
            let detail = format!("{}: {} ({})", kind.as_str(), done, l.detail);
            if let Err(e) = st
                .store
                .note(
                    id,
                    n.generation,
                    n.state,
                    "leftover_resolved",
                    actor,
                    &detail,
                )
                .await
            {
                tracing::warn!(node = id, error = %e, "recording a resolved leftover");
            }
        }
        tracing::info!(kind = kind.as_str(), subject, done = %done, "leftover resolved");
        self.remove(kind, subject);
        Ok(done)
    }

    /// Checks every `interval` until `cancel`.
    pub async fn run(st: Arc<AppState>, interval: std::time::Duration, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                // CANCEL-SAFETY: only waits.
                _ = cancel.cancelled() => return,
                // CANCEL-SAFETY: a missed tick is taken at the next one.
                _ = tick.tick() => {}
            }
            tokio::select! {
                // CANCEL-SAFETY: the check only reads (BMC power states, the store).
                _ = cancel.cancelled() => return,
                // CANCEL-SAFETY: see above.
                _ = st.leftovers.check(&st) => {}
            }
        }
    }
}

impl crate::metrics::Render for Leftovers {
    fn render(&self, out: &mut String) {
        let found = self.found.lock().expect("lock");
        let _ = writeln!(
            out,
            "# HELP pxed_leftovers Leftovers found by the last check, by kind\n# TYPE pxed_leftovers gauge"
        );
        for k in Kind::ALL {
            let n = found.iter().filter(|l| l.kind == k).count();
            let _ = writeln!(out, "pxed_leftovers{{kind=\"{}\"}} {n}", k.as_str());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_and_render_every_kind() {
        for k in Kind::ALL {
            assert_eq!(Kind::parse(k.as_str()), Some(k));
        }
        assert_eq!(Kind::parse("past_deadline"), None);
        let l = Leftovers::default();
        l.found.lock().unwrap().push(Leftover {
            kind: Kind::StaleLease,
            node: None,
            subject: "10.0.0.9".into(),
            since: "t".into(),
            detail: "d".into(),
            action: Kind::StaleLease.action(),
        });
        let mut out = String::new();
        crate::metrics::Render::render(&l, &mut out);
        assert!(
            out.contains("pxed_leftovers{kind=\"stale_lease\"} 1"),
            "{out}"
        );
        assert!(
            out.contains("pxed_leftovers{kind=\"powered_off\"} 0"),
            "{out}"
        );
    }
}
