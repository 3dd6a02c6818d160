//! Power-on waves: a reclaim of many nodes never reaches their BMCs as one burst of
//! power-ons (issue 14, "Pacing"). Each group of nodes (all nodes, or one value of a
//! label such as `rack`) gets at most `size` power-ons per wave, and its waves start
//! `interval` apart.
//!
//! The [`Pacer`] is pure: no clock, no SQL. It is told `now` and answers with a
//! [`Decision`]: go now, or the instant the caller's reserved slot opens. Slots are
//! reserved when asked for, so callers that wait are served first come, first served
//! and never ask twice. The worker keeps it in memory only: after a restart every
//! interrupted power cycle simply asks again, and waves restart from that moment.
//!
//! Waves pace the power-ons by the clock; [`Booting`] paces them by the load they make.
//! A node a reinstall has powered on is *booting* until it reaches its installer (its
//! kickstart, autoinstall or preseed is fetched, or its deploy agent asks for its
//! plan) or leaves the reinstall; at most `max_booting` nodes boot at once, and a
//! further power-on waits (first come, first served) for one of them to get there.
//! Each booting node is about one HTTP connection (its script, kernel, initrd), so a
//! reclaim far larger than the transfer rate can serve never stacks its nodes up to
//! pxed's connection cap, where the surplus would be answered `503 busy` and firmware
//! would give up after its few retries (5,000 nodes in `bench/storm.sh`, Dec 4). The
//! wait is bounded ([`BOOT_WAIT_MAX`]): a power-on is delayed, never dropped.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::metrics::{Counter, Gauge, Histogram, Render, sample};

/// The wave settings (from `[pacing]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waves {
    /// Power-ons per wave and group; 0: unlimited.
    pub size: u32,
    /// From the start of one wave of a group to the start of its next.
    pub interval: Duration,
    /// The label key whose values are the groups; `None`: one group for all nodes.
    pub by_label: Option<String>,
}

impl Waves {
    /// No waves at all: every power-on goes at once.
    pub const UNLIMITED: Waves = Waves {
        size: 0,
        interval: Duration::from_secs(1),
        by_label: None,
    };

    /// The settings of a validated `[pacing]` section.
    pub fn from_config(p: &crate::config::Pacing) -> Waves {
        Waves {
            size: p.power_on_wave_size,
            interval: Duration::from_secs(p.power_on_wave_interval_secs),
            by_label: p.power_on_wave_by_label.clone(),
        }
    }
}

impl Default for Waves {
    fn default() -> Self {
        Waves::from_config(&crate::config::Pacing::default())
    }
}

/// A group of nodes that share waves: `None` is the shared group (pacing not by label,
/// or a node without the label), `Some(value)` the nodes whose label has that value.
pub type Group = Option<String>;

/// The pacer's answer to one power-on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Power on now, as part of wave `wave` of the group (0 when unlimited).
    Go { wave: u64 },
    /// A slot in wave `wave` is reserved; power on at `until`.
    Wait { wave: u64, until: Instant },
}

impl Decision {
    /// The wave the power-on belongs to.
    pub fn wave(&self) -> u64 {
        match *self {
            Decision::Go { wave } | Decision::Wait { wave, .. } => wave,
        }
    }
}

/// The newest wave of one group: where it starts, its number and the slots taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Wave {
    start: Instant,
    number: u64,
    granted: u32,
}

/// Grants power-ons in waves per group (see the module documentation).
#[derive(Debug)]
pub struct Pacer {
    waves: Waves,
    groups: HashMap<Group, Wave>,
}

impl Pacer {
    /// A pacer with no power-on granted yet.
    pub fn new(waves: Waves) -> Pacer {
        Pacer {
            waves,
            groups: HashMap::new(),
        }
    }

    /// The settings in force.
    pub fn waves(&self) -> &Waves {
        &self.waves
    }

    /// Replaces the settings (configuration reloaded). Slots already reserved keep
    /// their time; the next request sees the new size and interval.
    pub fn set_waves(&mut self, waves: Waves) {
        self.waves = waves;
    }

    /// One power-on of a node in `group`, asked at `now`: the slot is taken whatever
    /// the answer (give it back with [`Pacer::release`] if it is not used).
    pub fn request(&mut self, group: &Group, now: Instant) -> Decision {
        let Waves { size, interval, .. } = self.waves;
        if size == 0 {
            return Decision::Go { wave: 0 };
        }
        // Groups whose newest wave is over hold nothing a request needs.
        self.groups.retain(|_, w| now < w.start + interval);
        let wave = match self.groups.get(group).copied() {
            // No wave open: one starts now.
            None => Wave {
                start: now,
                number: 1,
                granted: 1,
            },
            Some(w) if w.granted < size => Wave {
                granted: w.granted + 1,
                ..w
            },
            Some(w) => Wave {
                start: w.start + interval,
                number: w.number + 1,
                granted: 1,
            },
        };
        // A group that has been quiet past its last wave restarts its count at 1: a
        // number is "the nth wave of this burst", which is what the timeline shows.
        self.groups.insert(group.clone(), wave);
        if wave.start <= now {
            Decision::Go { wave: wave.number }
        } else {
            Decision::Wait {
                wave: wave.number,
                until: wave.start,
            }
        }
    }

    /// Gives back a slot of `wave` that was not used (the node changed meanwhile). Only
    /// the group's newest wave can take it back; a slot of an earlier wave stays a gap.
    pub fn release(&mut self, group: &Group, wave: u64) {
        if let Some(w) = self.groups.get_mut(group)
            && w.number == wave
        {
            w.granted = w.granted.saturating_sub(1);
        }
    }

    /// Groups with a wave open or reserved.
    pub fn open_groups(&self) -> usize {
        self.groups.len()
    }
}

/// The longest a power-on waits for a booting node to reach its installer; after it,
/// the power-on goes anyway (counted in [`Stats::boot_wait_expired`]). Well inside the
/// `reclaiming` deadline (5 min by default), which the wait counts against.
pub const BOOT_WAIT_MAX: Duration = Duration::from_secs(120);

/// A node counted as booting longer than this is counted no more: one whose installer
/// never called and whose state change this instance did not see (taken over by
/// another instance) must not hold a place for ever.
pub const BOOTING_MAX_AGE: Duration = Duration::from_secs(30 * 60);

/// The nodes booting now, each holding one place of the `max_booting` gate (see the
/// module documentation). In memory only: after a restart nothing is booting and the
/// gate fills again from the power-ons that follow.
#[derive(Debug)]
pub struct Booting {
    limit: u32,
    gate: Arc<Semaphore>,
    held: HashMap<i64, (OwnedSemaphorePermit, Instant)>,
}

impl Booting {
    /// At most `limit` nodes booting at once; 0: no limit.
    pub fn new(limit: u32) -> Booting {
        Booting {
            limit,
            gate: Arc::new(Semaphore::new(limit as usize)),
            held: HashMap::new(),
        }
    }

    /// The limit in force (0: none).
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Replaces the limit (configuration reloaded). Nodes booting under the old limit
    /// keep their places, which go back to the old gate; the new gate starts with all
    /// of its places free, so a reload can let up to the old count through beside it.
    pub fn set_limit(&mut self, limit: u32) {
        if limit != self.limit {
            self.limit = limit;
            self.gate = Arc::new(Semaphore::new(limit as usize));
        }
    }

    /// The gate node `id`'s power-on must pass, or `None` when it goes at once: no
    /// limit, or the node is booting already (a retried power cycle keeps its place).
    /// Forgets nodes booting longer than [`BOOTING_MAX_AGE`] first.
    pub fn gate_for(&mut self, id: i64, now: Instant) -> Option<Arc<Semaphore>> {
        self.held
            .retain(|_, (_, since)| now.saturating_duration_since(*since) < BOOTING_MAX_AGE);
        if self.limit == 0 || self.held.contains_key(&id) {
            return None;
        }
        Some(self.gate.clone())
    }

    /// Node `id` is booting from `now`, holding `place`.
    pub fn hold(&mut self, id: i64, place: OwnedSemaphorePermit, now: Instant) {
        self.held.insert(id, (place, now));
    }

    /// Node `id` reached its installer or left the reinstall: its place is free.
    /// Whether it held one.
    pub fn done(&mut self, id: i64) -> bool {
        self.held.remove(&id).is_some()
    }

    /// Nodes booting now.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether no node is booting.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

/// Upper bounds (seconds) of the power-on wait: one wave interval is seconds, the last
/// wave of a thousand-node reclaim minutes.
pub const WAIT_BUCKETS: &[f64] = &[
    0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
];

/// What pacing did, at `/metrics`.
#[derive(Debug)]
pub struct Stats {
    /// Power cycles waiting for their wave now.
    pub waiting: Gauge,
    /// Power cycles let through (at once or after a wait).
    pub granted: Counter,
    /// Power cycles that had to wait for a later wave.
    pub delayed: Counter,
    /// Time from asking to going, per granted power cycle (0 when not delayed).
    pub wait: Histogram,
    /// Nodes booting now (see [`Booting`]).
    pub booting: Gauge,
    /// Power cycles that waited for a booting node to reach its installer.
    pub boot_delayed: Counter,
    /// Power cycles that went after [`BOOT_WAIT_MAX`] with every place still taken.
    pub boot_wait_expired: Counter,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            waiting: Gauge::default(),
            granted: Counter::default(),
            delayed: Counter::default(),
            wait: Histogram::new(
                "pxed_power_on_wait_seconds",
                "Time a reinstall's power cycle waited for its wave and a booting place (0 when it went at once)",
                WAIT_BUCKETS,
            ),
            booting: Gauge::default(),
            boot_delayed: Counter::default(),
            boot_wait_expired: Counter::default(),
        }
    }
}

impl Render for Stats {
    fn render(&self, out: &mut String) {
        sample(
            out,
            "pxed_power_on_waiting",
            "Power cycles waiting for their power-on wave or a booting place",
            "gauge",
            self.waiting.get(),
        );
        sample(
            out,
            "pxed_power_on_granted_total",
            "Power cycles let through by the power-on pacer",
            "counter",
            self.granted.get(),
        );
        sample(
            out,
            "pxed_power_on_delayed_total",
            "Power cycles that waited for a later power-on wave",
            "counter",
            self.delayed.get(),
        );
        sample(
            out,
            "pxed_power_on_booting",
            "Nodes powered on by a reinstall that have not reached their installer yet",
            "gauge",
            self.booting.get(),
        );
        sample(
            out,
            "pxed_power_on_boot_delayed_total",
            "Power cycles that waited for a booting node to reach its installer (pacing.max_booting)",
            "counter",
            self.boot_delayed.get(),
        );
        sample(
            out,
            "pxed_power_on_boot_wait_expired_total",
            "Power cycles that went after the longest wait with every booting place still taken",
            "counter",
            self.boot_wait_expired.get(),
        );
        self.wait.render(out);
    }
}

/// Counts one waiter in [`Stats::waiting`] for as long as it lives (also when the wait
/// is cancelled at shutdown).
#[derive(Debug)]
pub struct Waiting(Arc<Stats>);

impl Waiting {
    /// Starts counting.
    pub fn new(stats: Arc<Stats>) -> Waiting {
        stats.waiting.inc();
        Waiting(stats)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waves(size: u32, secs: u64) -> Waves {
        Waves {
            size,
            interval: Duration::from_secs(secs),
            by_label: None,
        }
    }

    /// What a request answers, as (wave, seconds from `t0` to going).
    fn ask(p: &mut Pacer, group: &str, t0: Instant, at_ms: u64) -> (u64, u64) {
        let group = (!group.is_empty()).then(|| group.to_string());
        let now = t0 + Duration::from_millis(at_ms);
        match p.request(&group, now) {
            Decision::Go { wave } => (wave, at_ms),
            Decision::Wait { wave, until } => {
                assert!(until > now, "a wait ends in the future");
                (wave, (until - t0).as_millis() as u64)
            }
        }
    }

    /// Rows: settings, then requests (group, at ms) and the (wave, go at ms) each gets.
    #[test]
    fn waves_table() {
        type Row = (
            &'static str,
            Waves,
            &'static [(&'static str, u64, (u64, u64))],
        );
        let rows: &[Row] = &[
            (
                "six at once, two per wave: three waves two seconds apart",
                waves(2, 2),
                &[
                    ("", 0, (1, 0)),
                    ("", 0, (1, 0)),
                    ("", 0, (2, 2000)),
                    ("", 0, (2, 2000)),
                    ("", 0, (3, 4000)),
                    ("", 0, (3, 4000)),
                ],
            ),
            (
                "unlimited: everything at once, no waves",
                waves(0, 10),
                &[("", 0, (0, 0)), ("", 0, (0, 0)), ("", 5, (0, 5))],
            ),
            (
                "a wave of one",
                waves(1, 10),
                &[("", 0, (1, 0)), ("", 1, (2, 10_000)), ("", 2, (3, 20_000))],
            ),
            (
                "a request inside the open wave joins it while it has room",
                waves(3, 10),
                &[
                    ("", 0, (1, 0)),
                    ("", 4_000, (1, 4_000)),
                    ("", 9_999, (1, 9_999)),
                    ("", 9_999, (2, 10_000)),
                ],
            ),
            (
                "the interval rolls over: a full wave whose time has passed is closed",
                waves(2, 10),
                &[
                    ("", 0, (1, 0)),
                    ("", 1, (1, 1)),
                    ("", 10_000, (1, 10_000)),
                    ("", 10_001, (1, 10_001)),
                    ("", 10_002, (2, 20_000)),
                ],
            ),
            (
                "after a quiet spell a new burst starts at once, counted from one",
                waves(1, 10),
                &[
                    ("", 0, (1, 0)),
                    ("", 0, (2, 10_000)),
                    ("", 60_000, (1, 60_000)),
                ],
            ),
            (
                "requests between reserved waves queue behind them",
                waves(1, 5),
                &[
                    ("", 0, (1, 0)),
                    ("", 0, (2, 5_000)),
                    ("", 3_000, (3, 10_000)),
                    ("", 6_000, (4, 15_000)),
                ],
            ),
            (
                "each rack has its own waves; unlabelled nodes share one group",
                Waves {
                    by_label: Some("rack".into()),
                    ..waves(1, 10)
                },
                &[
                    ("r1", 0, (1, 0)),
                    ("r2", 0, (1, 0)),
                    ("", 0, (1, 0)),
                    ("r1", 0, (2, 10_000)),
                    ("", 0, (2, 10_000)),
                    ("r2", 500, (2, 10_000)),
                    ("r3", 500, (1, 500)),
                ],
            ),
        ];
        for (name, w, reqs) in rows {
            let t0 = Instant::now();
            let mut p = Pacer::new(w.clone());
            for (i, (group, at, want)) in reqs.iter().enumerate() {
                assert_eq!(
                    ask(&mut p, group, t0, *at),
                    *want,
                    "{name}: request {i} ({group:?} at {at} ms)"
                );
            }
        }
    }

    #[test]
    fn a_released_slot_is_given_again_in_the_newest_wave_only() {
        let t0 = Instant::now();
        let mut p = Pacer::new(waves(1, 10));
        assert_eq!(ask(&mut p, "", t0, 0), (1, 0));
        assert_eq!(ask(&mut p, "", t0, 0), (2, 10_000));
        // Wave 2's node was quarantined while it waited: its slot goes to the next.
        p.release(&None, 2);
        assert_eq!(ask(&mut p, "", t0, 1), (2, 10_000));
        // A slot of an older wave is not taken back (the wave went already).
        p.release(&None, 1);
        assert_eq!(ask(&mut p, "", t0, 2), (3, 20_000));
        // Unlimited: nothing to give back, nothing breaks.
        let mut u = Pacer::new(Waves::UNLIMITED);
        u.release(&None, 0);
        assert_eq!(u.request(&None, t0), Decision::Go { wave: 0 });
    }

    #[test]
    fn closed_groups_are_forgotten() {
        let t0 = Instant::now();
        let mut p = Pacer::new(waves(1, 10));
        for rack in ["r1", "r2", "r3"] {
            ask(&mut p, rack, t0, 0);
        }
        assert_eq!(p.open_groups(), 3);
        ask(&mut p, "r4", t0, 10_000);
        assert_eq!(p.open_groups(), 1, "only r4's wave is open");
    }

    #[test]
    fn new_settings_apply_to_the_next_request() {
        let t0 = Instant::now();
        let mut p = Pacer::new(waves(1, 10));
        assert_eq!(ask(&mut p, "", t0, 0), (1, 0));
        p.set_waves(waves(3, 10));
        assert_eq!(ask(&mut p, "", t0, 1), (1, 1));
        p.set_waves(Waves::UNLIMITED);
        assert_eq!(ask(&mut p, "", t0, 2), (0, 2));
    }

    #[test]
    fn stats_render_and_the_waiting_guard_counts_down() {
        let s = Arc::new(Stats::default());
        {
            let _a = Waiting::new(s.clone());
            let _b = Waiting::new(s.clone());
            assert_eq!(s.waiting.get(), 2);
        }
        assert_eq!(s.waiting.get(), 0);
        s.granted.add(3);
        s.delayed.inc();
        s.wait.observe(0.0);
        s.wait.observe(2.5);
        let mut out = String::new();
        s.render(&mut out);
        for line in [
            "pxed_power_on_waiting 0",
            "pxed_power_on_granted_total 3",
            "pxed_power_on_delayed_total 1",
            "pxed_power_on_wait_seconds_bucket{le=\"0.5\"} 1",
            "pxed_power_on_wait_seconds_bucket{le=\"5\"} 2",
            "pxed_power_on_wait_seconds_count 2",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} not in\n{out}");
        }
    }

    /// Two places: two nodes take them, a third finds the gate shut until one of them
    /// is done; a node already booting never waits again; a place held past
    /// BOOTING_MAX_AGE is forgotten; 0 is no limit; a new limit is a new gate.
    #[test]
    fn booting_places_are_taken_given_back_and_aged_out() {
        let t0 = Instant::now();
        let mut b = Booting::new(2);
        for id in [1, 2] {
            let gate = b.gate_for(id, t0).expect("a limit");
            b.hold(id, gate.try_acquire_owned().expect("a free place"), t0);
        }
        assert_eq!(b.len(), 2);
        assert!(b.gate_for(1, t0).is_none(), "node 1 is booting already");
        let gate = b.gate_for(3, t0).expect("a limit");
        assert!(
            gate.clone().try_acquire_owned().is_err(),
            "both places taken"
        );
        assert!(b.done(1));
        assert!(!b.done(1), "given back once");
        let place = gate.try_acquire_owned().expect("node 1's place");
        b.hold(3, place, t0);
        // Nodes 2 and 3 never called: after BOOTING_MAX_AGE their places are free.
        let later = t0 + BOOTING_MAX_AGE + Duration::from_secs(1);
        let gate = b.gate_for(4, later).expect("a limit");
        assert!(b.is_empty(), "aged out");
        assert_eq!(gate.available_permits(), 2);

        let mut none = Booting::new(0);
        assert!(none.gate_for(1, t0).is_none(), "0: no limit");
        none.set_limit(1);
        let g = none.gate_for(1, t0).expect("a limit now");
        assert_eq!((none.limit(), g.available_permits()), (1, 1));
    }
}
