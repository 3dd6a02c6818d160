//! The recorder: attributes queued lines to node generations, stores them in batches
//! (bounded per generation), puts recognised milestones on the node's timeline and ends
//! an install at its first fatal error through the lifecycle.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::recognize::{self, DialogWatch, Family, Milestone, Signal};
use super::{MAX_LINE, MAX_REASON, Received, Source, one_line, redact};
use crate::lifecycle::apply::ApplyError;
use crate::lifecycle::transition::Event;
use crate::state::AppState;
use crate::store::install_log::{LogTarget, LogWrite, received_at};

/// How the recorder batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// Lines kept per node generation (older ones are deleted).
    pub lines_per_node: u32,
    /// A batch is written at least this often while lines arrive.
    pub flush_every: Duration,
    /// ... or as soon as it holds this many lines.
    pub max_batch: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            lines_per_node: 500,
            flush_every: Duration::from_millis(500),
            max_batch: 2048,
        }
    }
}

/// The `stage` of the `InstallFailed` events the recorder applies.
pub const STAGE: &str = "installing";

/// Runs until `cancel` fires (writing what it holds) or the queue closes.
pub async fn run(
    st: Arc<AppState>,
    mut rx: mpsc::Receiver<Received>,
    settings: Settings,
    cancel: CancellationToken,
) {
    let mut batch: Vec<Received> = Vec::new();
    let mut watches = Watches::default();
    let mut tick = tokio::time::interval(settings.flush_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            // CANCEL-SAFETY: only waits.
            _ = cancel.cancelled() => break,
            // CANCEL-SAFETY: tick is cancel-safe.
            _ = tick.tick() => {
                if !batch.is_empty() {
                    flush(&st, std::mem::take(&mut batch), settings, &mut watches).await;
                }
            }
            // CANCEL-SAFETY: recv is cancel-safe.
            r = rx.recv() => match r {
                Some(r) => {
                    batch.push(r);
                    if batch.len() >= settings.max_batch {
                        flush(&st, std::mem::take(&mut batch), settings, &mut watches).await;
                    }
                }
                None => break,
            },
        }
    }
    while let Ok(r) = rx.try_recv() {
        batch.push(r);
    }
    flush(&st, batch, settings, &mut watches).await;
}

/// debian-installer dialog watches by node generation, kept across batches.
#[derive(Default)]
struct Watches(HashMap<(i64, i64), DialogWatch>);

/// Most generations watched at once (the map is cleared when full: a watch only
/// spans an `INPUT` and its answer).
const MAX_WATCHES: usize = 4096;

impl Watches {
    fn get(&mut self, key: (i64, i64)) -> &mut DialogWatch {
        if self.0.len() >= MAX_WATCHES && !self.0.contains_key(&key) {
            self.0.clear();
        }
        self.0.entry(key).or_default()
    }
}

/// The text of a failure compared across generations: no `[pid]`s, no prefixes.
fn failure_key(s: &str) -> String {
    let s = s
        .strip_prefix(STAGE)
        .map_or(s, |r| r.trim_start_matches(": "));
    let s = match s.strip_prefix("repeated failure (as in generation ") {
        Some(r) => r.split_once("): ").map_or(r, |(_, t)| t),
        None => s,
    };
    let mut out = String::new();
    let mut skip = false;
    for c in s.chars() {
        match c {
            '[' => skip = true,
            ']' if skip => skip = false,
            _ if !skip => out.push(c),
            _ => {}
        }
    }
    out.trim().to_string()
}

/// The `InstallFailed` reason for installer text `text`, given the previous
/// generation's failure (`node_events.detail` of its `install_failed`): the same error
/// again is said to be a repeat, so nobody reinstalls in a loop into the same wall.
pub fn failure_reason(text: &str, previous: Option<(i64, &str)>) -> String {
    let text = one_line(text, MAX_REASON);
    match previous {
        Some((generation, detail)) if failure_key(detail) == failure_key(&text) => {
            format!("repeated failure (as in generation {generation}): {text}")
        }
        _ => text,
    }
}

/// What one batch found for one node generation.
#[derive(Default)]
struct Found {
    target: Option<LogTarget>,
    milestones: BTreeSet<Milestone>,
    fatal: Option<String>,
    lines: Vec<LogWrite>,
}

async fn flush(st: &AppState, batch: Vec<Received>, settings: Settings, watches: &mut Watches) {
    if batch.is_empty() {
        return;
    }
    let stats = &st.telemetry.stats;
    let now = i64::try_from(crate::dhcp::unix_now()).unwrap_or(i64::MAX);
    let mut by_ip: HashMap<IpAddr, Option<LogTarget>> = HashMap::new();
    let mut by_node: HashMap<i64, Option<LogTarget>> = HashMap::new();
    let mut found: BTreeMap<(i64, i64), Found> = BTreeMap::new();
    for r in batch {
        let target = match (r.node, r.peer) {
            (Some((id, _)), _) => match by_node.entry(id) {
                Entry::Occupied(e) => e.get().clone(),
                Entry::Vacant(e) => {
                    let t = st.store.log_target(id).await.unwrap_or_else(|e| {
                        tracing::warn!(node = id, error = %e, "looking up a node for its installer log");
                        None
                    });
                    e.insert(t).clone()
                }
            },
            (None, Some(ip)) => match by_ip.entry(ip) {
                Entry::Occupied(e) => e.get().clone(),
                Entry::Vacant(e) => {
                    let t = st
                        .store
                        .log_target_by_ip(&ip.to_string(), now)
                        .await
                        .unwrap_or_else(|e| {
                            tracing::warn!(%ip, error = %e, "looking up the sender of a syslog line");
                            None
                        });
                    e.insert(t).clone()
                }
            },
            (None, None) => None,
        };
        // A webhook event for a generation the node has left is as good as anonymous.
        let target = target.filter(|t| r.node.is_none_or(|(_, g)| g == t.generation));
        let Some(target) = target else {
            stats.unattributed.inc();
            tracing::debug!(peer = ?r.peer, line = %r.line, "installer line from no node being installed");
            continue;
        };
        let secrets: Vec<&str> = [
            target.boot_token.as_ref().map(|t| t.as_str()),
            target.agent_token.as_ref().map(|t| t.as_str()),
        ]
        .into_iter()
        .flatten()
        .collect();
        let line = one_line(&redact(&r.line, &secrets), MAX_LINE);
        let f = found
            .entry((target.node_id, target.generation))
            .or_default();
        // Reporting events are curtin's (subiquity reports through curtin's reporter)
        // whatever the image says; syslog lines are the image's installer's.
        let family = match r.source {
            Source::Webhook => Some(Family::Curtin),
            Source::Syslog => target
                .family
                .as_deref()
                .and_then(image_family)
                .and_then(Family::of),
        };
        // Anything at all from the installer: its kernel is up and it reaches pxed.
        f.milestones.insert(Milestone::KernelBooted);
        let noise = family.is_some_and(|fam| recognize::is_noise(fam, &line));
        if let Some(family) = family {
            let key = (target.node_id, target.generation);
            let stall = (family == Family::DebianInstaller)
                .then(|| watches.get(key).feed(&line))
                .flatten();
            match recognize::recognize(family, &line).or(stall) {
                Some(Signal::Milestone(m)) => {
                    f.milestones.insert(m);
                }
                Some(Signal::Fatal(text)) if f.fatal.is_none() => f.fatal = Some(text),
                _ => {}
            }
        }
        f.target = Some(target.clone());
        if noise {
            continue;
        }
        f.lines.push(LogWrite {
            node_id: target.node_id,
            generation: target.generation,
            at: received_at(),
            source: r.source.as_str(),
            line,
        });
        f.target = Some(target);
    }
    // A chatty installer: only what will be kept is written.
    let keep = settings.lines_per_node as usize;
    let mut writes = Vec::new();
    for f in found.values_mut() {
        let skip = f.lines.len().saturating_sub(keep);
        writes.extend(f.lines.drain(skip..));
    }
    match st
        .store
        .append_install_log(&writes, settings.lines_per_node)
        .await
    {
        Ok(()) => stats.stored.add(writes.len() as u64),
        Err(e) => {
            stats.store_errors.inc();
            tracing::warn!(lines = writes.len(), error = %e, "storing installer lines");
        }
    }
    for ((node, generation), f) in found {
        let Some(t) = f.target else { continue };
        for m in &f.milestones {
            match st
                .store
                .note_once(
                    node,
                    generation,
                    t.state,
                    m.event(),
                    "installer",
                    &m.to_string(),
                )
                .await
            {
                Ok(true) => {
                    stats.milestones.inc();
                    st.lifecycle.notify(node, m.event(), t.state);
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(node, error = %e, "recording an installer milestone"),
            }
        }
        if let Some(text) = f.fatal
            && t.state.serves_installer()
        {
            fail(st, &t, &text).await;
        }
    }
}

fn image_family(s: &str) -> Option<crate::images::Family> {
    use crate::images::Family as F;
    [F::Kickstart, F::Autoinstall, F::Preseed, F::Disk]
        .into_iter()
        .find(|f| f.as_str() == s)
}

/// Ends the install with the installer's own words.
async fn fail(st: &AppState, t: &LogTarget, text: &str) {
    let previous = match st
        .store
        .previous_install_failure(t.node_id, t.generation)
        .await
    {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(node = t.node_id, error = %e, "reading the previous failure");
            None
        }
    };
    let reason = failure_reason(text, previous.as_ref().map(|(g, d)| (*g, d.as_str())));
    let event = Event::InstallFailed {
        generation: t.generation,
        stage: STAGE.into(),
        reason: reason.clone(),
    };
    // Another writer may change the node between the read and the write (a script
    // fetch, a deadline): the transition re-reads it, so try again a few times.
    let mut result = st.lifecycle.apply(t.node_id, &event, "installer").await;
    for _ in 0..3 {
        if !matches!(result, Err(ApplyError::Conflict(_))) {
            break;
        }
        result = st.lifecycle.apply(t.node_id, &event, "installer").await;
    }
    match result {
        Ok(applied) => {
            st.telemetry.stats.fatal.inc();
            tracing::warn!(
                node = t.node_id,
                generation = t.generation,
                state = %applied.node.state,
                %reason,
                "install failed (installer log)"
            );
        }
        Err(e) => {
            tracing::info!(node = t.node_id, error = %e, %reason, "installer error not applied")
        }
    }
}

/// Lines received by the webhook, ready to queue.
pub fn webhook_line(node: i64, generation: i64, ev: &super::CurtinEvent) -> Received {
    Received {
        peer: None,
        node: Some((node, generation)),
        source: Source::Webhook,
        line: super::event_line(ev),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_failures_are_named_as_such() {
        let text = "anna[2143]: WARNING **: package retrieval failed";
        assert_eq!(failure_reason(text, None), text);
        // The previous generation failed the same way (another pid).
        let prev = "installing: anna[1988]: WARNING **: package retrieval failed";
        assert_eq!(
            failure_reason(text, Some((3, prev))),
            "repeated failure (as in generation 3): anna[2143]: WARNING **: package retrieval failed"
        );
        // ... which was itself a repeat.
        let prev = "installing: repeated failure (as in generation 2): anna[1988]: WARNING **: package retrieval failed";
        assert!(
            failure_reason(text, Some((3, prev)))
                .starts_with("repeated failure (as in generation 3): ")
        );
        // Another error is not a repeat.
        let prev = "installing: main-menu[278]: WARNING **: Menu item 'partman-base' failed.";
        assert_eq!(failure_reason(text, Some((3, prev))), text);
        // A long text is cut.
        let long = "x".repeat(5000);
        assert!(failure_reason(&long, None).len() <= MAX_REASON);
    }
}
