//! Who is calling: bearer tokens mapped to tenants by a tokens file, or everyone is `local`.
//!
//! The tokens file is TOML, one table per token:
//!
//! ```toml
//! [[token]]
//! token = "a-long-random-secret-of-16-or-more-characters"
//! tenant = "alice"
//! ```
//!
//! Unknown keys are refused. Tokens are at least 16 printable ASCII characters without spaces,
//! and unique; tenant names are 1-64 characters of `[A-Za-z0-9._-]`. The server keeps only the
//! SHA-256 digest of each token and looks tokens up by digest.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::{HttpError, ServerError};

/// The tenant of every request when the server runs without a tokens file, and the owner of
/// sandboxes found without a `taskbox.tenant` label.
pub const LOCAL_TENANT: &str = "local";

/// The label that records a sandbox's owner.
pub const TENANT_LABEL: &str = "taskbox.tenant";

/// Labels starting with this are the server's; create requests may not set them.
pub const RESERVED_LABEL_PREFIX: &str = "taskbox.";

const MIN_TOKEN_LEN: usize = 16;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    #[serde(default)]
    token: Vec<TokenEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    token: String,
    tenant: String,
}

/// Bearer tokens and their tenants.
#[derive(Clone)]
pub struct Tokens {
    by_digest: HashMap<[u8; 32], String>,
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokens")
            .field("count", &self.by_digest.len())
            .finish()
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Whether `name` is a valid tenant name.
pub fn valid_tenant(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl Tokens {
    /// Reads and validates a tokens file.
    pub fn load(path: &Path) -> Result<Tokens, ServerError> {
        let err = |why: String| ServerError::Tokens {
            path: path.to_path_buf(),
            why,
        };
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        if let Ok(meta) = std::fs::metadata(path) {
            use std::os::unix::fs::PermissionsExt;
            if meta.permissions().mode() & 0o077 != 0 {
                tracing::warn!(path = %path.display(), "the tokens file is readable by others; chmod 600 it");
            }
        }
        Tokens::parse(&text).map_err(err)
    }

    /// Parses the text of a tokens file; errors name the offending key.
    pub fn parse(text: &str) -> Result<Tokens, String> {
        let file: TokensFile = toml::from_str(text).map_err(|e| e.to_string())?;
        if file.token.is_empty() {
            return Err("no [[token]] entries: nobody could call the server".into());
        }
        let mut by_digest = HashMap::new();
        for (i, entry) in file.token.iter().enumerate() {
            let n = i + 1;
            if entry.token.len() < MIN_TOKEN_LEN {
                return Err(format!(
                    "token #{n}: key `token` is shorter than {MIN_TOKEN_LEN} characters"
                ));
            }
            if !entry.token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!(
                    "token #{n}: key `token` must be printable ASCII without spaces"
                ));
            }
            if !valid_tenant(&entry.tenant) {
                return Err(format!(
                    "token #{n}: key `tenant` {:?} must be 1-64 characters of A-Z, a-z, 0-9, '.', '_' and '-'",
                    entry.tenant
                ));
            }
            if by_digest
                .insert(digest(&entry.token), entry.tenant.clone())
                .is_some()
            {
                return Err(format!("token #{n}: key `token` repeats an earlier token"));
            }
        }
        Ok(Tokens { by_digest })
    }

    /// The tenant `token` belongs to.
    pub fn tenant(&self, token: &str) -> Option<&str> {
        self.by_digest.get(&digest(token)).map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.by_digest.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }
}

/// How requests are authenticated.
#[derive(Debug, Clone)]
pub enum Auth {
    /// No tokens file: every request is the tenant [`LOCAL_TENANT`]. Only for the Unix socket and
    /// loopback TCP addresses; `serve` refuses anything else.
    Local,
    /// `Authorization: Bearer TOKEN` is required on every authenticated route and listener.
    Tokens(Tokens),
}

impl Auth {
    /// The tenant of a request carrying `authorization` (the header's value, if any).
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<String, HttpError> {
        let tokens = match self {
            Auth::Local => return Ok(LOCAL_TENANT.to_string()),
            Auth::Tokens(t) => t,
        };
        let Some(value) = authorization else {
            return Err(HttpError::Unauthorized(
                "missing bearer token: send `Authorization: Bearer TOKEN`".into(),
            ));
        };
        let token = value
            .split_once(' ')
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, t)| t.trim())
            .ok_or_else(|| {
                HttpError::Unauthorized(
                    "the authorization header is not a bearer token: send `Authorization: Bearer TOKEN`"
                        .into(),
                )
            })?;
        tokens
            .tenant(token)
            .map(str::to_string)
            .ok_or_else(|| HttpError::Unauthorized("unknown bearer token".into()))
    }
}

/// The authenticated tenant of a request (extracting it answers 401 when there is none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_file_parses_and_validates() {
        let t = Tokens::parse(
            "[[token]]\ntoken = \"0123456789abcdef\"\ntenant = \"alice\"\n\
             [[token]]\ntoken = \"fedcba9876543210\"\ntenant = \"bob\"\n",
        )
        .unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t.tenant("0123456789abcdef"), Some("alice"));
        assert_eq!(t.tenant("nope"), None);

        let e = Tokens::parse("[[token]]\ntoken = \"0123456789abcdef\"\nuser = \"x\"\n")
            .err()
            .unwrap();
        assert!(e.contains("user"), "{e}");
        let e = Tokens::parse("[[token]]\ntoken = \"short\"\ntenant = \"a\"\n")
            .err()
            .unwrap();
        assert!(e.contains("`token`"), "{e}");
        let e = Tokens::parse("[[token]]\ntoken = \"0123456789abcdef\"\ntenant = \"a b\"\n")
            .err()
            .unwrap();
        assert!(e.contains("`tenant`"), "{e}");
        let dup = "[[token]]\ntoken = \"0123456789abcdef\"\ntenant = \"a\"\n";
        let e = Tokens::parse(&format!("{dup}{dup}")).err().unwrap();
        assert!(e.contains("repeats"), "{e}");
        assert!(Tokens::parse("").is_err());
    }

    #[test]
    fn bearer_header_maps_to_tenant() {
        let t =
            Tokens::parse("[[token]]\ntoken = \"0123456789abcdef\"\ntenant = \"alice\"\n").unwrap();
        let auth = Auth::Tokens(t);
        assert_eq!(
            auth.authenticate(Some("Bearer 0123456789abcdef")).unwrap(),
            "alice"
        );
        assert_eq!(
            auth.authenticate(Some("bearer 0123456789abcdef")).unwrap(),
            "alice"
        );
        assert!(auth.authenticate(None).is_err());
        assert!(auth.authenticate(Some("Basic 0123456789abcdef")).is_err());
        assert!(auth.authenticate(Some("Bearer wrong")).is_err());
        assert_eq!(Auth::Local.authenticate(None).unwrap(), LOCAL_TENANT);
    }
}
