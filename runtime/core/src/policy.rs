//! Policies (being written).
