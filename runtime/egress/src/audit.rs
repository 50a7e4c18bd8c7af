//! Every use of a secret, counted for the whole process: what the supervisor's `/metrics`
//! shows (`taskbox_egress_secret_uses_total{sandbox, secret, host}`). The per-exec record of
//! the same uses is in each exec's `network.secrets`, and so in the trace.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

/// Uses of one secret by one sandbox on one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretUseCount {
    pub sandbox: String,
    pub secret: String,
    pub host: String,
    pub uses: u64,
}

type Key = (String, String, String);

static USES: Mutex<BTreeMap<Key, u64>> = Mutex::new(BTreeMap::new());

/// Counts one request of `sandbox` to `host` that carried `secret`.
pub(crate) fn record(sandbox: &str, secret: &str, host: &str) {
    let mut uses = USES.lock().unwrap_or_else(PoisonError::into_inner);
    *uses
        .entry((sandbox.to_owned(), secret.to_owned(), host.to_owned()))
        .or_insert(0) += 1;
}

/// Every use counted so far (sandboxes that ended included).
pub fn secret_uses() -> Vec<SecretUseCount> {
    USES.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .map(|((sandbox, secret, host), uses)| SecretUseCount {
            sandbox: sandbox.clone(),
            secret: secret.clone(),
            host: host.clone(),
            uses: *uses,
        })
        .collect()
}
