//! What an audit found: the table people read and the JSON scripts read.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};
use std::time::Duration;

use serde_json::{Value, json};

use super::{FaultKind, Violation};
use crate::exit::Exit;

/// One injected fault and what followed it.
#[derive(Debug)]
pub(super) struct Injected {
    pub(super) kind: FaultKind,
    /// When, on the monotonic clock the holders share (see [`super::mono`]).
    pub(super) at: Duration,
    /// The epoch of the holder it hit.
    epoch: i64,
    /// Until a new epoch was acquired, if the lease moved.
    moved: Option<Duration>,
    /// Until the next acknowledged write: the write outage it caused.
    pub(super) resumed: Option<Duration>,
    /// No write was acknowledged for a long time after it.
    pub(super) stalled: bool,
    /// `backend`: the sessions terminated.
    pub(super) sessions: Option<i64>,
}

impl Injected {
    pub(super) fn new(kind: FaultKind, at: Duration, epoch: i64) -> Injected {
        Injected { kind, at, epoch, moved: None, resumed: None, stalled: false, sessions: None }
    }
}

/// The audit's findings.
#[derive(Debug)]
pub(super) struct Report {
    seed: u64,
    duration: Duration,
    holders: usize,
    ttl: Duration,
    table: String,
    setup_epoch: i64,
    /// (holder pid, epoch) in the order the auditor read them.
    acquisitions: Vec<(u32, i64)>,
    /// Acknowledged keys and their epochs.
    pub(super) acks: HashMap<String, i64>,
    pub(super) faults: Vec<Injected>,
    pub(super) violations: Vec<Violation>,
    pub(super) notes: Vec<String>,
    /// The fault kinds asked for (`--faults`).
    pub(super) kinds: Vec<FaultKind>,
    /// The kinds that cannot be injected on this deployment (a note says why): not counted
    /// against the coverage.
    pub(super) skipped: Vec<FaultKind>,
    pub(super) snapshots: u64,
    pub(super) observer_errors: u64,
    pub(super) rows: u64,
    pub(super) unacked_rows: u64,
}

impl Report {
    pub(super) fn new(
        seed: u64,
        duration: Duration,
        holders: usize,
        ttl: Duration,
        table: &str,
        setup_epoch: i64,
    ) -> Report {
        Report {
            seed,
            duration,
            holders,
            ttl,
            table: table.to_owned(),
            setup_epoch,
            acquisitions: Vec::new(),
            acks: HashMap::new(),
            faults: Vec::new(),
            violations: Vec::new(),
            notes: Vec::new(),
            kinds: Vec::new(),
            skipped: Vec::new(),
            snapshots: 0,
            observer_errors: 0,
            rows: 0,
            unacked_rows: 0,
        }
    }

    /// A holder took the lease. Every acquisition must get an epoch of its own, above the
    /// audit's setup epoch. The order in which the lines arrive proves nothing: a holder paused
    /// right after acquiring prints late.
    pub(super) fn acquired(&mut self, pid: u32, epoch: i64, at: Duration) {
        if epoch <= self.setup_epoch {
            self.violations.push(Violation::new(
                "epoch_order",
                format!("epoch {epoch} acquired, not above the setup's {}", self.setup_epoch),
            ));
        }
        if let Some((other, _)) = self.acquisitions.iter().find(|(p, e)| *e == epoch && *p != pid) {
            self.violations.push(Violation::new(
                "epoch_order",
                format!("epoch {epoch} acquired twice (processes {other} and {pid})"),
            ));
        }
        self.acquisitions.push((pid, epoch));
        if let Some(fault) = self.faults.last_mut() {
            if fault.moved.is_none() && epoch > fault.epoch && at >= fault.at {
                fault.moved = Some(at - fault.at);
            }
        }
    }

    /// A write was acknowledged. Writes resume with the first write started after the fault;
    /// after a fault that ends the holder, only under a new epoch.
    pub(super) fn acked(&mut self, key: String, epoch: i64, started: Duration, done: Duration) {
        self.acks.insert(key, epoch);
        if let Some(fault) = self.faults.last_mut() {
            let ends_holder =
                matches!(fault.kind, FaultKind::Stop | FaultKind::Kill | FaultKind::Term);
            let after = started >= fault.at && (!ends_holder || epoch > fault.epoch);
            if fault.resumed.is_none() && after {
                fault.resumed = Some(done.saturating_sub(fault.at));
            }
        }
    }

    fn latencies(&self, kinds: &[FaultKind]) -> Vec<Duration> {
        self.faults.iter().filter(|f| kinds.contains(&f.kind)).filter_map(|f| f.moved).collect()
    }

    pub(super) fn print(&self, json: bool) -> Result<(), Exit> {
        let text = if json { self.json().to_string() } else { self.text() };
        let mut out = io::stdout().lock();
        writeln!(out, "{text}").and_then(|()| out.flush()).map_err(|e| Exit::other("stdout", &e))
    }

    /// The faults of each kind asked for (none yet: an empty list), and of any other injected.
    fn by_kind(&self) -> BTreeMap<FaultKind, Vec<&Injected>> {
        let mut by_kind: BTreeMap<FaultKind, Vec<&Injected>> = BTreeMap::new();
        for kind in &self.kinds {
            by_kind.entry(*kind).or_default();
        }
        for fault in &self.faults {
            by_kind.entry(fault.kind).or_default().push(fault);
        }
        by_kind
    }

    /// Whether a kind was exercised: injected, and followed by resumed writes (or by a stall,
    /// itself a finding). A fault injected just before the end, with no outcome yet, does not
    /// count.
    fn covered(faults: &[&Injected]) -> bool {
        faults.iter().any(|f| f.resumed.is_some() || f.stalled)
    }

    /// What the run did not exercise, one phrase each; empty when it did enough. Every kind
    /// asked for and possible here must be covered, and writes must have been checked.
    pub(super) fn coverage_gaps(&self) -> Vec<String> {
        let mut gaps = Vec::new();
        if self.acks.is_empty() {
            gaps.push("no write was acknowledged".to_owned());
        }
        if self.snapshots == 0 {
            gaps.push("the observer took no snapshot".to_owned());
        }
        for (kind, faults) in self.by_kind() {
            if self.skipped.contains(&kind) || Report::covered(&faults) {
                continue;
            }
            gaps.push(match faults.len() {
                0 => format!("{} never injected", kind.name()),
                _ => format!("{} injected, but writes had not resumed by the end", kind.name()),
            });
        }
        gaps
    }

    fn text(&self) -> String {
        let mut lines = vec![
            format!(
                "pgfence audit: seed {} (repeat with --seed {}), {}, {} holders, TTL {}, table {}",
                self.seed,
                self.seed,
                human(self.duration),
                self.holders,
                human(self.ttl),
                self.table
            ),
            format!("  acquisitions        {}{}", self.acquisitions.len(), self.epoch_range()),
            format!(
                "  writes acknowledged {} (rows at the end: {}; committed without an ack: {})",
                self.acks.len(),
                self.rows,
                self.unacked_rows
            ),
            format!(
                "  observer snapshots  {} ({} failed polls)",
                self.snapshots, self.observer_errors
            ),
            format!(
                "  {:<8} {:>8} {:>12} {:>8} {:>8}   writes resumed after (median / p99)",
                "fault", "injected", "lease moved", "stalled", "covered"
            ),
        ];
        for (kind, faults) in self.by_kind() {
            let resumed: Vec<Duration> = faults.iter().filter_map(|f| f.resumed).collect();
            let covered = match (self.skipped.contains(&kind), Report::covered(&faults)) {
                (true, _) => "skipped",
                (false, true) => "yes",
                (false, false) => "NO",
            };
            lines.push(format!(
                "  {:<8} {:>8} {:>12} {:>8} {:>8}   {}",
                kind.name(),
                faults.len(),
                faults.iter().filter(|f| f.moved.is_some()).count(),
                faults.iter().filter(|f| f.stalled).count(),
                covered,
                percentiles(&resumed)
            ));
        }
        lines.push(format!(
            "  handoff  (SIGTERM to the next acquisition):        {}",
            percentiles(&self.latencies(&[FaultKind::Term]))
        ));
        lines.push(format!(
            "  takeover (other faults to the next acquisition):   {}",
            percentiles(&self.latencies(&[
                FaultKind::Stop,
                FaultKind::Kill,
                FaultKind::Backend,
                FaultKind::Cut
            ]))
        ));
        for note in &self.notes {
            lines.push(format!("  note: {note}"));
        }
        let gaps = self.coverage_gaps();
        lines.push(match gaps.is_empty() {
            true => "coverage: every fault kind injected, and writes resumed after it".to_owned(),
            false => format!("coverage: not enough: {}", gaps.join("; ")),
        });
        lines.push(format!("violations: {}", self.violations.len()));
        for violation in &self.violations {
            lines.push(format!("  {}: {}", violation.kind, violation.detail));
        }
        lines.join("\n")
    }

    fn epoch_range(&self) -> String {
        let epochs = self.acquisitions.iter().map(|(_, e)| *e);
        match (epochs.clone().min(), epochs.max()) {
            (Some(low), Some(high)) => format!(" (epochs {low} to {high})"),
            _ => String::new(),
        }
    }

    fn json(&self) -> Value {
        let faults: serde_json::Map<String, Value> = self
            .by_kind()
            .into_iter()
            .map(|(kind, faults)| {
                let resumed: Vec<Duration> = faults.iter().filter_map(|f| f.resumed).collect();
                let moved: Vec<Duration> = faults.iter().filter_map(|f| f.moved).collect();
                let sessions: i64 = faults.iter().filter_map(|f| f.sessions).sum();
                let mut entry = json!({
                    "injected": faults.len(),
                    "covered": Report::covered(&faults),
                    "skipped": self.skipped.contains(&kind),
                    "lease_moved": moved.len(),
                    "stalled": faults.iter().filter(|f| f.stalled).count(),
                    "resumed_ms": stats_json(&resumed),
                    "moved_ms": stats_json(&moved),
                });
                if kind == FaultKind::Backend {
                    entry["sessions_terminated"] = json!(sessions);
                }
                (kind.name().to_owned(), entry)
            })
            .collect();
        json!({
            "seed": self.seed,
            "duration_s": self.duration.as_secs_f64(),
            "holders": self.holders,
            "ttl_s": self.ttl.as_secs_f64(),
            "table": self.table,
            "acquisitions": self.acquisitions.len(),
            "epochs": self.acquisitions.iter().map(|(_, e)| *e).collect::<Vec<_>>(),
            "writes_acknowledged": self.acks.len(),
            "rows": self.rows,
            "rows_without_ack": self.unacked_rows,
            "snapshots": self.snapshots,
            "observer_errors": self.observer_errors,
            "faults": faults,
            "handoff_ms": stats_json(&self.latencies(&[FaultKind::Term])),
            "takeover_ms": stats_json(&self.latencies(&[
                FaultKind::Stop, FaultKind::Kill, FaultKind::Backend, FaultKind::Cut,
            ])),
            "notes": self.notes,
            "coverage": { "ok": self.coverage_gaps().is_empty(), "gaps": self.coverage_gaps() },
            "violations": self.violations.iter().map(|v| json!({
                "kind": v.kind,
                "detail": v.detail,
            })).collect::<Vec<_>>(),
        })
    }
}

/// Median and 99th percentile, nearest rank.
fn median_p99(values: &[Duration]) -> Option<(Duration, Duration)> {
    let mut sorted = values.to_vec();
    sorted.sort();
    let rank =
        |p: f64| sorted[((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
    (!sorted.is_empty()).then(|| (rank(0.5), rank(0.99)))
}

fn percentiles(values: &[Duration]) -> String {
    match median_p99(values) {
        Some((median, p99)) => format!("{} / {} (n = {})", human(median), human(p99), values.len()),
        None => "-".to_owned(),
    }
}

fn stats_json(values: &[Duration]) -> Value {
    match median_p99(values) {
        Some((median, p99)) => json!({
            "n": values.len(),
            "median": median.as_millis() as u64,
            "p99": p99.as_millis() as u64,
        }),
        None => json!({ "n": 0 }),
    }
}

/// `850 ms` or `3.2 s`.
pub(super) fn human(duration: Duration) -> String {
    if duration < Duration::from_secs(1) {
        format!("{} ms", duration.as_millis())
    } else {
        format!("{:.1} s", duration.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let ms = |v: &[u64]| v.iter().map(|m| Duration::from_millis(*m)).collect::<Vec<_>>();
        assert_eq!(median_p99(&ms(&[])), None);
        let one = Duration::from_millis(7);
        assert_eq!(median_p99(&ms(&[7])), Some((one, one)));
        let values: Vec<u64> = (1..=100).rev().collect();
        let (median, p99) = median_p99(&ms(&values)).unwrap();
        assert_eq!((median.as_millis(), p99.as_millis()), (50, 99));
    }

    #[test]
    fn durations_parse_with_units() {
        let secs = |s| crate::parse_secs(s).map(|d| d.as_secs_f64());
        assert_eq!(secs("90"), Ok(90.0));
        assert_eq!(secs("90s"), Ok(90.0));
        assert_eq!(secs("1.5s"), Ok(1.5));
        assert_eq!(secs("250ms"), Ok(0.25));
        assert_eq!(secs("5m"), Ok(300.0));
        assert_eq!(secs("1h"), Ok(3600.0));
        assert!(secs("5x").is_err() && secs("-1s").is_err() && secs("s").is_err());
        let ms = |s| crate::parse_interval(s).map(|d| d.as_millis());
        assert_eq!(ms("20"), Ok(20));
        assert_eq!(ms("1s"), Ok(1000));
        assert!(ms("0").is_err() && ms("0.5ms").is_err());
    }

    /// A run is enough only when every kind asked for was injected and writes resumed after
    /// it; a kind impossible here does not count against it.
    #[test]
    fn coverage_counts_each_kind_with_an_outcome() {
        let mut report = Report::new(1, Duration::from_secs(30), 3, Duration::from_secs(2), "t", 1);
        report.kinds = vec![FaultKind::Stop, FaultKind::Term, FaultKind::Cut];
        let gaps = report.coverage_gaps();
        assert_eq!(gaps.len(), 5, "no writes, no snapshots, three kinds never injected: {gaps:?}");
        report.acked("k".to_owned(), 2, Duration::from_secs(1), Duration::from_secs(1));
        report.snapshots = 10;
        report.faults.push(Injected::new(FaultKind::Stop, Duration::from_secs(2), 2));
        report.faults.push(Injected::new(FaultKind::Term, Duration::from_secs(9), 3));
        // Writes of a new epoch after the stop: it resumed. The term has no outcome yet.
        report.faults[1].resumed = None;
        report.faults[0].resumed = Some(Duration::from_secs(3));
        report.skipped = vec![FaultKind::Cut];
        assert_eq!(
            report.coverage_gaps(),
            ["term injected, but writes had not resumed by the end"]
        );
        report.faults[1].stalled = true;
        assert!(report.coverage_gaps().is_empty());
        let json = report.json();
        assert_eq!(json["coverage"]["ok"], true);
        assert_eq!(json["faults"]["cut"]["skipped"], true);
        assert_eq!(json["faults"]["term"]["covered"], true);
        assert!(report.text().contains("coverage: every fault kind"), "{}", report.text());
    }
}
