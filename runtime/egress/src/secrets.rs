//! A sandbox's secrets as its proxy holds them: the value (rotated or revoked while the sandbox
//! lives), the placeholder the sandbox sees instead, and how the value is presented on a request.
//!
//! A placeholder is 128 random bits from the system's generator, made when the proxy starts:
//! nothing about the value can be learnt from it (it is not derived from the value, and stays
//! the same across rotations). The values live in [`SecretValue`]s, which are wiped when
//! dropped and never printed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use ring::rand::SecureRandom;
use taskbox_core::api::{SecretStatus, SecretValue};
use taskbox_core::egress::ResolvedSecret;
use taskbox_core::netpattern::HostPattern;
use taskbox_core::policy::secrets::{Presentation, SECRET_MARK};

/// One secret of a live proxy.
pub(crate) struct LiveSecret {
    pub(crate) name: String,
    pub(crate) hosts: Vec<HostPattern>,
    pub(crate) presentation: Presentation,
    pub(crate) placeholder: String,
    pub(crate) placeholder_var: String,
    /// `None` once revoked.
    value: RwLock<Option<Arc<SecretValue>>>,
    rotations: AtomicU64,
}

impl std::fmt::Debug for LiveSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveSecret")
            .field("name", &self.name)
            .field("placeholder_var", &self.placeholder_var)
            .finish_non_exhaustive()
    }
}

/// A fresh placeholder for secret `name`: `taskbox-placeholder-NAME-` and 32 random hex digits.
fn placeholder(name: &str) -> Result<String, ring::error::Unspecified> {
    let mut bytes = [0u8; 16];
    ring::rand::SystemRandom::new().fill(&mut bytes)?;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("taskbox-placeholder-{name}-{hex}"))
}

impl LiveSecret {
    pub(crate) fn new(secret: ResolvedSecret) -> Result<LiveSecret, String> {
        let placeholder = placeholder(&secret.name)
            .map_err(|_| "the system's random generator failed".to_owned())?;
        Ok(LiveSecret {
            placeholder_var: secret.spec.placeholder_var(&secret.name),
            presentation: secret.spec.presentation(),
            hosts: secret.spec.hosts.clone(),
            name: secret.name,
            placeholder,
            value: RwLock::new(Some(Arc::new(secret.value))),
            rotations: AtomicU64::new(0),
        })
    }

    /// Whether the secret is presented on requests to `host:port` (a normalised name): the same
    /// exact and `*.suffix` matching as the allowlist's.
    pub(crate) fn bound_to(&self, host: &str, port: u16) -> bool {
        self.hosts.iter().any(|p| p.matches_name(host, port))
    }

    /// The value now in force; `None` once revoked.
    pub(crate) fn value(&self) -> Option<Arc<SecretValue>> {
        self.value
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Puts `value` in force (a rotation), or revokes the secret (`None`).
    pub(crate) fn set(&self, value: Option<SecretValue>) {
        let rotated = value.is_some();
        *self.value.write().unwrap_or_else(PoisonError::into_inner) = value.map(Arc::new);
        if rotated {
            self.rotations.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn status(&self) -> SecretStatus {
        SecretStatus {
            name: self.name.clone(),
            hosts: self.hosts.iter().map(ToString::to_string).collect(),
            placeholder_env: self.placeholder_var.clone(),
            state: if self.value().is_some() {
                "active"
            } else {
                "revoked"
            }
            .to_owned(),
            rotations: self.rotations.load(Ordering::Relaxed),
        }
    }
}

/// The header value `template` makes of `value` (`{secret}` replaced).
pub(crate) fn render(template: &str, value: &str) -> String {
    template.replacen(SECRET_MARK, value, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(value: &str) -> LiveSecret {
        let spec: taskbox_core::policy::SecretSpec = toml::from_str(
            "from_api = true\nhosts = [\"api.test\", \"*.files.test:443\"]\nheader = \"X-Key\"\n",
        )
        .unwrap();
        LiveSecret::new(ResolvedSecret {
            name: "key".into(),
            spec,
            value: SecretValue::new(value),
        })
        .unwrap()
    }

    #[test]
    fn placeholders_are_random_and_unrelated_to_the_value() {
        let a = secret("same-value");
        let b = secret("same-value");
        assert_ne!(a.placeholder, b.placeholder);
        assert!(a.placeholder.starts_with("taskbox-placeholder-key-"));
        assert!(!a.placeholder.contains("same-value"));
        assert_eq!(a.placeholder.len(), "taskbox-placeholder-key-".len() + 32);
    }

    #[test]
    fn binding_uses_the_allowlist_matching_and_rotation_revocation_apply() {
        let s = secret("v1");
        assert!(s.bound_to("api.test", 443));
        assert!(s.bound_to("api.test", 8443));
        assert!(s.bound_to("a.files.test", 443));
        assert!(!s.bound_to("a.files.test", 80));
        for other in ["api.test.evil.test", "apitest", "x.api.test", "files.test"] {
            assert!(!s.bound_to(other, 443), "{other}");
        }
        s.set(Some(SecretValue::new("v2")));
        assert_eq!(s.value().unwrap().expose(), "v2");
        assert_eq!(s.status().rotations, 1);
        s.set(None);
        assert!(s.value().is_none());
        assert_eq!(s.status().state, "revoked");
        assert!(!format!("{s:?}").contains("v2"));
    }
}
