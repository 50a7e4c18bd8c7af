//! Seccomp filter (being written).
