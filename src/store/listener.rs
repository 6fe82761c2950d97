//! One LISTEN connection for many standbys: it listens on every subscribed table's channel and
//! passes each notification on to that channel's subscribers.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;

use crate::connect::{AbortOnDrop, Tls};
use crate::keys::TableName;
use crate::sql;

/// The target of this module's log events: the standbys' (see docs/design.md, "Logging").
const LOG: &str = "pgfence::standby";

/// How long the listener waits before it connects again after its connection failed or ended.
/// Its subscribers poll meanwhile, at about the same pace.
const RECONNECT_AFTER: Duration = Duration::from_secs(1);

/// A LISTEN connection that standbys share. It is started by the first subscription, on that
/// subscriber's runtime, and stopped when the last handle is dropped.
///
/// The connection runs no statement while nothing changes. A connection silently dropped on
/// the way is found by its TCP keepalives ([`crate::Builder`]'s LISTEN configuration), which
/// cost the server no statement. The listener then reconnects and LISTENs on every channel
/// again. Every subscriber is told each time the connection goes or comes back. Notifications
/// may have been missed meanwhile, so it looks at its lease again.
pub(crate) struct Listener {
    shared: Arc<Shared>,
    config: tokio_postgres::Config,
    tls: Tls,
    /// Bounds each connect and each LISTEN or UNLISTEN. A connection that does not answer in
    /// time is replaced.
    timeout: Duration,
    task: Mutex<Option<JoinHandle<()>>>,
}

/// What the listener's task and the subscriptions share.
#[derive(Default)]
struct Shared {
    /// The subscribed tables, by [`TableName::display`].
    channels: Mutex<HashMap<String, Channel>>,
    /// Wakes the task when a subscription came or went.
    changed: Notify,
}

struct Channel {
    table: TableName,
    subscribers: usize,
    /// Whether the connection LISTENs on the channel. Every notification sends `true` again,
    /// which wakes the subscribers.
    heard: watch::Sender<bool>,
    /// The channel's name on the current connection, once it LISTENs there.
    listened: Option<String>,
}

impl Shared {
    fn channels(&self) -> std::sync::MutexGuard<'_, HashMap<String, Channel>> {
        // No code panics while holding it; a poisoned map is still consistent.
        self.channels.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The connection is gone: nothing is listened any more, and every subscriber is woken.
    fn lost(&self) {
        for channel in self.channels().values_mut() {
            channel.listened = None;
            channel.heard.send_replace(false);
        }
    }
}

impl Listener {
    /// A listener that connects with `config` (a LISTEN configuration: see
    /// `Builder::listen_config`). It connects when first subscribed to.
    pub(crate) fn new(config: tokio_postgres::Config, tls: Tls, timeout: Duration) -> Listener {
        Listener { shared: Arc::default(), config, tls, timeout, task: Mutex::new(None) }
    }

    /// Subscribes to the channel of `table`. The subscription wakes on every notification of
    /// that channel, and whenever the connection goes or comes back. Needs a tokio runtime: the
    /// first subscription starts the listener's task on it.
    pub(crate) fn subscribe(self: &Arc<Self>, table: &TableName) -> Subscription {
        let key = table.display();
        let heard = {
            let mut channels = self.shared.channels();
            let channel = channels.entry(key.clone()).or_insert_with(|| Channel {
                table: table.clone(),
                subscribers: 0,
                heard: watch::Sender::new(false),
                listened: None,
            });
            channel.subscribers += 1;
            channel.heard.subscribe()
        };
        let mut task = self.task.lock().unwrap_or_else(PoisonError::into_inner);
        // Finished only if the runtime it ran on shut down: start it again on this one.
        if task.as_ref().is_none_or(JoinHandle::is_finished) {
            self.shared.lost();
            let run =
                run(Arc::clone(&self.shared), self.config.clone(), self.tls.clone(), self.timeout);
            *task = Some(tokio::spawn(run));
        }
        self.shared.changed.notify_one();
        Subscription { listener: Arc::clone(self), key, heard }
    }

    /// How many channels the listener LISTENs on now (for tests).
    #[cfg(test)]
    pub(crate) fn listened(&self) -> usize {
        self.shared.channels().values().filter(|c| c.listened.is_some()).count()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(task) = self.task.get_mut().unwrap_or_else(PoisonError::into_inner).take() {
            task.abort();
        }
    }
}

impl fmt::Debug for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let channels = self.shared.channels();
        f.debug_struct("Listener")
            .field("servers", &crate::connect::servers(&self.config))
            .field("channels", &channels.len())
            .finish_non_exhaustive()
    }
}

/// A standby's subscription to its table's channel. Dropping it UNLISTENs once no other
/// subscription wants the channel.
pub(crate) struct Subscription {
    listener: Arc<Listener>,
    key: String,
    heard: watch::Receiver<bool>,
}

impl Subscription {
    /// Whether a notification on the channel reaches this subscription now. Marks everything
    /// so far as seen: [`Subscription::changed`] then waits for what comes after.
    pub(crate) fn listening(&mut self) -> bool {
        *self.heard.borrow_and_update()
    }

    /// Waits for a notification, or for the connection to go or come back, since last seen.
    pub(crate) async fn changed(&mut self) {
        if self.heard.changed().await.is_err() {
            // The channel's entry outlives every subscription; never here. Wait for good, so
            // that the caller's own bound decides.
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut channels = self.listener.shared.channels();
        if let Some(channel) = channels.get_mut(&self.key) {
            channel.subscribers -= 1;
        }
        drop(channels);
        self.listener.shared.changed.notify_one();
    }
}

/// The listener's task: connects, LISTENs on every subscribed channel, passes notifications
/// on, and follows subscriptions as they come and go. Reconnects after a failure, for as long
/// as the listener exists.
async fn run(shared: Arc<Shared>, config: tokio_postgres::Config, tls: Tls, timeout: Duration) {
    loop {
        let (tx, mut notified) = mpsc::unbounded_channel();
        let connecting = tls.connect(&config, "standby LISTEN", Some(tx));
        match tokio::time::timeout(timeout, connecting).await {
            Ok(Ok((client, task))) => {
                let _task = AbortOnDrop(Some(task));
                serve(&shared, &client, &mut notified, timeout).await;
            }
            Ok(Err(e)) => {
                tracing::warn!(target: LOG, error = %e, "pgfence standby cannot LISTEN; polling");
            }
            Err(_) => {
                tracing::warn!(target: LOG, "pgfence standby LISTEN connection timed out; polling");
            }
        }
        shared.lost();
        tokio::time::sleep(RECONNECT_AFTER).await;
    }
}

/// Serves one connection until it ends or stops answering.
async fn serve(
    shared: &Shared,
    client: &tokio_postgres::Client,
    notified: &mut mpsc::UnboundedReceiver<String>,
    timeout: Duration,
) {
    // The schema an unqualified table name resolves to, as the store's sessions resolve it
    // (`sql::TABLE_SCHEMA`). Asked once per connection: the names of all channels follow.
    let asked = client.query_one(sql::TABLE_SCHEMA, &[&None::<String>]);
    let current = match tokio::time::timeout(timeout, asked).await {
        Ok(Ok(row)) => row.get::<_, Option<String>>(0),
        Ok(Err(e)) => {
            tracing::warn!(target: LOG, error = %e, "pgfence standby LISTEN connection failed");
            return;
        }
        Err(_) => return,
    };
    loop {
        match tokio::time::timeout(timeout, follow(shared, client, current.as_deref())).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(target: LOG, error = %e, "pgfence standby LISTEN failed; reconnecting");
                return;
            }
            Err(_) => {
                tracing::warn!(
                    target: LOG,
                    "pgfence standby LISTEN connection stopped answering; reconnecting");
                return;
            }
        }
        tokio::select! {
            heard = notified.recv() => {
                // `None`: the connection ended (closed, or its keepalives went unanswered).
                let Some(heard) = heard else { return };
                for channel in shared.channels().values() {
                    if channel.listened.as_deref() == Some(heard.as_str()) {
                        channel.heard.send_replace(true);
                    }
                }
            }
            () = shared.changed.notified() => {}
        }
    }
}

/// LISTENs on the channels of new subscriptions and UNLISTENs those nobody wants any more. One
/// round trip for each, and none when nothing changed.
async fn follow(
    shared: &Shared,
    client: &tokio_postgres::Client,
    schema: Option<&str>,
) -> Result<(), tokio_postgres::Error> {
    let name = |table: &TableName| sql::notify_channel(table, table.schema.as_deref().or(schema));
    let (listen, unlisten) = {
        let mut channels = shared.channels();
        let mut unlisten: Vec<String> = Vec::new();
        channels.retain(|_, channel| {
            if channel.subscribers > 0 {
                return true;
            }
            unlisten.extend(channel.listened.take());
            false
        });
        // Two spellings of one table share a channel: it stays while either is wanted.
        unlisten.retain(|gone| !channels.values().any(|c| c.listened.as_ref() == Some(gone)));
        let listen: Vec<(String, String)> = channels
            .iter()
            .filter(|(_, channel)| channel.listened.is_none())
            .map(|(key, channel)| (key.clone(), name(&channel.table)))
            .collect();
        (listen, unlisten)
    };
    if !unlisten.is_empty() {
        let statements: Vec<String> =
            unlisten.iter().map(|c| format!("UNLISTEN \"{c}\"")).collect();
        client.batch_execute(&statements.join("; ")).await?;
    }
    if !listen.is_empty() {
        let statements: Vec<String> =
            listen.iter().map(|(_, c)| format!("LISTEN \"{c}\"")).collect();
        client.batch_execute(&statements.join("; ")).await?;
        let mut channels = shared.channels();
        for (key, listened) in listen {
            // Entries go only above, in this task: each is still there.
            if let Some(channel) = channels.get_mut(&key) {
                channel.listened = Some(listened);
                channel.heard.send_replace(true);
            }
        }
    }
    Ok(())
}

/// Tests that need the listener's internals and a database.
#[cfg(test)]
mod db_tests {
    use super::*;

    use pgfence_testing::{TestServer, unique_name};

    /// `subscription` is woken within a few seconds; returns whether it is listening then.
    async fn woken(subscription: &mut Subscription) -> bool {
        let woken = tokio::time::timeout(Duration::from_secs(10), subscription.changed()).await;
        assert!(woken.is_ok(), "woken");
        subscription.listening()
    }

    /// `subscription` stays asleep for a while.
    async fn asleep(subscription: &mut Subscription) {
        let woken = tokio::time::timeout(Duration::from_millis(300), subscription.changed()).await;
        assert!(woken.is_err(), "not woken");
    }

    /// One connection LISTENs for two tables: each notification wakes only its table's
    /// subscribers. A dropped subscription UNLISTENs once its table has no other. A connection
    /// ended by the server wakes every subscriber, not listening; the listener reconnects and
    /// LISTENs on every channel again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_connection_dispatches_per_channel_and_listens_again_after_a_reconnect() {
        let server = TestServer::shared().unwrap();
        let app = unique_name("listener");
        let mut config = server.config();
        config.application_name(&app);
        let listener = Arc::new(Listener::new(config, Tls::default(), Duration::from_secs(5)));
        let (a, b) = (unique_name("lsa"), unique_name("lsb"));
        let (a, b) = (TableName::parse(&a).unwrap(), TableName::parse(&b).unwrap());
        let mut a1 = listener.subscribe(&a);
        let mut a2 = listener.subscribe(&a);
        let mut b1 = listener.subscribe(&b);
        for subscription in [&mut a1, &mut a2, &mut b1] {
            while !subscription.listening() {
                woken(subscription).await;
            }
        }
        assert_eq!(listener.listened(), 2);
        let admin = server.connect().await.unwrap();
        let notify = |table: &TableName| format!("NOTIFY \"{}\"", sql::notify_channel(table, None));
        let sessions = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1";
        let connections: i64 = admin.query_one(sessions, &[&app]).await.unwrap().get(0);
        assert_eq!(connections, 1, "one connection for all");

        admin.batch_execute(&notify(&a)).await.unwrap();
        assert!(woken(&mut a1).await && woken(&mut a2).await);
        asleep(&mut b1).await;
        admin.batch_execute(&notify(&b)).await.unwrap();
        assert!(woken(&mut b1).await);
        asleep(&mut a1).await;

        drop(b1);
        let unlistened = async {
            while listener.listened() != 1 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), unlistened).await.expect("UNLISTEN");
        drop(a2);
        asleep(&mut a1).await;
        assert_eq!(listener.listened(), 1, "still wanted by a1");

        let kill = "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                     WHERE application_name = $1";
        let killed: i64 = admin.query_one(kill, &[&app]).await.unwrap().get(0);
        assert_eq!(killed, 1);
        assert!(!woken(&mut a1).await, "told that notifications may have been missed");
        assert!(woken(&mut a1).await, "listening again after the reconnect");
        admin.batch_execute(&notify(&a)).await.unwrap();
        assert!(woken(&mut a1).await);
    }
}
