//! `pgfence::ldk::LdkStore` through LDK's own crates, one test binary: the conformance suite
//! through the traits of each `lightning` line (ldk.rs, ldk_0_2.rs; written once in line.rs), and
//! stores that two LDK nodes with real channels wrote, moved into tables (ldk_channels.rs).
//!
//! The helpers are pgfence's own (tests/common, tests/suite/sync_support.rs), shared by path.
//! Filter by module: `cargo test --all-features --test ldk ldk_channels::`.

#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "../../../tests/suite/sync_support.rs"]
mod sync_support;

mod line;

mod ldk;
mod ldk_0_2;
mod ldk_channels;

/// The `pgfence` CLI, built with the features of this build of the workspace.
///
/// `CARGO_BIN_EXE_pgfence` names only a package's own binaries, and the CLI is pgfence's. So it
/// is built here, with the arguments tests/cli.rs builds the examples with: after
/// `cargo test --all-features` this finds it built and builds nothing.
#[cfg(feature = "ldk-import")]
fn pgfence_cli() -> &'static std::path::Path {
    use std::path::PathBuf;
    use std::process::Command;
    use std::sync::OnceLock;

    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        let status = Command::new(cargo)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["build", "--workspace", "--all-features", "--examples", "--bins", "--quiet"])
            .status()
            .expect("run cargo build --bins");
        assert!(status.success(), "cargo build --bins: {status}");
        // This test runs from target/debug/deps; the CLI is target/debug/pgfence.
        let exe = std::env::current_exe().expect("the test's path");
        let debug = exe.parent().and_then(|deps| deps.parent()).expect("target/debug");
        debug.join(format!("pgfence{}", std::env::consts::EXE_SUFFIX))
    })
}
