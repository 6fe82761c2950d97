//! No code: this crate holds pgfence's tests that need LDK's own crates (tests/ldk).
//!
//! They are a crate of their own so that LDK's test utilities are not dev-dependencies of
//! pgfence. Every example and test of pgfence builds all its dev-dependencies, the demo
//! included; these take minutes on a small machine. `cargo test --all-features` from the
//! workspace root runs them with the rest.
#![forbid(unsafe_code)]
