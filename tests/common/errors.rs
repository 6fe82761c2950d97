//! The store's error log events, for tests that wait for one or stop a thread at one.

use tracing_subscriber::layer::SubscriberExt;

/// One error event of the store: its message and its `table` field (empty if it has none).
#[derive(Debug, Default)]
pub struct ErrorEvent {
    pub table: String,
    pub message: String,
}

/// Adds `observe`, under `name`, to the observers of the store's error events, and installs, once per test
/// binary, the global log subscriber that calls them. Each event goes to every observer, on the
/// thread that logs it. Global, because a subscriber of some threads alone would not do: the
/// renewal thread logs on a thread of its own, and tracing caches per call site whether any
/// subscriber wants an event, in some cases by asking the subscriber of whichever thread makes
/// the call first. Several observers, because the modules of tests/suite share one process.
pub fn observe(name: &'static str, observe: fn(&ErrorEvent)) {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    {
        let mut observers = OBSERVERS.lock().unwrap_or_else(|e| e.into_inner());
        // Once per name: callers add theirs before each use.
        if !observers.iter().any(|(added, _)| *added == name) {
            observers.push((name, observe));
        }
    }
    INSTALLED.call_once(|| {
        let subscriber = tracing_subscriber::registry().with(ErrorEvents);
        tracing::subscriber::set_global_default(subscriber)
            .expect("the only log subscriber of this test binary");
    });
}

/// An observer of error events, as [`observe`] takes it.
type Observer = fn(&ErrorEvent);

/// Every observer given to [`observe`] in this process.
static OBSERVERS: std::sync::Mutex<Vec<(&str, Observer)>> = std::sync::Mutex::new(Vec::new());

struct ErrorEvents;

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
        // A copy: an observer may block (hazards.rs pauses a thread at an event), and must
        // not hold up the other threads' events meanwhile.
        let observers = OBSERVERS.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for (_, observe) in observers {
            observe(&fields);
        }
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
