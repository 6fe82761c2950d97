//! A real network partition: the store runs in a network namespace of its own, which reaches
//! the server's side only through a router (a second namespace), and a cut makes the router
//! discard every packet both ways without telling anyone. Nothing answers and no reset
//! arrives; TCP keeps retransmitting, as when a link between two subnets fails or a firewall
//! drops the traffic. (The proxy of the other tests closes its sockets or holds data back in
//! user space, where the kernel has already acknowledged it.)
//!
//! Needs root (creating a network namespace needs `CAP_NET_ADMIN`; CI runs as root),
//! iproute2's `ip` and `ss`, and util-linux's `nsenter`. As another user these tests fail,
//! saying so; to leave them out, run `cargo test --all-features -- --skip partitioned_`.
//!
//! Each test's store runs on a runtime whose threads are in the far namespace (threads they
//! start, such as the renewal thread, inherit it). It reaches the server through a proxy
//! listening on this side of the router, so the server itself stays on loopback, as every
//! other test has it. The namespaces and their links are deleted when the test ends, panics
//! included.

mod common;

use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{HANG_GUARD, admin, server, table, within};
use pgfence::{Error, LeaseState, LossReason, PgKvStore, StandbyState};
use pgfence_testing::Proxy;
use tokio::runtime::Runtime;

const TTL: Duration = Duration::from_secs(2);

/// Every connection gets a TCP user timeout of one TTL unless the caller set one (docs/design.md,
/// "A partition"), "so a partition fails a statement instead of hanging it for many minutes".
/// Behind a real partition the kernel ends a pooled connection with a query in flight no
/// sooner than one TTL after the query was sent, and the query fails with the connection
/// closed (without the default it waits for minutes). The same query on a connection whose
/// configuration sets a user timeout of its own (ten minutes) is still waiting then, and is
/// answered once the network heals.
///
/// An inspector is used because its queries have no deadline of their own: a store holding
/// the lease gives up on a statement at the local deadline, before any TCP timeout, and then
/// relies on the same timeout to close the abandoned connection.
#[test]
fn partitioned_connection_fails_after_the_tcp_user_timeout_unless_one_is_set() {
    let net = Network::create();
    let far = net.runtime();
    near().block_on(async {
        let proxy = net.proxy().await;
        let t = table("partuto");
        common::open(&t).await.close().await.unwrap();
        let mut patient_config = server().config_via(proxy.addr());
        patient_config.tcp_user_timeout(Duration::from_secs(600));
        let inspectors = [server().config_via(proxy.addr()), patient_config].map(|config| {
            let t = t.clone();
            far.spawn(async move {
                let builder = PgKvStore::builder_from_config(config).table(t).lease_ttl(TTL);
                let inspector = builder.inspect().await.unwrap();
                // Connected and answered through the far side before the cut.
                assert!(inspector.lease_info().await.unwrap().is_some());
                inspector
            })
        });
        let [default, patient] = inspectors;
        let default = within("inspector", default).await.unwrap();
        let patient = within("inspector", patient).await.unwrap();

        net.cut();
        let sent = Instant::now();
        let default = far.spawn(async move { default.lease_info().await.map(|_| ()) });
        let patient = far.spawn(async move { patient.lease_info().await.map(|_| ()) });
        let result = within("query behind the partition", default).await.unwrap();
        let failed_after = sent.elapsed();
        println!("the query failed {failed_after:?} after it was sent (TTL {TTL:?})");
        // The kernel gave up on the connection (nothing else can end it: no reset crosses the
        // partition), and the client reports the connection closed under the query.
        let e = result.expect_err("no answer can cross the partition");
        assert!(matches!(&e, Error::Database { source, .. } if source.is_closed()), "{e:?}");
        assert!(failed_after >= TTL, "not before the user timeout of one TTL: {failed_after:?}");
        assert!(!patient.is_finished(), "a user timeout set by the caller is kept");

        net.heal();
        within("the patient query once the network heals", patient).await.unwrap().unwrap();
    });
}

/// A partitioned holder's write that reaches the server only after a successor took over does
/// not commit (docs/design.md, "Fencing": "a paused, partitioned or slow former owner can never
/// commit after a successor took over").
///
/// The holder writes once, then the network is cut and it writes again: the statement is in
/// its socket's send queue, retransmitted by the kernel and dropped. The holder's caller gets
/// `LeaseLost` (`DeadlinePassed`) at the local deadline; a standby on the server's side of the
/// network takes the lease once it expires and writes the same key. Then the network heals
/// and the kernel delivers the old statement, which runs (a statement-level trigger on the KV
/// table records each statement that reaches the insert, by server process) and writes nothing.
///
/// The holder's connections set a user timeout longer than the partition, so the statement is
/// still alive to be delivered. With the default of one TTL the window is shorter (the socket
/// gives up one TTL after the write was sent, and the lease expires within one TTL of the last
/// renewal before it), but a statement can still arrive after a takeover.
#[test]
fn partitioned_holder_s_write_delivered_after_a_takeover_does_not_commit() {
    let net = Network::create();
    let far = net.runtime();
    near().block_on(async {
        let proxy = net.proxy().await;
        let t = table("partlate");
        let mut config = server().config_via(proxy.addr());
        config.tcp_user_timeout(Duration::from_secs(600));
        // One pooled connection: the second write goes out on the connection that has the
        // statement prepared, so the statement itself (not its preparation) is what waits.
        let opening = PgKvStore::builder_from_config(config)
            .table(&t)
            .lease_ttl(TTL)
            .pool_size(1)
            .write_concurrency(1)
            .application_name(format!("holder-{t}"))
            .open();
        let holder = within("holder opens", far.spawn(opening)).await.unwrap().unwrap();
        let admin = admin().await;
        let log = format!("\"{t}_statements\"");
        admin
            .batch_execute(&format!(
                "CREATE TABLE {log} (pid INT NOT NULL, at TIMESTAMPTZ NOT NULL);
                 CREATE FUNCTION {log}() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN
                     INSERT INTO {log} VALUES (pg_backend_pid(), clock_timestamp());
                     RETURN NULL;
                 END $$;
                 CREATE TRIGGER {log} AFTER INSERT ON \"{t}\"
                     FOR EACH STATEMENT EXECUTE FUNCTION {log}();"
            ))
            .await
            .unwrap();
        let holder = far
            .spawn(async move {
                holder.write("p", "s", "k", b"before the cut".to_vec()).await.unwrap();
                holder
            })
            .await
            .unwrap();
        let holder_pid: i32 =
            admin.query_one(&format!("SELECT pid FROM {log}"), &[]).await.unwrap().get(0);

        net.cut();
        let late_write = far.spawn(async move {
            let result = holder.write("p", "s", "k", b"late".to_vec()).await;
            (result, holder)
        });
        let (result, holder) = within("the write behind the partition", late_write).await.unwrap();
        let e = result.expect_err("no answer can cross the partition");
        assert!(matches!(e, Error::LeaseLost { reason: LossReason::DeadlinePassed, .. }), "{e:?}");

        let successor = common::builder(&t).lease_ttl(TTL).renew_interval(TTL / 4).standby().open();
        let successor = within("the standby takes over", successor).await.unwrap();
        assert_eq!(successor.fencing_token(), 2);
        successor.write("p", "s", "k", b"successor".to_vec()).await.unwrap();

        net.heal();
        let delivered = format!("SELECT count(*) FROM {log} WHERE pid = $1");
        let deadline = Instant::now() + HANG_GUARD;
        while admin.query_one(&delivered, &[&holder_pid]).await.unwrap().get::<_, i64>(0) < 2 {
            assert!(Instant::now() < deadline, "the late write never reached the server");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let row = admin
            .query_one(&format!("SELECT value, epoch FROM \"{t}\" WHERE key = 'k'"), &[])
            .await
            .unwrap();
        assert_eq!(row.get::<_, Vec<u8>>(0), b"successor", "the late write wrote nothing");
        assert_eq!(row.get::<_, i64>(1), 2);
        assert_eq!(successor.read("p", "s", "k").await.unwrap(), b"successor");
        assert!(matches!(*holder.lease_state().borrow(), LeaseState::Lost { epoch: 1, .. }));
        successor.close().await.unwrap();
        far.spawn(async move { drop(holder) }).await.unwrap();
    });
}

/// A store cut off in the middle of `open()`'s setup transaction, after it took the table's
/// setup lock, leaves a server session idle in that transaction, waiting for a client whose
/// packets no longer arrive (the server notices a vanished client only through TCP keepalives,
/// after hours by default). That session holds the setup lock, which every `open()` of the
/// table takes: a failover would wait for it. The server ends it once it has been idle in
/// the transaction for one TTL (of the store that began it), so other stores open. The
/// cut-off store's `open()` fails as well, while the network is still cut (its connection,
/// waiting for an answer, heard nothing for a TTL and a keepalive probe went unanswered),
/// instead of waiting hours for the server's answer: it never holds a lease it did not commit.
#[test]
fn partitioned_setup_holds_up_other_opens_for_at_most_about_one_ttl() {
    let net = Network::create();
    let far = net.runtime();
    near().block_on(async {
        let proxy = net.proxy().await;
        let t = table("partsetup");
        common::open(&t).await.close().await.unwrap();
        let mut admin = admin().await;
        let tx = common::hold_setup_lock(&mut admin, &t).await;
        let app = format!("cut-{t}");
        let opening = far_builder(&proxy, &t).application_name(&app).open();
        let cut_off = far.spawn(opening);
        common::wait_for_app_lock_wait(&app).await;
        // Nothing of the store's unacknowledged when the cut comes (its statement's last bytes
        // may wait a moment for a delayed acknowledgement): only a keepalive can tell it then.
        net.wait_until_all_sent();
        net.cut();
        // The cut-off session takes the setup lock; its answer is lost on the way.
        tx.commit().await.unwrap();

        let started = Instant::now();
        let successor = common::builder(&t).lease_ttl(TTL).renew_interval(TTL / 4).open();
        let successor = within("another store opens", successor).await.unwrap();
        println!("another store opened after {:?} (TTL {TTL:?})", started.elapsed());
        assert_eq!(successor.fencing_token(), 2);
        common::wait_until_no_sessions(&app).await;

        // Still cut off, the store's own open() ends too: its connection heard nothing for a
        // TTL, and a keepalive probe went unanswered.
        let result = within("the cut-off open()", cut_off).await.unwrap();
        println!("the cut-off open() returned after {:?}: {result:?}", started.elapsed());
        let e = result.expect_err("the cut-off store never got its setup's answers");
        assert!(matches!(&e, Error::Database { source, .. } if source.is_closed()), "{e:?}");
        successor.close().await.unwrap();
    });
}

/// A holder cut off for good loses its lease at the local deadline, and its connections do not
/// linger: each ends within about a TTL of its last word from the server, even one idle in
/// the pool (a keepalive probe goes unanswered), so none stays open for hours holding a socket
/// and a task. (On the server's side each session ends when the server notices, as for any
/// vanished client.)
#[test]
fn partitioned_holder_s_connections_all_end_after_the_loss() {
    let net = Network::create();
    let far = net.runtime();
    near().block_on(async {
        let proxy = net.proxy().await;
        let t = table("partgone");
        let opening = far_builder(&proxy, &t).open();
        let holder = within("holder opens", far.spawn(opening)).await.unwrap().unwrap();
        let holder = far
            .spawn(async move {
                holder.write("p", "s", "k", b"v".to_vec()).await.unwrap();
                holder
            })
            .await
            .unwrap();
        // The renewal thread connects for its first renewal.
        let deadline = Instant::now() + HANG_GUARD;
        while net.established() < 2 {
            assert!(Instant::now() < deadline, "the renewal's and a pooled connection");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        net.wait_until_all_sent();
        net.cut();
        common::wait_until_lost(&holder).await;
        let lost = Instant::now();
        let deadline = lost + HANG_GUARD;
        while net.established() > 0 {
            assert!(Instant::now() < deadline, "connections left open: {}", net.established());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        println!("the last connection ended {:?} after the loss (TTL {TTL:?})", lost.elapsed());
        assert!(matches!(*holder.lease_state().borrow(), LeaseState::Lost { epoch: 1, .. }));
        far.spawn(async move { drop(holder) }).await.unwrap();
    });
}

/// A partition shorter than the local deadline costs nothing: writes sent during it are
/// delivered by TCP once it heals and acknowledged, the lease stays held throughout (renewals
/// that failed or waited are retried), and every acknowledged write is in the table.
#[test]
fn partitioned_briefly_the_holder_keeps_its_lease_and_every_write() {
    let net = Network::create();
    let far = net.runtime();
    near().block_on(async {
        let proxy = net.proxy().await;
        let t = table("partbrief");
        // A generous deadline (20 s) against a 3 s partition: TCP's retransmission backoff
        // delivers what waited within a few seconds of the heal.
        let opening = far_builder(&proxy, &t)
            .lease_ttl(Duration::from_secs(30))
            .renew_interval(Duration::from_secs(1))
            .open();
        let holder = within("holder opens", far.spawn(opening)).await.unwrap().unwrap();
        let mut state = holder.lease_state();
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..4)
            .map(|w| {
                let (holder, stop) = (holder.clone(), stop.clone());
                far.spawn(async move {
                    let key = format!("w{w}");
                    let mut acknowledged = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let next = acknowledged + 1;
                        holder.write("p", "s", &key, next.to_be_bytes().to_vec()).await?;
                        acknowledged = next;
                    }
                    pgfence::Result::<(String, u64)>::Ok((key, acknowledged))
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(500)).await;
        net.cut();
        tokio::time::sleep(Duration::from_secs(3)).await;
        net.heal();
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop.store(true, Ordering::Relaxed);
        for writer in writers {
            let (key, acknowledged) = within("writer", writer).await.unwrap().unwrap();
            let value = within("read", holder.read("p", "s", &key)).await.unwrap();
            assert_eq!(value, acknowledged.to_be_bytes(), "{key}: the last acknowledged write");
        }
        assert!(state.has_changed().is_ok_and(|changed| !changed), "{:?}", *state.borrow());
        assert!(matches!(*state.borrow_and_update(), LeaseState::Held { epoch: 1, .. }));
        let holder = far.spawn(async move { holder.close().await }).await.unwrap();
        holder.unwrap();
    });
}

/// A standby cut off while it waits misses the holder's release notification, and takes over
/// soon after the network heals, not after the holder's whole TTL (docs/design.md, "Failover"). The
/// cut lasts long enough for the standby's LISTEN connection to end (about a TTL of silence
/// and an unanswered keepalive, or an unanswered liveness check), so the notification is gone
/// with it, not merely late; the standby polls meanwhile and reconnects.
#[test]
fn partitioned_standby_takes_over_soon_after_the_network_heals() {
    let net = Network::create();
    let far = net.runtime();
    near().block_on(async {
        let proxy = net.proxy().await;
        let t = table("partsb");
        let holder_ttl = Duration::from_secs(60);
        let holder = common::builder(&t).lease_ttl(holder_ttl).open().await.unwrap();
        let standby = far_builder(&proxy, &t).standby();
        let mut progress = standby.progress();
        let waiting = far.spawn(standby.open());
        within("standby waiting", progress.wait_for(|s| matches!(s, StandbyState::Waiting { .. })))
            .await
            .unwrap();

        net.wait_until_all_sent();
        net.cut();
        holder.close().await.unwrap(); // Its notification cannot reach the standby.
        tokio::time::sleep(TTL * 3).await;
        net.heal();
        let healed = Instant::now();
        let store = within("the standby takes over", waiting).await.unwrap().unwrap();
        let took = healed.elapsed();
        println!("took over {took:?} after the network healed (holder's TTL {holder_ttl:?})");
        assert!(took < holder_ttl / 4, "not by the holder's expiry: {took:?}");
        assert_eq!(store.fencing_token(), 2);
        far.spawn(async move { store.close().await }).await.unwrap().unwrap();
    });
}

/// A standby's LISTEN connection silently dropped on the way (the router discards its packets
/// only, both ways; new connections get through) misses the release's notification. Its TCP
/// keepalives find the dead connection within seconds, with no statement on the server. The
/// standby then reconnects, looks at the lease again and takes it: long before the holder's
/// lease would have expired. Keepalives after one TTL of silence, as on the store's other
/// connections, would cost it about its whole TTL here.
#[test]
fn partitioned_listen_connection_costs_a_standby_seconds_not_the_holder_s_ttl() {
    const STANDBY_TTL: Duration = Duration::from_secs(20);
    let net = Network::create();
    let far = net.runtime();
    near().block_on(async {
        let proxy = net.proxy().await;
        let t = table("partlisten");
        let holder_ttl = Duration::from_secs(60);
        let holder = common::builder(&t).lease_ttl(holder_ttl).open().await.unwrap();
        let standby = far_builder(&proxy, &t).lease_ttl(STANDBY_TTL).standby();
        let mut progress = standby.progress();
        let waiting = far.spawn(standby.open());
        within("standby waiting", progress.wait_for(|s| matches!(s, StandbyState::Waiting { .. })))
            .await
            .unwrap();
        // Left: the LISTEN connection, and the connection of the attempt, idle for the next.
        // The former's keepalives probe after 5 s of silence, the latter's after a TTL (20 s):
        // just after the attempt, only the LISTEN connection's are due within 6 s.
        let deadline = Instant::now() + HANG_GUARD;
        while net.established() != 2 {
            assert!(Instant::now() < deadline, "connections:\n{}", net.sockets());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        net.wait_until_all_sent();
        let sockets = net.sockets_with_timers();
        let listening: Vec<&str> = sockets
            .lines()
            .filter(|line| keepalive_due_in(line) < Duration::from_secs(6))
            .collect();
        assert_eq!(listening.len(), 1, "one LISTEN connection:\n{sockets}");
        let local = listening[0].split_whitespace().nth(2).expect("a local address");
        let port: u16 = local.rsplit(':').next().unwrap().parse().unwrap();
        net.cut_port(port);
        let released = Instant::now();
        holder.close().await.unwrap(); // Its notification cannot reach the standby.
        let store = within("the standby takes over", waiting).await.unwrap().unwrap();
        let took = released.elapsed();
        println!("took over {took:?} after the release (standby's TTL {STANDBY_TTL:?})");
        // Keepalives after 5 s of silence (a quarter of the TTL, at most 5 s), the connection
        // ended 2 s later, a reconnect after 1 s.
        assert!(took < Duration::from_secs(14), "not by a TTL of silence: {took:?}");
        assert_eq!(store.fencing_token(), 2);
        far.spawn(async move { store.close().await }).await.unwrap().unwrap();
    });
}

/// When the keepalive timer of an `ss -o` line is due; a day if it shows none or minutes.
fn keepalive_due_in(line: &str) -> Duration {
    let never = Duration::from_secs(86_400);
    let Some((_, timer)) = line.split_once("timer:(keepalive,") else { return never };
    let due = timer.split(',').next().unwrap_or_default();
    if let Some(ms) = due.strip_suffix("ms") {
        return Duration::from_millis(ms.parse().unwrap_or(0));
    }
    match due.strip_suffix("sec").map(str::parse::<f64>) {
        Some(Ok(secs)) => Duration::from_secs_f64(secs),
        _ => never,
    }
}

/// A builder of a store on the far side, through `proxy`, with the tests' TTL.
fn far_builder(proxy: &Proxy, table: &str) -> pgfence::Builder {
    PgKvStore::builder_from_config(server().config_via(proxy.addr())).table(table).lease_ttl(TTL)
}

/// The runtime of the test itself, on the server's side of the network.
fn near() -> Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// The far side of a network: a namespace (`far`) whose only way to this one is through a
/// router (a second namespace), like a machine in another subnet. `host_ip` is this side's
/// address, reachable from `far`. Addresses are a random /29 of 198.18.0.0/15 (reserved for
/// network tests, RFC 2544), reserved by the far namespace's name, so that tests and test
/// processes running at once never share one (a shared block failed a CI run: `ip route add`
/// found the route there, "File exists"). Both namespaces, with their links, are deleted on
/// drop; if the process is killed first, `ip netns list` shows them (`pgfence-net-*`) until
/// deleted by hand.
///
/// A cut makes the router discard every packet it would forward, both ways, and tell no one:
/// what a failed link or a firewall between two subnets does. Neither end's kernel learns of
/// it (a packet dropped on the sender's own interface would be reported to its TCP, which then
/// gives up within seconds; an unreachable neighbour likewise), so TCP keeps retransmitting
/// until a timeout ends the connection, or the link heals and the data arrives late.
struct Network {
    far: String,
    router: String,
    host_if: String,
    host_ip: Ipv4Addr,
}

impl Network {
    fn create() -> Network {
        // The far namespace's name holds the block's number, so creating it reserves the
        // block on this machine: another test, or another test process, that picks the same
        // block finds the name taken and picks again.
        let index = loop {
            let index = uuid::Uuid::new_v4().as_u128() as u32 % 16_384;
            match run(&["ip", "netns", "add", &format!("pgfence-net-{index}")]) {
                Ok(()) => break index,
                Err(e) if e.contains("File exists") => continue, // Another's block.
                Err(e) => panic!(
                    "could not create a network namespace ({e}). These tests need root and \
                     iproute2; to leave them out, run with `-- --skip partitioned_`"
                ),
            }
        };
        let block = u32::from(Ipv4Addr::new(198, 18, 0, 0)) + index * 8;
        let ip = |offset| Ipv4Addr::from(block + offset);
        let net = Network {
            far: format!("pgfence-net-{index}"),
            router: format!("pgfence-net-{index}-r"),
            host_if: format!("pgf{index}h"),
            host_ip: ip(1),
        };
        // From here on, dropping `net` cleans up.
        let host_if = &net.host_if;
        let (host, router, far) = (None, Some(net.router.as_str()), Some(net.far.as_str()));
        for (namespace, command) in [
            (host, format!("netns add {}", net.router)),
            (host, format!("link add {host_if} type veth peer name toroot netns {}", net.router)),
            (host, format!("addr add {}/30 dev {host_if}", ip(1))),
            (host, format!("link set {host_if} up")),
            (router, format!("addr add {}/30 dev toroot", ip(2))),
            (router, "link set toroot up".to_owned()),
            (router, format!("link add toclient type veth peer name far netns {}", net.far)),
            (router, format!("addr add {}/30 dev toclient", ip(5))),
            (router, "link set toclient up".to_owned()),
            (far, format!("addr add {}/30 dev far", ip(6))),
            (far, "link set far up".to_owned()),
            (far, "link set lo up".to_owned()),
            (far, format!("route add default via {}", ip(5))),
            (host, format!("route add {}/30 via {}", ip(4), ip(2))),
        ] {
            let args: Vec<&str> = command.split(' ').collect();
            run(&in_namespace(namespace, &[&["ip"], &args[..]].concat())).unwrap();
        }
        let forward = ["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"];
        run(&in_namespace(router, &forward)).unwrap();
        net
    }

    /// A proxy on this side of the router, to the test server: the far side's way to it.
    async fn proxy(&self) -> Proxy {
        Proxy::start_on(self.host_ip.into(), server().tcp_addr().unwrap()).await.unwrap()
    }

    /// A runtime whose threads are in the far namespace.
    fn runtime(&self) -> Runtime {
        let path = format!("/run/netns/{}", self.far);
        let namespace = Arc::new(File::open(&path).unwrap());
        let expected = format!("net:[{}]", namespace.metadata().unwrap().ino());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .on_thread_start(move || {
                // SAFETY: a plain system call on a descriptor we keep open; it moves only the
                // calling thread into the namespace.
                let status = unsafe { libc::setns(namespace.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(status, 0, "setns: {}", std::io::Error::last_os_error());
            })
            .build()
            .unwrap();
        let inside = runtime
            .block_on(runtime.spawn(async { std::fs::read_link("/proc/thread-self/ns/net") }))
            .unwrap()
            .unwrap();
        assert_eq!(inside.to_string_lossy(), expected, "the runtime's threads are in {path}");
        runtime
    }

    /// How many TCP connections of the far namespace are established.
    fn established(&self) -> usize {
        self.sockets().lines().count()
    }

    /// `ss` of the far namespace's established TCP connections: Recv-Q, Send-Q, local and peer
    /// address, one line each.
    fn sockets(&self) -> String {
        let ss = ["ss", "-tnH", "state", "established"];
        let sockets = in_namespace(Some(&self.far), &ss);
        let output = Command::new(&sockets[0]).args(&sockets[1..]).output().unwrap();
        assert!(output.status.success(), "{sockets:?}: {output:?}");
        String::from_utf8(output.stdout).unwrap()
    }

    /// [`Network::sockets`] with each connection's timer (`ss -o`).
    fn sockets_with_timers(&self) -> String {
        let ss = ["ss", "-tnoH", "state", "established"];
        let sockets = in_namespace(Some(&self.far), &ss);
        let output = Command::new(&sockets[0]).args(&sockets[1..]).output().unwrap();
        assert!(output.status.success(), "{sockets:?}: {output:?}");
        String::from_utf8(output.stdout).unwrap()
    }

    /// Waits until every TCP connection of the far namespace has all it sent acknowledged.
    fn wait_until_all_sent(&self) {
        let deadline = Instant::now() + HANG_GUARD;
        loop {
            let sockets = self.sockets();
            if sockets.lines().all(|line| line.split_whitespace().nth(1) == Some("0")) {
                return;
            }
            assert!(Instant::now() < deadline, "data still unacknowledged:\n{sockets}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// From now on the router silently discards every packet it would forward, both ways.
    fn cut(&self) {
        for link in ["toroot", "toclient"] {
            let rule = ["rule", "add", "pref", "10", "iif", link, "blackhole"];
            run(&in_namespace(Some(&self.router), &[&["ip"], &rule[..]].concat())).unwrap();
        }
    }

    /// From now on the router silently discards every packet of the far side's TCP port
    /// `port`, both ways.
    fn cut_port(&self, port: u16) {
        let port = port.to_string();
        for (link, side) in [("toroot", "dport"), ("toclient", "sport")] {
            let rule = ["rule", "add", "pref", "10", "iif", link, "ipproto", "tcp", side, &port];
            let rule = [&rule[..], &["blackhole"]].concat();
            run(&in_namespace(Some(&self.router), &[&["ip"], &rule[..]].concat())).unwrap();
        }
    }

    fn heal(&self) {
        for link in ["toroot", "toclient"] {
            let rule = ["rule", "del", "pref", "10", "iif", link, "blackhole"];
            run(&in_namespace(Some(&self.router), &[&["ip"], &rule[..]].concat())).unwrap();
        }
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        // Deleting either end of a veth pair deletes both, and a namespace's links go with it
        // (the far one once its last thread has left: the far runtime is dropped before this).
        let _ = run(&["ip", "link", "del", &self.host_if]);
        for namespace in [&self.router, &self.far] {
            if let Err(e) = run(&["ip", "netns", "del", namespace]) {
                eprintln!("could not delete network namespace {namespace}: {e}");
            }
        }
    }
}

/// `command` to run in the network namespace `namespace` (`None`: this one). `nsenter` enters
/// only the network namespace, where `ip -n` and `ip netns exec` also remount `/sys` in a mount
/// namespace of their own, which fails in a chroot.
fn in_namespace(namespace: Option<&str>, command: &[&str]) -> Vec<String> {
    let enter = namespace.map(|ns| ["nsenter".to_owned(), format!("--net=/run/netns/{ns}")]);
    enter.into_iter().flatten().chain(command.iter().map(|&arg| arg.to_owned())).collect()
}

fn run<S: AsRef<str>>(args: &[S]) -> Result<(), String> {
    let args: Vec<&str> = args.iter().map(AsRef::as_ref).collect();
    let output = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("could not run {}: {e}", args[0]))?;
    match output.status.success() {
        true => Ok(()),
        false => Err(format!(
            "`{}` failed ({}): {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )),
    }
}
