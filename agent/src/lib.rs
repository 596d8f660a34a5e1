//! weir's node agent.
