//! Counters shared by the servers and rendered at `/metrics` (Prometheus text format).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// A monotonically increasing counter.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds one.
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    /// The current value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down (e.g. transfers in flight).
#[derive(Debug, Default)]
pub struct Gauge(AtomicI64);

impl Gauge {
    /// Adds one.
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    /// Subtracts one.
    pub fn dec(&self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
    /// The current value.
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
    /// Sets the value (a count kept elsewhere, such as a map's length).
    pub fn set(&self, v: i64) {
        self.0.store(v, Ordering::Relaxed);
    }
}

/// A counter per combination of `N` label values. Values are `&'static str`, so they
/// come from enums in the code and never from a request: the family stays bounded.
#[derive(Debug)]
pub struct CounterFamily<const N: usize> {
    name: &'static str,
    help: &'static str,
    labels: [&'static str; N],
    values: Mutex<BTreeMap<[&'static str; N], u64>>,
}

impl<const N: usize> CounterFamily<N> {
    /// An empty family; `labels` are the label names, in the order values are given.
    pub fn new(name: &'static str, help: &'static str, labels: [&'static str; N]) -> Self {
        CounterFamily {
            name,
            help,
            labels,
            values: Mutex::new(BTreeMap::new()),
        }
    }

    /// Adds one to the counter of these label values.
    pub fn inc(&self, values: [&'static str; N]) {
        let mut m = self.values.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry(values).or_default() += 1;
    }

    /// The counter of these label values (0 when never incremented).
    pub fn get(&self, values: [&'static str; N]) -> u64 {
        let m = self.values.lock().unwrap_or_else(|e| e.into_inner());
        m.get(&values).copied().unwrap_or(0)
    }
}

impl<const N: usize> Render for CounterFamily<N> {
    fn render(&self, out: &mut String) {
        let name = self.name;
        let _ = writeln!(out, "# HELP {name} {}\n# TYPE {name} counter", self.help);
        let m = self.values.lock().unwrap_or_else(|e| e.into_inner());
        for (values, n) in m.iter() {
            let labels: Vec<String> = self
                .labels
                .iter()
                .zip(values)
                .map(|(l, v)| format!("{l}=\"{v}\""))
                .collect();
            let _ = writeln!(out, "{name}{{{}}} {n}", labels.join(","));
        }
    }
}

/// Upper bounds (seconds) for durations of boot stages and reinstalls: a DHCP exchange
/// takes seconds, an install tens of minutes.
pub const STAGE_BUCKETS: &[f64] = &[
    1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0,
];

#[derive(Debug, Clone, Default)]
struct Buckets {
    /// Observations at or below each bound (not cumulative; summed when rendered).
    counts: Vec<u64>,
    count: u64,
    sum: f64,
}

impl Buckets {
    fn observe(&mut self, bounds: &[f64], v: f64) {
        if self.counts.len() != bounds.len() {
            self.counts = vec![0; bounds.len()];
        }
        if let Some(i) = bounds.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
        self.count += 1;
        self.sum += v;
    }

    fn render(&self, out: &mut String, name: &str, labels: &str, bounds: &[f64]) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (i, b) in bounds.iter().enumerate() {
            cumulative += self.counts.get(i).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cumulative}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.count
        );
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.count);
    }
}

/// A Prometheus histogram (cumulative buckets, `_sum`, `_count`).
#[derive(Debug)]
pub struct Histogram {
    name: &'static str,
    help: &'static str,
    bounds: &'static [f64],
    state: Mutex<Buckets>,
}

impl Histogram {
    /// An empty histogram with upper bounds `bounds` (ascending; `+Inf` is implied).
    pub fn new(name: &'static str, help: &'static str, bounds: &'static [f64]) -> Self {
        Histogram {
            name,
            help,
            bounds,
            state: Mutex::new(Buckets::default()),
        }
    }

    /// Records one value.
    pub fn observe(&self, v: f64) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.observe(self.bounds, v);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).count
    }
}

impl Render for Histogram {
    fn render(&self, out: &mut String) {
        let name = self.name;
        let _ = writeln!(out, "# HELP {name} {}\n# TYPE {name} histogram", self.help);
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.render(out, name, "", self.bounds);
    }
}

/// A histogram per value of one label; values are `&'static str` (bounded, as in
/// [`CounterFamily`]).
#[derive(Debug)]
pub struct HistogramFamily {
    name: &'static str,
    help: &'static str,
    label: &'static str,
    bounds: &'static [f64],
    values: Mutex<BTreeMap<&'static str, Buckets>>,
}

impl HistogramFamily {
    /// An empty family labelled `label`.
    pub fn new(
        name: &'static str,
        help: &'static str,
        label: &'static str,
        bounds: &'static [f64],
    ) -> Self {
        HistogramFamily {
            name,
            help,
            label,
            bounds,
            values: Mutex::new(BTreeMap::new()),
        }
    }

    /// Records one value for the label value `value`.
    pub fn observe(&self, value: &'static str, v: f64) {
        let mut m = self.values.lock().unwrap_or_else(|e| e.into_inner());
        m.entry(value).or_default().observe(self.bounds, v);
    }

    /// Observations so far for `value`.
    pub fn count(&self, value: &'static str) -> u64 {
        let m = self.values.lock().unwrap_or_else(|e| e.into_inner());
        m.get(value).map_or(0, |b| b.count)
    }
}

impl Render for HistogramFamily {
    fn render(&self, out: &mut String) {
        let name = self.name;
        let _ = writeln!(out, "# HELP {name} {}\n# TYPE {name} histogram", self.help);
        let m = self.values.lock().unwrap_or_else(|e| e.into_inner());
        for (value, b) in m.iter() {
            let labels = format!("{}=\"{value}\"", self.label);
            b.render(out, name, &labels, self.bounds);
        }
    }
}

/// Writes one sample in Prometheus text format.
pub fn sample(out: &mut String, name: &str, help: &str, kind: &str, value: impl std::fmt::Display) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
    );
}

/// Something that renders its counters.
pub trait Render: Send + Sync + std::fmt::Debug {
    /// Appends this component's samples to `out`.
    fn render(&self, out: &mut String);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn family_renders_one_line_per_label_set() {
        let f = CounterFamily::new("pxed_x_total", "Things", ["driver", "kind"]);
        f.inc(["alpha", "timeout"]);
        f.inc(["alpha", "timeout"]);
        f.inc(["beta", "auth_refused"]);
        let mut out = String::new();
        f.render(&mut out);
        assert_eq!(
            out,
            "# HELP pxed_x_total Things\n# TYPE pxed_x_total counter\n\
             pxed_x_total{driver=\"alpha\",kind=\"timeout\"} 2\n\
             pxed_x_total{driver=\"beta\",kind=\"auth_refused\"} 1\n"
        );
        assert_eq!(f.get(["alpha", "timeout"]), 2);
        assert_eq!(f.get(["beta", "timeout"]), 0);
    }

    #[test]
    fn histograms_render_cumulative_buckets() {
        const B: &[f64] = &[1.0, 5.0, 60.0];
        let h = Histogram::new("pxed_h_seconds", "Things", B);
        for v in [0.5, 3.0, 4.0, 61.0] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render(&mut out);
        assert_eq!(
            out,
            "# HELP pxed_h_seconds Things\n# TYPE pxed_h_seconds histogram\n\
             pxed_h_seconds_bucket{le=\"1\"} 1\n\
             pxed_h_seconds_bucket{le=\"5\"} 3\n\
             pxed_h_seconds_bucket{le=\"60\"} 3\n\
             pxed_h_seconds_bucket{le=\"+Inf\"} 4\n\
             pxed_h_seconds_sum 68.5\n\
             pxed_h_seconds_count 4\n"
        );
        let f = HistogramFamily::new("pxed_s_seconds", "Stages", "stage", B);
        f.observe("power", 30.0);
        f.observe("dhcp", 0.25);
        let mut out = String::new();
        f.render(&mut out);
        assert_eq!(
            out,
            "# HELP pxed_s_seconds Stages\n# TYPE pxed_s_seconds histogram\n\
             pxed_s_seconds_bucket{stage=\"dhcp\",le=\"1\"} 1\n\
             pxed_s_seconds_bucket{stage=\"dhcp\",le=\"5\"} 1\n\
             pxed_s_seconds_bucket{stage=\"dhcp\",le=\"60\"} 1\n\
             pxed_s_seconds_bucket{stage=\"dhcp\",le=\"+Inf\"} 1\n\
             pxed_s_seconds_sum{stage=\"dhcp\"} 0.25\n\
             pxed_s_seconds_count{stage=\"dhcp\"} 1\n\
             pxed_s_seconds_bucket{stage=\"power\",le=\"1\"} 0\n\
             pxed_s_seconds_bucket{stage=\"power\",le=\"5\"} 0\n\
             pxed_s_seconds_bucket{stage=\"power\",le=\"60\"} 1\n\
             pxed_s_seconds_bucket{stage=\"power\",le=\"+Inf\"} 1\n\
             pxed_s_seconds_sum{stage=\"power\"} 30\n\
             pxed_s_seconds_count{stage=\"power\"} 1\n"
        );
        assert_eq!(f.count("power"), 1);
        assert_eq!(f.count("lease"), 0);
    }
}
