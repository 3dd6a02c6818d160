//! What the technicians' board and node page show, decided by pure functions over a
//! node and its audit log: the current stage against its expected duration, the
//! current generation's stages on a time axis, and earlier generations' durations.
//! The templates only draw what these return.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::lifecycle::transition::Policy;
use crate::model::{Stage, State};
use crate::store::nodes::{EventRow, parse_time};
use crate::wire::NodeView;

/// Where a node is now, as a board row shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StageView {
    /// The stage's name.
    pub name: String,
    /// When the node entered it (RFC 3339).
    pub since: String,
    /// Seconds in it so far.
    pub elapsed_s: i64,
    /// How long it is expected to take; `None` for a resting state.
    pub expected_s: Option<u64>,
    /// In it longer than expected.
    pub overdue: bool,
    /// When the node will be overdue if nothing changes (RFC 3339): the earlier of its
    /// stage's and its state's expectations. The page's script marks it then.
    pub overdue_at: Option<String>,
}

impl StageView {
    /// `3 min 5 s of 15 min 0 s` (or just the elapsed time in a resting state).
    pub fn text(&self) -> String {
        let e = human(self.elapsed_s);
        match self.expected_s {
            Some(x) => format!("{e} of {}", human(i64::try_from(x).unwrap_or(i64::MAX))),
            None => e,
        }
    }
}

/// Where a node in a reinstall is by the wire: the last stage its current generation
/// reached (see [`crate::stages`]), and since when.
pub type WireStage<'a> = Option<(Stage, &'a str)>;

/// The stage a board row shows for `n`. A node in a reinstall shows the last stage
/// seen on the wire (`kernel`, `installer_packages`, ...) against that stage's
/// expected duration (`[stages] expected`); a node without one, or at rest, shows its
/// lifecycle state since `state_since` against the state's `lifecycle.deadlines`
/// entry (resting states have none); so does a node past that deadline, whatever
/// stage the wire saw last.
pub fn stage_of(
    n: &NodeView,
    policy: &Policy,
    wire: WireStage<'_>,
    expected: &BTreeMap<Stage, Duration>,
    now: DateTime<Utc>,
) -> StageView {
    let elapsed = |since: &str| {
        let t = parse_time(since).unwrap_or(now);
        (now - t).max(chrono::TimeDelta::zero())
    };
    let due = |since: &str, exp: Option<Duration>| {
        let t = parse_time(since)?;
        Some(t + chrono::TimeDelta::from_std(exp?).ok()?)
    };
    let el = elapsed(&n.since);
    let exp = policy.deadline(n.state);
    let state_due = due(&n.since, exp);
    let by_state = StageView {
        name: n.state.to_string(),
        since: n.since.clone(),
        elapsed_s: el.num_seconds(),
        expected_s: exp.map(|d| d.as_secs()),
        overdue: exp.is_some_and(|e| el.to_std().is_ok_and(|el| el > e)),
        overdue_at: state_due.map(rfc3339),
    };
    // Past its state's deadline is the stronger signal: the lifecycle acts on it.
    if by_state.overdue {
        return by_state;
    }
    match wire {
        Some((stage, at)) if n.state.in_progress() => {
            let exp = expected.get(&stage).copied();
            let first = match (due(at, exp), state_due) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            StageView {
                name: stage.to_string(),
                since: at.to_string(),
                elapsed_s: elapsed(at).num_seconds(),
                expected_s: exp.map(|d| d.as_secs()),
                overdue: crate::stages::is_stuck(n.state, stage, at, exp, now),
                overdue_at: first.map(rfc3339),
            }
        }
        _ => by_state,
    }
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Why a node is failed or quarantined, in words: `<step>: <reason>`.
pub fn reason_of(n: &NodeView) -> Option<String> {
    crate::model::failure_text(n.failed_step, n.failed_reason.as_deref())
}

/// The name pages and links use: the operator's name, else the hostname, else the id.
pub fn title_of(n: &NodeView) -> String {
    n.name
        .clone()
        .or_else(|| n.hostname.clone())
        .unwrap_or_else(|| format!("node {}", n.id))
}

/// `45 s`, `12 min 3 s`, `2 h 5 min`, `3 d 4 h`.
pub fn human(secs: i64) -> String {
    let s = secs.max(0);
    match s {
        0..120 => format!("{s} s"),
        120..7200 => format!("{} min {} s", s / 60, s % 60),
        7200..172_800 => format!("{} h {} min", s / 3600, (s % 3600) / 60),
        _ => format!("{} d {} h", s / 86_400, (s % 86_400) / 3600),
    }
}

/// Rows of mark labels under the bars.
pub const MARK_ROWS: u8 = 3;

/// Width of the drawn time axis, in SVG user units.
pub const AXIS_WIDTH: f64 = 960.0;

/// One stage of a generation: a bar on the time axis and a row of the stage table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Bar {
    pub state: State,
    pub start: String,
    pub duration_s: i64,
    pub expected_s: Option<u64>,
    /// Longer than expected.
    pub overdue: bool,
    /// The stage the node failed in (drawn red).
    pub failing: bool,
    /// The node is in it now.
    pub current: bool,
    pub x: f64,
    pub w: f64,
}

impl Bar {
    /// CSS class of the bar.
    pub fn class(&self) -> String {
        let mut c = format!("bar st-{}", self.state);
        for (on, name) in [
            (self.failing, " failing"),
            (self.overdue, " overdue"),
            (self.current, " current"),
        ] {
            if on {
                c.push_str(name);
            }
        }
        c
    }

    /// Its label, when the bar is wide enough for one.
    pub fn label(&self) -> Option<String> {
        let text = format!("{} {}", self.state, human(self.duration_s));
        (self.w >= text.len() as f64 * 6.5 + 8.0).then_some(text)
    }

    /// Duration against expectation, in words.
    pub fn lasted(&self) -> String {
        let d = human(self.duration_s);
        match self.expected_s {
            Some(e) => format!("{d} of {}", human(i64::try_from(e).unwrap_or(i64::MAX))),
            None => d,
        }
    }
}

/// Something that happened within a stage (an installer milestone, a BMC note, an
/// operator's power cycle): a mark on the axis.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Mark {
    pub event: String,
    pub at: String,
    pub detail: Option<String>,
    pub x: f64,
    /// Row of its label (below [`MARK_ROWS`]), so neighbours do not overlap.
    pub row: u8,
}

/// A tick of the axis: `+90 s`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Tick {
    pub x: f64,
    pub label: String,
}

/// The current generation's stages on a time axis.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Timeline {
    pub generation: i64,
    pub start: String,
    pub span_s: i64,
    pub bars: Vec<Bar>,
    pub marks: Vec<Mark>,
    pub ticks: Vec<Tick>,
    /// The state the generation ended in, if it ended (drawn as a flag at the end).
    pub ended: Option<State>,
}

/// Draws generation `n.generation` from the audit log: each state change opens a
/// stage that lasts until the next one (the last until `now` while it is in
/// progress); entries that change no state are marks.
pub fn timeline(
    n: &NodeView,
    events: &[EventRow],
    policy: &Policy,
    now: DateTime<Utc>,
) -> Option<Timeline> {
    let gen_events: Vec<(&EventRow, DateTime<Utc>)> = events
        .iter()
        .filter(|e| e.generation == n.generation)
        .filter_map(|e| parse_time(&e.at).map(|t| (e, t)))
        .collect();
    let t0 = gen_events.first()?.1;
    // (state, entered at) of each stage, and the marks.
    let mut stages: Vec<(State, DateTime<Utc>)> = Vec::new();
    let mut marks = Vec::new();
    for (e, t) in &gen_events {
        let changes = e.from_state != Some(e.to_state) || stages.is_empty();
        if changes {
            stages.push((e.to_state, *t));
        } else {
            marks.push((e, *t));
        }
    }
    let last_at = gen_events.last().map(|(_, t)| *t).unwrap_or(t0);
    let in_progress = n.state.in_progress();
    let end = if in_progress {
        now.max(last_at)
    } else {
        last_at
    };
    let span_ms = (end - t0).num_milliseconds().max(1000);
    let x = |t: DateTime<Utc>| (t - t0).num_milliseconds() as f64 / span_ms as f64 * AXIS_WIDTH;
    let failed = matches!(n.state, State::Failed | State::Quarantined) && n.failed_step.is_some();
    // A resting final state is where the generation ended, not a stage.
    let ended = match stages.last() {
        Some((s, _)) if !s.in_progress() && stages.len() > 1 => Some(*s),
        _ => None,
    };
    let drawn = stages.len() - usize::from(ended.is_some());
    let mut bars = Vec::new();
    for i in 0..drawn {
        let (state, start) = stages[i];
        let stop = stages.get(i + 1).map(|(_, t)| *t).unwrap_or(end);
        let duration_s = (stop - start).num_seconds().max(0);
        let expected_s = policy.deadline(state).map(|d| d.as_secs());
        let is_last = i + 1 == drawn;
        // The stage a failure ended: the last one before `failed` (or `quarantined`).
        let failing = failed && is_last && ended.is_some();
        let x0 = x(start);
        bars.push(Bar {
            state,
            start: start.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            duration_s,
            expected_s,
            overdue: expected_s.is_some_and(|e| duration_s > i64::try_from(e).unwrap_or(i64::MAX)),
            failing,
            current: in_progress && ended.is_none() && is_last,
            x: x0,
            w: (x(stop) - x0).max(2.0),
        });
    }
    // Each label goes in the first of MARK_ROWS rows where it does not overlap the
    // previous label (about 6.5 units a character), else in the row that ends first.
    let mut ends = [f64::NEG_INFINITY; MARK_ROWS as usize];
    let marks = marks
        .into_iter()
        .map(|(e, t)| {
            let mx = x(t);
            let width = e.event.len() as f64 * 6.5 + 10.0;
            // Labels near the right end are drawn leftwards from the mark.
            let (from, to) = if mx > AXIS_WIDTH - 150.0 {
                (mx - width, mx)
            } else {
                (mx, mx + width)
            };
            let row = ends.iter().position(|&end| end < from).unwrap_or_else(|| {
                ends.iter()
                    .enumerate()
                    .min_by(|a, b| a.1.total_cmp(b.1))
                    .map(|(i, _)| i)
                    .unwrap_or(0)
            });
            ends[row] = to;
            Mark {
                event: e.event.clone(),
                at: e.at.clone(),
                detail: e.detail.clone(),
                x: mx,
                row: row as u8,
            }
        })
        .collect();
    Some(Timeline {
        generation: n.generation,
        start: t0.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        span_s: span_ms / 1000,
        bars,
        marks,
        ticks: ticks(span_ms),
        ended,
    })
}

/// About five ticks at round offsets.
fn ticks(span_ms: i64) -> Vec<Tick> {
    const STEPS: [i64; 14] = [
        1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200,
    ];
    let span_s = (span_ms / 1000).max(1);
    let step = STEPS
        .into_iter()
        .find(|s| span_s / s <= 6)
        .unwrap_or(((span_s / 6) / 3600 + 1) * 3600);
    (0..=span_s / step)
        .map(|i| {
            let s = i * step;
            Tick {
                x: (s * 1000) as f64 / span_ms as f64 * AXIS_WIDTH,
                label: if s == 0 {
                    "0".into()
                } else {
                    format!("+{}", human(s))
                },
            }
        })
        .collect()
}

/// One earlier generation: when it started, how long it took, how it ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GenerationSummary {
    pub generation: i64,
    pub started: String,
    pub duration_s: i64,
    /// The state it ended in.
    pub outcome: State,
    /// The detail of its last entry when it ended failed or quarantined.
    pub reason: Option<String>,
    /// `reclaiming 2 s · netbooting 17 s · …`
    pub stages: String,
}

impl GenerationSummary {
    /// How long it took, in words.
    pub fn took(&self) -> String {
        human(self.duration_s)
    }
}

impl Timeline {
    /// How long the drawn span is, in words.
    pub fn took(&self) -> String {
        human(self.span_s)
    }
}

/// The generations before the current one, newest first.
pub fn previous_generations(n: &NodeView, events: &[EventRow]) -> Vec<GenerationSummary> {
    let mut by_gen: BTreeMap<i64, Vec<&EventRow>> = BTreeMap::new();
    for e in events.iter().filter(|e| e.generation < n.generation) {
        by_gen.entry(e.generation).or_default().push(e);
    }
    by_gen
        .into_iter()
        .rev()
        .filter_map(|(generation, evs)| {
            let first = evs.first()?;
            let last = evs.last()?;
            let t0 = parse_time(&first.at)?;
            let t1 = parse_time(&last.at)?;
            let mut parts = Vec::new();
            let changes: Vec<&&EventRow> = evs
                .iter()
                .filter(|e| e.from_state != Some(e.to_state))
                .collect();
            for w in changes.windows(2) {
                if let (Some(a), Some(b)) = (parse_time(&w[0].at), parse_time(&w[1].at)) {
                    parts.push(format!(
                        "{} {}",
                        w[0].to_state,
                        human((b - a).num_seconds())
                    ));
                }
            }
            Some(GenerationSummary {
                generation,
                started: first.at.clone(),
                duration_s: (t1 - t0).num_seconds().max(0),
                outcome: last.to_state,
                reason: matches!(last.to_state, State::Failed | State::Quarantined)
                    .then(|| last.detail.clone())
                    .flatten(),
                stages: parts.join(" · "),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Step;

    fn policy() -> Policy {
        let mut deadlines = [None; 9];
        deadlines[State::Reclaiming.index()] = Some(Duration::from_secs(300));
        deadlines[State::Netbooting.index()] = Some(Duration::from_secs(900));
        deadlines[State::Installing.index()] = Some(Duration::from_secs(3600));
        Policy {
            deadlines,
            max_attempts: 0,
            backoff: Duration::from_secs(1),
            backoff_max: Duration::from_secs(1),
            observe_window: None,
        }
    }

    fn node(state: State, since: &str, generation: i64) -> NodeView {
        NodeView {
            id: 7,
            name: None,
            hostname: Some("node-0a0b0c".into()),
            arch: crate::model::NodeArch::UNKNOWN,
            state,
            since: since.into(),
            generation,
            attempt: 0,
            image: None,
            failed_step: None,
            failed_reason: None,
            macs: vec![],
            facts: None,
            site: None,
        }
    }

    fn ev(
        generation: i64,
        from: Option<State>,
        event: &str,
        to: State,
        at: &str,
        detail: Option<&str>,
    ) -> EventRow {
        EventRow {
            id: 0,
            node_id: 7,
            generation,
            from_state: from,
            event: event.into(),
            to_state: to,
            at: at.into(),
            actor: "test".into(),
            detail: detail.map(str::to_string),
        }
    }

    fn t(s: &str) -> DateTime<Utc> {
        parse_time(s).unwrap()
    }

    #[test]
    fn a_stage_past_its_expected_duration_is_overdue() {
        let none = BTreeMap::new();
        let n = node(State::Netbooting, "2026-01-01T00:00:00.000Z", 1);
        let s = stage_of(&n, &policy(), None, &none, t("2026-01-01T00:14:59Z"));
        assert_eq!(
            (s.elapsed_s, s.expected_s, s.overdue),
            (899, Some(900), false)
        );
        let s = stage_of(&n, &policy(), None, &none, t("2026-01-01T00:15:01Z"));
        assert!(s.overdue, "{s:?}");
        // Seen on the wire: the last stage reached, against its own expected duration.
        let expected = BTreeMap::from([(Stage::Kernel, Duration::from_secs(120))]);
        let wire = Some((Stage::Kernel, "2026-01-01T00:10:00.000Z"));
        let s = stage_of(&n, &policy(), wire, &expected, t("2026-01-01T00:11:00Z"));
        assert_eq!(
            (s.name.as_str(), s.elapsed_s, s.expected_s, s.overdue),
            ("kernel", 60, Some(120), false)
        );
        assert_eq!(s.overdue_at.as_deref(), Some("2026-01-01T00:12:00.000Z"));
        let s = stage_of(&n, &policy(), wire, &expected, t("2026-01-01T00:12:01Z"));
        assert!(s.overdue, "{s:?}");
        // Past the state's deadline the state shows, whatever the wire saw last.
        let late = Some((Stage::Kernel, "2026-01-01T00:14:00.000Z"));
        let s = stage_of(&n, &policy(), late, &expected, t("2026-01-01T00:15:01Z"));
        assert_eq!((s.name.as_str(), s.overdue), ("netbooting", true));
        // Resting states have no expectation and are never overdue, whatever the wire
        // saw last.
        let n = node(State::Available, "2020-01-01T00:00:00.000Z", 1);
        let s = stage_of(&n, &policy(), wire, &expected, t("2026-01-01T00:00:00Z"));
        assert_eq!(
            (s.name.as_str(), s.expected_s, s.overdue),
            ("available", None, false)
        );
        assert_eq!(title_of(&n), "node-0a0b0c");
        assert_eq!(human(59), "59 s");
        assert_eq!(human(725), "12 min 5 s");
        assert_eq!(human(7500), "2 h 5 min");
    }

    #[test]
    fn the_failing_stage_is_marked_and_milestones_are_marks() {
        use State::*;
        let events = vec![
            ev(
                0,
                None,
                "registered",
                Available,
                "2026-01-01T00:00:00Z",
                None,
            ),
            ev(
                1,
                Some(Available),
                "reinstall_requested",
                Reclaiming,
                "2026-01-01T01:00:00Z",
                None,
            ),
            ev(
                1,
                Some(Reclaiming),
                "power_cycled",
                Netbooting,
                "2026-01-01T01:00:10Z",
                None,
            ),
            ev(
                1,
                Some(Netbooting),
                "installer_served",
                Installing,
                "2026-01-01T01:00:40Z",
                None,
            ),
            ev(
                1,
                Some(Installing),
                "installer_partitioning",
                Installing,
                "2026-01-01T01:01:00Z",
                None,
            ),
            ev(
                1,
                Some(Installing),
                "install_failed",
                Failed,
                "2026-01-01T01:01:40Z",
                Some("disk gone"),
            ),
            ev(
                2,
                Some(Failed),
                "reinstall_requested",
                Reclaiming,
                "2026-01-01T02:00:00Z",
                None,
            ),
            ev(
                2,
                Some(Reclaiming),
                "power_cycled",
                Netbooting,
                "2026-01-01T02:00:05Z",
                None,
            ),
        ];
        let mut n = node(Failed, "2026-01-01T01:01:40Z", 1);
        n.failed_step = Some(Step::Stage(Installing));
        let tl = timeline(&n, &events, &policy(), t("2026-01-01T05:00:00Z")).unwrap();
        let states: Vec<State> = tl.bars.iter().map(|b| b.state).collect();
        assert_eq!(states, [Reclaiming, Netbooting, Installing]);
        assert_eq!(tl.ended, Some(Failed));
        assert_eq!(tl.span_s, 100, "ended at the failure, not now");
        assert!(tl.bars[2].failing && !tl.bars[1].failing && !tl.bars[0].failing);
        assert_eq!(tl.bars[2].duration_s, 60);
        assert!(tl.bars[2].class().contains("failing"));
        assert_eq!(tl.marks.len(), 1);
        assert_eq!(tl.marks[0].event, "installer_partitioning");
        assert!((tl.bars[1].x - 96.0).abs() < 0.01, "{}", tl.bars[1].x);
        assert!(tl.ticks.len() >= 3 && tl.ticks[0].label == "0");

        // The running generation: the last stage lasts until now, overdue past 900 s.
        let n = node(Netbooting, "2026-01-01T02:00:05Z", 2);
        let tl = timeline(&n, &events, &policy(), t("2026-01-01T02:20:05Z")).unwrap();
        assert_eq!(tl.bars.len(), 2);
        let cur = &tl.bars[1];
        assert!(cur.current && cur.overdue && !cur.failing, "{cur:?}");
        assert_eq!(cur.lasted(), "20 min 0 s of 15 min 0 s");
        assert_eq!(tl.ended, None);

        let prev = previous_generations(&n, &events);
        assert_eq!(prev.len(), 2);
        assert_eq!(prev[0].generation, 1);
        assert_eq!(prev[0].duration_s, 100);
        assert_eq!(prev[0].outcome, Failed);
        assert_eq!(prev[0].reason.as_deref(), Some("disk gone"));
        assert_eq!(
            prev[0].stages,
            "reclaiming 10 s · netbooting 30 s · installing 60 s"
        );
    }
}
