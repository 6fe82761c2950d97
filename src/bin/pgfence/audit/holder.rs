//! `pgfence audit-holder` (hidden): one holder process of an audit.
//!
//! It stands by for the lease, then writes a new key every few milliseconds until told to stop.
//! It prints one JSON line per lease event and per acknowledged write on stdout, which the
//! auditor reads. An acknowledgement is printed only after `write` returned `Ok`, so every key
//! it names must be in the table at the end.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;
use pgfence::{LeaseLossPolicy, LeaseState, PgKvStore};
use serde_json::{Value, json};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

use super::{NAMESPACE, SUB_NAMESPACE, mono};
use crate::exit::{Exit, chain};
use crate::target::{Target, quote_table};

/// The hidden `audit-holder` subcommand's arguments; only `audit` passes them.
#[derive(Debug, Args)]
pub(crate) struct HolderArgs {
    /// Lease TTL in seconds.
    #[arg(long, value_name = "SECS", value_parser = crate::parse_secs)]
    ttl: Duration,
    /// Writes a new key every MS milliseconds.
    #[arg(long, value_name = "MS")]
    write_every: u64,
    /// The connections' application_name, by which the auditor finds their backends.
    #[arg(long, value_name = "NAME")]
    name: String,
    /// Connect through the auditor's proxy at this address instead.
    #[arg(long, value_name = "ADDR")]
    proxy: Option<SocketAddr>,
    /// Write with a plain upsert, without the fence, and go on after losing the lease.
    #[arg(long)]
    unfenced: bool,
}

/// The unfenced write of `--unfenced`: the same row the store writes, without the lease check.
/// It is what a store without a fence does, so the audit can be shown to catch it.
const UNFENCED_WRITE: &str = "INSERT INTO {kv} (primary_namespace, secondary_namespace, key, \
     value, epoch) VALUES ($1, $2, $3, $4, $5) ON CONFLICT (primary_namespace, \
     secondary_namespace, key) DO UPDATE SET value = EXCLUDED.value, epoch = EXCLUDED.epoch";

/// One JSON line on stdout. A closed stdout (the auditor gone) is noticed on stdin instead.
fn emit(event: Value) {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{event}").and_then(|()| out.flush());
}

/// [`mono`] in nanoseconds, as the holder's lines carry it.
fn mono_ns() -> u64 {
    mono().as_nanos() as u64
}

/// How the write loop ended.
enum Ended {
    Stopped,
    Lost,
}

pub(crate) async fn holder(target: Target, args: HolderArgs) -> Result<(), Exit> {
    let stop = stop_signal()?;
    let target = holder_target(target, &args);
    let mut builder = PgKvStore::builder_from_config(target.config.clone())
        .table(&target.table)
        .pool_size(2)
        .pool_mode(target.pool_mode)
        .lease_ttl(args.ttl)
        .connect_timeout(target.connect_timeout)
        .on_lease_lost(LeaseLossPolicy::FailClosed);
    if let Some(tls) = &target.tls {
        builder = builder.tls(tls.clone());
    }
    let stopped = {
        let mut stop = stop.clone();
        async move {
            let _ = stop.wait_for(|s| *s).await;
        }
    };
    let Some(store) = builder.standby().open_until(stopped).await? else { return Ok(()) };
    let epoch = store.fencing_token();
    emit(json!({ "event": "acquired", "epoch": epoch, "at_ns": mono_ns() }));
    let ended = write_loop(&store, &target, &args, stop).await;
    match ended {
        Ended::Stopped => {
            let closed = store.close().await;
            if args.unfenced {
                // Its lease may be long gone: that is the point of the mode.
                return Ok(());
            }
            closed?;
            emit(json!({ "event": "released", "epoch": epoch }));
            Ok(())
        }
        Ended::Lost => {
            emit(json!({ "event": "lost", "epoch": epoch }));
            // The release is a no-op by owner id: bounded, so it cannot hold up the exit.
            let _ = tokio::time::timeout(Duration::from_secs(5), store.close()).await;
            Err(Exit { code: 5, message: format!("lease lost (epoch {epoch})") })
        }
    }
}

/// Writes `e<epoch>-p<pid>-<n>` (its own name as value) every `write_every` ms, one at a time.
/// A stop request lets the write in flight finish first, so a release follows the last write.
async fn write_loop(
    store: &PgKvStore,
    target: &Target,
    args: &HolderArgs,
    mut stop: watch::Receiver<bool>,
) -> Ended {
    let epoch = store.fencing_token();
    let pid = std::process::id();
    let mut state = store.lease_state();
    let mut plain: Option<tokio_postgres::Client> = None;
    let unfenced_write = UNFENCED_WRITE.replace("{kv}", &quote_table(&target.table, ""));
    let mut ticks = tokio::time::interval(Duration::from_millis(args.write_every));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    for n in 0u64.. {
        tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => return Ended::Stopped,
            _ = state.wait_for(|s| matches!(s, LeaseState::Lost { .. })), if !args.unfenced => {
                return Ended::Lost;
            }
            _ = ticks.tick() => {}
        }
        let key = format!("e{epoch}-p{pid}-{n}");
        let started = mono_ns();
        let written = if args.unfenced {
            unfenced(&mut plain, target, &unfenced_write, &key, epoch).await
        } else {
            match store.write(NAMESPACE, SUB_NAMESPACE, &key, key.clone().into_bytes()).await {
                Ok(()) => Ok(()),
                Err(e) if e.is_lease_lost() => return Ended::Lost,
                Err(e) => Err(chain(&e)),
            }
        };
        match written {
            Ok(()) => emit(json!({
                "event": "ack",
                "key": key,
                "epoch": epoch,
                "started_ns": started,
                "done_ns": mono_ns(),
            })),
            // Outcome unknown: the key may or may not be there; it is never acknowledged.
            Err(e) => {
                let _ = writeln!(io::stderr(), "pgfence: audit write {key} failed: {e}");
            }
        }
    }
    Ended::Stopped
}

/// The `--unfenced` write, on a plain connection of its own, opened again after an error.
async fn unfenced(
    plain: &mut Option<tokio_postgres::Client>,
    target: &Target,
    sql: &str,
    key: &str,
    epoch: i64,
) -> Result<(), String> {
    if plain.as_ref().is_none_or(|c| c.is_closed()) {
        *plain = match target.connect().await {
            Ok(client) => Some(client),
            Err(_) => return Err("cannot connect".to_owned()),
        };
    }
    let client = plain.as_ref().ok_or("no connection")?;
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
        [&NAMESPACE, &SUB_NAMESPACE, &key, &key.as_bytes(), &epoch];
    client.execute(sql, &params).await.map(|_| ()).map_err(|e| chain(&e))
}

/// Where the holder connects: the user's server (or the auditor's proxy in front of it), under
/// its own application_name.
fn holder_target(mut target: Target, args: &HolderArgs) -> Target {
    if let Some(proxy) = args.proxy {
        // Only the address changes: the proxy forwards bytes, so user, password and database
        // are the server's. The auditor uses the proxy only without TLS.
        let mut config = tokio_postgres::Config::new();
        if let Some(user) = target.config.get_user() {
            config.user(user);
        }
        if let Some(password) = target.config.get_password() {
            config.password(password);
        }
        if let Some(dbname) = target.config.get_dbname() {
            config.dbname(dbname);
        }
        if let Some(options) = target.config.get_options() {
            config.options(options);
        }
        config.host(proxy.ip().to_string()).port(proxy.port());
        target.config = config;
        target.tls = None;
    }
    target.config.application_name(&args.name);
    target
}

/// Becomes true on SIGINT, SIGTERM or the end of stdin. The auditor holds the other end of
/// stdin: if it dies, even by SIGKILL, its holders stop and release rather than write on.
fn stop_signal() -> Result<watch::Receiver<bool>, Exit> {
    let install = |kind| signal(kind).map_err(|e| Exit::other("cannot install signal handler", &e));
    let (mut interrupt, mut terminate) =
        (install(SignalKind::interrupt())?, install(SignalKind::terminate())?);
    let (sender, receiver) = watch::channel(false);
    let (closed_sender, stdin_closed) = tokio::sync::oneshot::channel::<()>();
    // A plain thread: it blocks on stdin, which nothing else reads.
    std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        while let Ok(1..) = io::stdin().read(&mut buf) {}
        let _ = closed_sender.send(());
    });
    tokio::spawn(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
            _ = stdin_closed => {}
        }
        let _ = sender.send(true);
    });
    Ok(receiver)
}
