//! The store's error log events, for tests that wait for one or stop a thread at one.

use tracing_subscriber::layer::SubscriberExt;

/// One error event of the store: its message and its `table` field (empty if it has none).
#[derive(Debug, Default)]
pub struct ErrorEvent {
    pub table: String,
    pub message: String,
}

/// Installs, once per test binary, a global log subscriber that takes only the store's error
/// events and hands each to `observe`, on the thread that logs it. Global, because a
/// subscriber of some threads alone would not do: the renewal thread logs on a thread of its
/// own, and tracing caches per call site whether any subscriber wants an event, in some cases
/// by asking the subscriber of whichever thread makes the call first. A test binary has one
/// observer: the first installed.
pub fn observe(observe: fn(&ErrorEvent)) {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        let subscriber = tracing_subscriber::registry().with(ErrorEvents(observe));
        tracing::subscriber::set_global_default(subscriber)
            .expect("the only log subscriber of this test binary");
    });
}

struct ErrorEvents(fn(&ErrorEvent));

fn wanted(metadata: &tracing::Metadata<'_>) -> bool {
    metadata.is_event()
        && *metadata.level() == tracing::Level::ERROR
        && metadata.target().starts_with("pgfence")
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for ErrorEvents {
    fn register_callsite(
        &self,
        metadata: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        match wanted(metadata) {
            true => tracing::subscriber::Interest::always(),
            false => tracing::subscriber::Interest::never(),
        }
    }

    fn enabled(
        &self,
        metadata: &tracing::Metadata<'_>,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        wanted(metadata)
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let mut fields = ErrorEvent::default();
        event.record(&mut fields);
        (self.0)(&fields);
    }
}

impl tracing::field::Visit for ErrorEvent {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "table" => self.table = format!("{value:?}"),
            "message" => self.message = format!("{value:?}"),
            _ => {}
        }
    }
}
