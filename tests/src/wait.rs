//! Waiting for something another thread or process does: a deadline, not a pause, so a passing
//! test waits only as long as the thing takes.
//!
//! A check answers `bool` (done or not) or `Option<T>` (the thing, once there). [`wait_until`]
//! fails the test with what it waited for when the deadline passes; [`try_wait_until`] returns
//! `None` instead, for a test that asserts on the timeout itself or reports more than the name.
//!
//! A deadline says how long the thing takes on a node, with room; every one is stretched by
//! [`WAIT_SCALE_ENV`] where everything runs slower (the kernel guests, whose CPUs are emulated).

use std::{
    sync::OnceLock,
    time::{Duration, Instant},
};

/// A factor for every deadline (a decimal number, at least 1; 1 when unset).
pub const WAIT_SCALE_ENV: &str = "WEIR_TEST_WAIT_SCALE";

/// `timeout` stretched by [`WAIT_SCALE_ENV`].
pub fn scaled(timeout: Duration) -> Duration {
    static SCALE: OnceLock<f64> = OnceLock::new();
    let scale = SCALE.get_or_init(|| {
        let Some(value) = std::env::var_os(WAIT_SCALE_ENV) else {
            return 1.0;
        };
        match value.to_str().and_then(|value| value.parse::<f64>().ok()) {
            Some(scale) if scale >= 1.0 => scale,
            _ => panic!("{WAIT_SCALE_ENV} is {value:?}: a number, at least 1"),
        }
    });
    timeout.mul_f64(*scale)
}

/// How long the check rests between two tries.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// What a check answers: done (with what it found) or not yet.
pub trait Check {
    type Found;
    fn found(self) -> Option<Self::Found>;
}

impl Check for bool {
    type Found = ();
    fn found(self) -> Option<()> {
        self.then_some(())
    }
}

impl<T> Check for Option<T> {
    type Found = T;
    fn found(self) -> Option<T> {
        self
    }
}

/// Runs `check` until it answers done; panics with `what` once `timeout` passed without it.
#[track_caller]
pub fn wait_until<C: Check>(timeout: Duration, what: &str, check: impl FnMut() -> C) -> C::Found {
    try_wait_until(timeout, check)
        .unwrap_or_else(|| panic!("timed out after {:?} waiting for {what}", scaled(timeout)))
}

/// Runs `check` until it answers done; `None` once `timeout` passed without it. The check runs
/// at least once, and once more at the deadline.
pub fn try_wait_until<C: Check>(
    timeout: Duration,
    mut check: impl FnMut() -> C,
) -> Option<C::Found> {
    let deadline = Instant::now() + scaled(timeout);
    loop {
        let past_deadline = Instant::now() >= deadline;
        if let Some(found) = check().found() {
            return Some(found);
        }
        if past_deadline {
            return None;
        }
        std::thread::sleep(POLL_INTERVAL.min(deadline.saturating_duration_since(Instant::now())));
    }
}

/// [`wait_until`] inside a tokio runtime: rests with the runtime's timer, so the tasks the check
/// waits for (on the same runtime) go on meanwhile.
pub async fn wait_until_async<C: Check>(
    timeout: Duration,
    what: &str,
    mut check: impl FnMut() -> C,
) -> C::Found {
    let deadline = Instant::now() + scaled(timeout);
    loop {
        let past_deadline = Instant::now() >= deadline;
        if let Some(found) = check().found() {
            return found;
        }
        assert!(
            !past_deadline,
            "timed out after {:?} waiting for {what}",
            scaled(timeout)
        );
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}
