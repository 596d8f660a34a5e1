//! weir's test harness.
