//! The library's `tracing` events on stderr, and the ones the CLI reports itself.

use std::io::{self};

use tokio::sync::mpsc;

/// The library reports renewal retries, failed releases and fallbacks through `tracing`:
/// show warnings and errors on stderr (`RUST_LOG` overrides, e.g. `RUST_LOG=pgfence=debug`).
/// Colour only on a terminal, and never with `NO_COLOR` set (<https://no-color.org>).
pub(crate) fn init_logging() {
    use std::io::IsTerminal;
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let ansi = io::stderr().is_terminal() && !no_color;
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(io::stderr)
        .with_ansi(ansi)
        .with_filter(filter)
        .with_filter(tracing_subscriber::filter::filter_fn(|event| !reported_by_the_cli(event)));
    tracing_subscriber::registry().with(layer).with(StandbyTrouble).init();
}

/// Where [`StandbyTrouble`] sends the standby's warnings while `hold --wait` listens.
pub(crate) static STANDBY_TROUBLE: std::sync::Mutex<Option<mpsc::UnboundedSender<String>>> =
    std::sync::Mutex::new(None);

/// Where [`StandbyTrouble`] sends a holder's retries while `hold` holds the lease: renewals
/// and statements retried after a connection broke. `hold` reports them as JSON events too,
/// besides the log line on stderr.
pub(crate) static HOLDER_TROUBLE: std::sync::Mutex<Option<mpsc::UnboundedSender<String>>> =
    std::sync::Mutex::new(None);

/// Passes the standby's warnings (retries, LISTEN trouble) to `hold --wait`, which reports
/// them itself. It reports them rate-limited, with the whole cause, and as a JSON event a
/// supervisor can see. The library logs them about once a second, with the cause cut to its
/// first line. A holder's retries go to `hold` the same way ([`HOLDER_TROUBLE`]).
struct StandbyTrouble;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for StandbyTrouble {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let to = match event.metadata() {
            m if is_standby_warning(m) => &STANDBY_TROUBLE,
            m if is_holder_retry(m) => &HOLDER_TROUBLE,
            _ => return,
        };
        let listening = to.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(sender) = listening.as_ref() {
            let mut text = EventText::default();
            event.record(&mut text);
            let _ = sender.send(text.0); // `hold` may have stopped listening.
        }
    }
}

/// An event's message and fields on one line: `message: field=value ...`.
#[derive(Default)]
struct EventText(String);

impl tracing::field::Visit for EventText {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        let text = match field.name() {
            "message" => format!("{value:?}"),
            name => format!("{name}={value:?}"),
        };
        if !self.0.is_empty() {
            self.0.push_str(": ");
        }
        self.0.push_str(&text);
    }
}

/// The standby's warnings: every warning with the documented target `pgfence::standby`
/// (docs/design.md, "Logging").
fn is_standby_warning(event: &tracing::Metadata<'_>) -> bool {
    event.target() == "pgfence::standby" && *event.level() == tracing::Level::WARN
}

/// A holder's retries: the warnings of renewal (`pgfence::lease`) and of statements retried
/// on a fresh connection (`pgfence::exec`), by their documented targets.
fn is_holder_retry(event: &tracing::Metadata<'_>) -> bool {
    matches!(event.target(), "pgfence::lease" | "pgfence::exec")
        && *event.level() == tracing::Level::WARN
}

/// The library's events that the CLI reports itself; otherwise both would say the same thing.
/// They are the lease loss (the `lost` event and the exit-5 error line), and an operator's
/// force release (the `release` command's own output). They also include the standby's
/// warnings (see [`StandbyTrouble`]). Recognised by their documented targets (docs/design.md,
/// "Logging"), level, and for the loss a field only it has.
fn reported_by_the_cli(event: &tracing::Metadata<'_>) -> bool {
    let has = |field: &str| event.fields().field(field).is_some();
    match event.target() {
        "pgfence::lease" => *event.level() == tracing::Level::ERROR && has("reason"),
        "pgfence::standby" | "pgfence::inspect" => *event.level() == tracing::Level::WARN,
        _ => false,
    }
}
