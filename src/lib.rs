#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub, clippy::future_not_send)]
#![deny(rust_2018_idioms, rustdoc::broken_intra_doc_links)]

// Modules from the bottom of the dependency graph up, in groups: no module uses one of a
// later group, so imports run one way. A `write` travels down: `store` (the public method),
// `write` (per-key order, coalescing, the fenced statement), `exec` (admission, retries), `sql`
// (the statement text).

// Leaves: errors, input checks, the SQL text, the deadline's clock, the counters.
mod clock;
mod error;
mod keys;
pub mod privileges;
mod sql;
mod stats;

// Connections, what they keep in a server session, libpq's environment, the lease (with its
// loss policy) and the schema setup.
mod connect;
pub mod env;
mod lease;
mod schema;
mod session;

// The statement executor, then the write path on top of it.
mod exec;

mod write;

// Read-only inspection, below the store: it takes a table and a pool, not a builder.
mod inspect;

// The public API. `store` holds the types that name each other: `PgKvStore`, its `Builder`
// (options, checks and every opener), the `Standby` and the `blocking` store.
mod store;

// Many stores sharing one pool and one renewal thread: a way to open stores, above them.
mod fleet;

#[cfg(any(feature = "ldk", feature = "ldk-0_2"))]
pub mod ldk;
pub mod shutdown;

pub use connect::{tls_client_config, tls_client_config_with_cert};
/// The pool crate `builder_from_pool` takes, re-exported so versions always match.
pub use deadpool_postgres;
pub use error::{ConnectStep, Error, KeyPath, LossReason, Result};
pub use fleet::Fleet;
pub use inspect::{Entries, Entry, Inspector};
pub use keys::{MAX_BATCH_BYTES, MAX_KEY_LEN, check_key};
pub use lease::{LeaseLossPolicy, LeaseState};
/// The TLS library whose `ClientConfig` `Builder::tls` takes, re-exported so versions always
/// match.
pub use rustls;
pub use schema::LeaseInfo;
pub use stats::{FailClosed, Histogram, Operations, PoolStats, Renewals, Shared};
pub use store::Stats;
pub use store::blocking;
pub use store::{Builder, KvStore, Page, PageToken, PgKvStore, PoolMode, Standby, StandbyState};
/// The driver whose `Config` `builder_from_config` takes, re-exported so versions always match.
pub use tokio_postgres;
pub use write::batch::Batch;

// The Rust examples of the docs, compiled (and `no_run`) as doctests. The README's are the
// crate's own documentation, above.
#[cfg(doctest)]
#[doc = include_str!("../docs/design.md")]
struct DesignExamples;
#[cfg(all(doctest, any(feature = "ldk", feature = "ldk-0_2")))]
#[doc = include_str!("../docs/ldk.md")]
struct LdkExamples;

#[cfg(test)]
mod doc_examples {
    /// Every markdown file with Rust in it, and whether its blocks are doctests (above).
    const DOCS: &[(&str, &str, bool)] = &[
        ("README.md", include_str!("../README.md"), true),
        ("docs/design.md", include_str!("../docs/design.md"), true),
        ("docs/ldk.md", include_str!("../docs/ldk.md"), true),
        ("docs/cli.md", include_str!("../docs/cli.md"), false),
        ("docs/deployments.md", include_str!("../docs/deployments.md"), false),
        ("docs/metrics.md", include_str!("../docs/metrics.md"), false),
    ];
    /// The one program the docs quote without compiling the quote: it needs ldk-node, which
    /// only its own crate builds (CI builds and runs it).
    const LDK_NODE: &str = include_str!("../examples/ldk-node/src/main.rs");

    /// Each Rust block of the docs compiles: as a doctest, or, marked `ignore`, as a verbatim
    /// excerpt (up to indentation) of the ldk-node example.
    fn trimmed(text: &str) -> Vec<&str> {
        text.lines().map(str::trim).collect()
    }

    #[test]
    fn every_rust_block_of_the_docs_is_compiled() {
        let example = trimmed(LDK_NODE);
        let (mut quoted_blocks, mut doctests) = (0, 0);
        for (name, text, doctested) in DOCS {
            for block in text.split("\n```").skip(1).step_by(2) {
                let Some((info, body)) = block.split_once('\n') else { continue };
                if !info.starts_with("rust") {
                    continue;
                }
                if info.contains("ignore") {
                    let quoted = trimmed(body);
                    let found = example.windows(quoted.len()).any(|lines| lines == quoted);
                    assert!(found, "{name}: an ignored block not in the ldk-node example:\n{body}");
                    quoted_blocks += 1;
                } else {
                    assert!(doctested, "{name} has a Rust block but is not a doctest:\n{body}");
                    doctests += 1;
                }
            }
        }
        assert!(quoted_blocks >= 3 && doctests >= 5, "{quoted_blocks} quoted, {doctests} doctests");
    }
}
