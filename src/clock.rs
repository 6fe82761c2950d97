//! The clock of the local deadline.

use std::time::Duration;

/// The clock of the local deadline: time since boot, counting time the machine spent suspended
/// (Linux `CLOCK_BOOTTIME`).
///
/// std's monotonic clock stops during a suspend. A resumed laptop or VM would then trust a
/// lease that expired long ago. The wall clock counts the suspend, but NTP can step it. That
/// would fail a healthy lease or extend a lost one. Elsewhere than Linux, this is the monotonic
/// clock.
pub(crate) fn clock() -> Duration {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let now = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
        Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        static BASE: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        BASE.get_or_init(std::time::Instant::now).elapsed()
    }
}
