//! The observer: the audit's commit-order check, from the data alone.
//!
//! It polls the audit table on a connection of its own. Each poll is one statement, so one
//! snapshot: the lease row's epoch and how many rows each epoch has. The fence makes every
//! write of epoch E commit before the takeover to E+1 commits. Any snapshot that shows a row of
//! a later epoch therefore already shows every row of E there will ever be.
//!
//! So a row of epoch E first seen after a snapshot that showed a later epoch's row committed
//! after it: a violation. No server setting is needed (no `track_commit_timestamp`, no logical
//! decoding), only snapshots taken one after another.
//!
//! What it cannot see: a late row and the later epoch's first row that both commit between two
//! polls look simultaneous. So the check's resolution is the poll interval. A late write of a
//! holder paused for longer than that (the case fencing exists for) is caught.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::sync::watch;

use super::{NAMESPACE, SUB_NAMESPACE, Violation};
use crate::target::{Target, quote_table};

/// One snapshot: the lease row's epoch and, per epoch, the audit rows of that epoch.
const SNAPSHOT: &str = "SELECT l.epoch, k.epoch, k.n FROM {lease} l LEFT JOIN (SELECT epoch, \
     count(*) AS n FROM {kv} WHERE primary_namespace = $1 AND secondary_namespace = $2 GROUP BY \
     epoch) k ON true WHERE l.id = 1";

/// What the observer saw.
#[derive(Debug, Default)]
pub(super) struct Observed {
    pub(super) snapshots: u64,
    pub(super) errors: u64,
    /// The final snapshot failed: late rows after the last one went unchecked.
    pub(super) errors_at_end: bool,
    pub(super) violations: Vec<Violation>,
}

/// What earlier snapshots showed.
#[derive(Default)]
struct Seen {
    lease_epoch: i64,
    /// Rows per epoch in the last snapshot.
    rows: BTreeMap<i64, i64>,
    /// Late rows by (their epoch, the later epoch already visible): one finding each, however
    /// many rows and snapshots it spans.
    late: BTreeMap<(i64, i64), i64>,
}

impl Seen {
    /// Checks one snapshot against the earlier ones, then remembers it.
    fn check(&mut self, lease_epoch: i64, rows: BTreeMap<i64, i64>, found: &mut Vec<Violation>) {
        if lease_epoch < self.lease_epoch {
            found.push(Violation::new(
                "epoch_order",
                format!("the lease epoch went back from {} to {lease_epoch}", self.lease_epoch),
            ));
        }
        let latest_before = self.rows.keys().next_back().copied();
        for (&epoch, &n) in &rows {
            let before = self.rows.get(&epoch).copied().unwrap_or(0);
            if n < before {
                found.push(Violation::new(
                    "lost_write",
                    format!("{} committed row(s) of epoch {epoch} disappeared", before - n),
                ));
            }
            if epoch > lease_epoch {
                found.push(Violation::new(
                    "epoch_order",
                    format!(
                        "rows of epoch {epoch} visible while the lease is at epoch {lease_epoch}"
                    ),
                ));
            }
            if let Some(latest) = latest_before.filter(|latest| *latest > epoch && n > before) {
                *self.late.entry((epoch, latest)).or_default() += n - before;
            }
        }
        for (&epoch, &before) in &self.rows {
            if !rows.contains_key(&epoch) {
                found.push(Violation::new(
                    "lost_write",
                    format!("all {before} committed row(s) of epoch {epoch} disappeared"),
                ));
            }
        }
        self.lease_epoch = self.lease_epoch.max(lease_epoch);
        self.rows = rows;
    }

    /// The late rows, as findings.
    fn late_writes(&self) -> impl Iterator<Item = Violation> + '_ {
        self.late.iter().map(|((epoch, latest), n)| {
            Violation::new(
                "late_write",
                format!("{n} row(s) of epoch {epoch} committed after rows of epoch {latest} were visible"),
            )
        })
    }
}

/// Polls every `every` until `stop`, then once more: by then the holders are gone, so the last
/// snapshot shows every row that will ever commit.
pub(super) async fn observe(
    target: Target,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) -> Observed {
    let sql = SNAPSHOT
        .replace("{lease}", &quote_table(&target.table, "_lease"))
        .replace("{kv}", &quote_table(&target.table, ""));
    let mut observed = Observed::default();
    let mut seen = Seen::default();
    let mut client: Option<tokio_postgres::Client> = None;
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut last = false;
    let mut final_tries = 0;
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s), if !last => last = true,
            _ = ticks.tick() => {}
        }
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = target.connect().await.ok();
        }
        let polled = match &client {
            Some(client) => client.query(&sql, &[&NAMESPACE, &SUB_NAMESPACE]).await.ok(),
            None => None,
        };
        match polled {
            Some(rows) => {
                observed.snapshots += 1;
                let lease_epoch = rows.first().map_or(0, |row| row.get::<_, i64>(0));
                let counts = rows
                    .iter()
                    .filter_map(|row| Some((row.get::<_, Option<i64>>(1)?, row.get::<_, i64>(2))))
                    .collect();
                seen.check(lease_epoch, counts, &mut observed.violations);
            }
            // A gap in the polls is only a coarser window, never a false finding: snapshots
            // stay in order across connections.
            None => {
                observed.errors += 1;
                client = None;
                if last {
                    // The final snapshot is needed: try again for a while.
                    final_tries += 1;
                    if final_tries > 100 {
                        observed.violations.extend(seen.late_writes());
                        observed.errors_at_end = true;
                        return observed;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            }
        }
        if last {
            observed.violations.extend(seen.late_writes());
            return observed;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(seen: &mut Seen, lease: i64, rows: &[(i64, i64)]) -> Vec<&'static str> {
        let mut found = Vec::new();
        let late = seen.late.len();
        seen.check(lease, rows.iter().copied().collect(), &mut found);
        let mut kinds: Vec<&'static str> = found.iter().map(|v| v.kind).collect();
        if seen.late.len() > late {
            kinds.push("late_write");
        }
        kinds
    }

    #[test]
    fn snapshots_in_fence_order_pass_and_a_late_row_does_not() {
        let mut seen = Seen::default();
        assert!(kinds(&mut seen, 2, &[(2, 5)]).is_empty());
        assert!(kinds(&mut seen, 3, &[(2, 7)]).is_empty());
        assert!(kinds(&mut seen, 3, &[(2, 7), (3, 1)]).is_empty());
        assert_eq!(kinds(&mut seen, 3, &[(2, 8), (3, 4)]), ["late_write"]);
        assert_eq!(kinds(&mut seen, 3, &[(3, 4)]), ["lost_write"]);
        assert_eq!(kinds(&mut seen, 2, &[(3, 4)]), ["epoch_order", "epoch_order"]);
    }
}
