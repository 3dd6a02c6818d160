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
}
