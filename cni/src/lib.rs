//! weir's chained CNI plugin.
pub mod protocol;
