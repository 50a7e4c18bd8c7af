//! Shared helpers of the integration suites.
