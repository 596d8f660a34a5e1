//! Waiting for something another thread or process does: a deadline, not a pause, so a passing
//! test waits only as long as the thing takes.
//!
//! A check answers `bool` (done or not) or `Option<T>` (the thing, once there). [`wait_until`]
//! fails the test with what it waited for when the deadline passes; [`try_wait_until`] returns
//! `None` instead, for a test that asserts on the timeout itself or reports more than the name.

use std::time::{Duration, Instant};

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
        .unwrap_or_else(|| panic!("timed out after {timeout:?} waiting for {what}"))
}

/// Runs `check` until it answers done; `None` once `timeout` passed without it. The check runs
/// at least once, and once more at the deadline.
pub fn try_wait_until<C: Check>(
    timeout: Duration,
    mut check: impl FnMut() -> C,
) -> Option<C::Found> {
    let deadline = Instant::now() + timeout;
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
    let deadline = Instant::now() + timeout;
    loop {
        let past_deadline = Instant::now() >= deadline;
        if let Some(found) = check().found() {
            return found;
        }
        assert!(
            !past_deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}
