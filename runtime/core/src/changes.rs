//! Workspace changes (being written).
