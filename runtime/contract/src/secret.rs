//! Secret values and the operations on a live sandbox's secrets (`docs/secrets.md`).
//!
//! A [`SecretValue`] is the one type that holds a secret: its `Debug` says `[redacted]`, it has
//! no `Display`, and its memory is wiped when it is dropped. It serialises as its text, since
//! a client must send it (a create's `secrets`, a rotation); the trace writer replaces those
//! fields before anything is written (`taskbox_trace`), and [`crate::op::Op::request`] of a
//! rotation leaves the value out.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use zeroize::Zeroizing;

/// A secret's value. Compared in constant time with [`SecretValue::ct_eq`]; `PartialEq` is
/// there for tests of the types that hold one.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretValue(Zeroizing<String>);

impl SecretValue {
    pub fn new(value: impl Into<String>) -> SecretValue {
        SecretValue(Zeroizing::new(value.into()))
    }

    /// The value itself: for the egress proxy, which presents it, and nothing else.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `other` is the same value, in time that depends on the lengths only.
    pub fn ct_eq(&self, other: &[u8]) -> bool {
        let mine = self.0.as_bytes();
        mine.len() == other.len()
            && mine
                .iter()
                .zip(other)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretValue([redacted])")
    }
}

impl Serialize for SecretValue {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for SecretValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(SecretValue::new)
    }
}

impl schemars::JsonSchema for SecretValue {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "SecretValue".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        String::json_schema(generator)
    }
}

/// A change to one secret of a live sandbox: a rotation (a new value, used by every request
/// from then on) or a revocation (none: requests go out without it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SecretUpdate {
    /// The secret's name in the policy's `[secrets]`.
    pub name: String,
    /// The new value; none revokes the secret.
    #[serde(default)]
    pub value: Option<SecretValue>,
}

/// The body of `PUT /v1/sandboxes/{id}/secrets/{name}`: the new value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SecretRotation {
    pub value: SecretValue,
}

/// A secret of a live sandbox, as the API shows it: never its value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct SecretStatus {
    pub name: String,
    /// The hosts it is presented to.
    pub hosts: Vec<String>,
    /// The sandbox's variable that holds its placeholder.
    pub placeholder_env: String,
    /// "active" or "revoked".
    pub state: String,
    /// How many times it was rotated since the sandbox was created.
    pub rotations: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_shows_nowhere_but_on_the_wire() {
        let v = SecretValue::new("hunter2-value");
        assert_eq!(format!("{v:?}"), "SecretValue([redacted])");
        let update = SecretUpdate {
            name: "gh".into(),
            value: Some(v.clone()),
        };
        assert!(!format!("{update:?}").contains("hunter2"));
        assert_eq!(
            serde_json::to_value(&update).unwrap(),
            serde_json::json!({"name": "gh", "value": "hunter2-value"})
        );
        assert!(v.ct_eq(b"hunter2-value"));
        assert!(!v.ct_eq(b"hunter2-valuf"));
        assert!(!v.ct_eq(b"hunter2"));
    }
}
