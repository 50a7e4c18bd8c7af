//! Secrets a sandbox never sees (`[secrets.NAME]`): where the supervisor finds each value, the
//! hosts the egress proxy presents it to, and how.
//!
//! ```toml
//! [secrets.registry]
//! from_env = "REGISTRY_TOKEN"            # or from_file = "/run/keys/registry", or from_api = true
//! hosts = ["registry.example.com"]       # names, exact or *.suffix, optional :PORT
//! header = "Authorization"               # or basic_user = "ci", or query = "access_token"
//! format = "Bearer {secret}"             # with header; the default for Authorization
//! placeholder_env = "REGISTRY_TOKEN"     # where the sandbox finds the placeholder
//! ```
//!
//! The policy holds no value, only where to find it; the value is read by the supervisor when a
//! sandbox is created (its environment, a file of its own, or the create request), and kept in
//! the proxy's memory. `docs/secrets.md` has the threat model.

use serde::{Deserialize, Serialize};

use crate::error::ValidationError;
use crate::netpattern::{HostMatch, HostPattern};

/// One `[secrets.NAME]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretSpec {
    /// The value is this variable of the supervisor's environment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_env: Option<String>,
    /// The value is the content of this file of the supervisor's (one trailing newline removed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_file: Option<String>,
    /// The value comes with the create request (`secrets` of `POST /v1/sandboxes`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub from_api: bool,
    /// The hosts it is presented to: names, exact or `*.suffix`, with an optional `:PORT`, as in
    /// `network.allow`. Never an address, a range or `*`.
    #[serde(default)]
    pub hosts: Vec<HostPattern>,
    /// Presented in this request header, as `format` says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// With `header`: its value, `{secret}` standing for the secret. Default: `Bearer {secret}`
    /// for `Authorization`, `{secret}` for any other header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// Presented as HTTP basic authentication, with this user name and the secret as password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub basic_user: Option<String>,
    /// Presented as this query parameter of the request's URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query: Option<String>,
    /// The variable that holds the placeholder in the sandbox (default
    /// `TASKBOX_SECRET_<NAME>`, the name in uppercase with `-` as `_`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placeholder_env: Option<String>,
}

/// Where a secret's value comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretSource<'a> {
    Env(&'a str),
    File(&'a str),
    Api,
}

/// How a secret is presented on a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Presentation {
    /// `name: value`, the value a template where `{secret}` stands for the secret.
    Header { name: String, template: String },
    /// `Authorization: Basic base64(user:secret)`.
    Basic { user: String },
    /// `?name=secret` (replacing a parameter of that name).
    Query { name: String },
}

/// What stands for the secret in `format`.
pub const SECRET_MARK: &str = "{secret}";

impl SecretSpec {
    /// Where the value comes from (the spec is validated: exactly one source).
    pub fn source(&self) -> SecretSource<'_> {
        match (&self.from_env, &self.from_file) {
            (Some(name), _) => SecretSource::Env(name),
            (None, Some(path)) => SecretSource::File(path),
            (None, None) => SecretSource::Api,
        }
    }

    /// How it is presented (the spec is validated: exactly one way).
    pub fn presentation(&self) -> Presentation {
        if let Some(user) = &self.basic_user {
            return Presentation::Basic { user: user.clone() };
        }
        if let Some(name) = &self.query {
            return Presentation::Query { name: name.clone() };
        }
        let name = self
            .header
            .clone()
            .unwrap_or_else(|| "Authorization".to_owned());
        let template = self.format.clone().unwrap_or_else(|| {
            if name.eq_ignore_ascii_case("authorization") {
                format!("Bearer {SECRET_MARK}")
            } else {
                SECRET_MARK.to_owned()
            }
        });
        Presentation::Header { name, template }
    }

    /// The sandbox's variable holding the placeholder of secret `name`.
    pub fn placeholder_var(&self, name: &str) -> String {
        self.placeholder_env.clone().unwrap_or_else(|| {
            format!(
                "TASKBOX_SECRET_{}",
                name.to_ascii_uppercase().replace('-', "_")
            )
        })
    }
}

/// Secret names: what the trace, the metrics and the API call them.
pub fn is_secret_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && name.as_bytes()[0].is_ascii_alphanumeric()
}

/// HTTP header names are tokens (RFC 9110).
fn is_token(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Headers whose value a secret must not be: the proxy and the connection own them.
const RESERVED_HEADERS: &[&str] = &[
    "host",
    "connection",
    "content-length",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "keep-alive",
    "proxy-authorization",
    "proxy-connection",
    "cookie",
];

/// Checks one host list of a secret or a request rule: names only, never everything, never an
/// address (what the proxy verifies in the upstream's certificate is a name).
pub(crate) fn check_inspected_hosts(
    key: &str,
    hosts: &[HostPattern],
    what: &str,
) -> Result<(), ValidationError> {
    if hosts.is_empty() {
        return Err(ValidationError::new(
            key,
            format!("lists no host; {what} must name the hosts it is for"),
        ));
    }
    for (index, pattern) in hosts.iter().enumerate() {
        let key = format!("{key}[{index}]");
        match &pattern.host {
            HostMatch::Any => {
                return Err(ValidationError::new(
                    key,
                    format!("\"{pattern}\" would mean every host; name the hosts {what} is for"),
                ));
            }
            HostMatch::Net(_) => {
                return Err(ValidationError::new(
                    key,
                    format!(
                        "\"{pattern}\" is an address pattern; {what} is bound to names (the name \
                         is what the proxy checks in the upstream's certificate)"
                    ),
                ));
            }
            HostMatch::Subdomains(suffix) if !suffix.contains('.') => {
                return Err(ValidationError::new(
                    key,
                    format!(
                        "\"{pattern}\" covers a whole top-level domain; name the hosts {what} is for"
                    ),
                ));
            }
            HostMatch::Exact(_) | HostMatch::Subdomains(_) => {}
        }
    }
    Ok(())
}

fn is_env_var(name: &str) -> bool {
    !name.is_empty()
        && !name.as_bytes()[0].is_ascii_digit()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Variables taskbox itself sets for inspected hosts: a placeholder may not take their place.
pub const CA_VARIABLES: &[&str] = &[
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO",
    "PIP_CERT",
    "CARGO_HTTP_CAINFO",
];

impl SecretSpec {
    /// Checks one `[secrets.NAME]` (`key` is `secrets.NAME`); `pass` is the policy's
    /// `env.pass`, which must not let the secret's variable into the sandbox.
    pub(crate) fn validate(&self, key: &str, pass: &[String]) -> Result<(), ValidationError> {
        let sources = usize::from(self.from_env.is_some())
            + usize::from(self.from_file.is_some())
            + usize::from(self.from_api);
        if sources != 1 {
            return Err(ValidationError::new(
                key,
                format!(
                    "give exactly one of from_env, from_file and from_api (it has {sources}): \
                     where the supervisor finds the value"
                ),
            ));
        }
        if let Some(var) = &self.from_env {
            let key = format!("{key}.from_env");
            if !is_env_var(var) {
                return Err(ValidationError::new(
                    key,
                    format!("{var:?} is not a variable name"),
                ));
            }
            if let Some((index, entry)) = pass.iter().enumerate().find(|(_, p)| passes(p, var)) {
                return Err(ValidationError::new(
                    key,
                    format!(
                        "{var} is also passed into the sandbox by env.pass[{index}] ({entry:?}); \
                         a secret's variable must never reach the sandbox"
                    ),
                ));
            }
        }
        if let Some(path) = &self.from_file
            && !path.starts_with('/')
        {
            return Err(ValidationError::new(
                format!("{key}.from_file"),
                format!("{path:?} must be an absolute path"),
            ));
        }
        check_inspected_hosts(&format!("{key}.hosts"), &self.hosts, "a secret")?;
        let ways = usize::from(self.header.is_some())
            + usize::from(self.basic_user.is_some())
            + usize::from(self.query.is_some());
        if ways != 1 {
            return Err(ValidationError::new(
                key,
                format!(
                    "give exactly one of header, basic_user and query (it has {ways}): how the \
                     proxy presents the secret"
                ),
            ));
        }
        if let Some(header) = &self.header {
            let key = format!("{key}.header");
            if !is_token(header) {
                return Err(ValidationError::new(
                    key,
                    format!("{header:?} is not a header name"),
                ));
            }
            if RESERVED_HEADERS
                .iter()
                .any(|h| header.eq_ignore_ascii_case(h))
                || header.to_ascii_lowercase().starts_with("proxy-")
            {
                return Err(ValidationError::new(
                    key,
                    format!("{header:?} is not a header a secret may be presented in"),
                ));
            }
        }
        if let Some(format) = &self.format {
            let key = format!("{key}.format");
            if self.header.is_none() {
                return Err(ValidationError::new(key, "only applies with header"));
            }
            if format.matches(SECRET_MARK).count() != 1 {
                return Err(ValidationError::new(
                    key,
                    format!("must hold {SECRET_MARK} once: where the secret goes"),
                ));
            }
            if format.chars().any(char::is_control) {
                return Err(ValidationError::new(key, "holds a control character"));
            }
        }
        if let Some(user) = &self.basic_user
            && (user.contains(':') || user.chars().any(char::is_control))
        {
            return Err(ValidationError::new(
                format!("{key}.basic_user"),
                format!("{user:?} may not hold ':' or control characters"),
            ));
        }
        if let Some(name) = &self.query
            && (name.is_empty()
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.~".contains(&b)))
        {
            return Err(ValidationError::new(
                format!("{key}.query"),
                format!("{name:?} is not a plain query parameter name"),
            ));
        }
        if let Some(var) = &self.placeholder_env {
            let key = format!("{key}.placeholder_env");
            if !is_env_var(var) {
                return Err(ValidationError::new(
                    key,
                    format!("{var:?} is not a variable name"),
                ));
            }
            if CA_VARIABLES.contains(&var.as_str()) {
                return Err(ValidationError::new(
                    key,
                    format!("{var} is set by taskbox to the sandbox's CA bundle"),
                ));
            }
        }
        Ok(())
    }
}

/// Whether an `env.pass` entry (a name, or a prefix ending in `*`) lets `var` through.
fn passes(entry: &str, var: &str) -> bool {
    match entry.strip_suffix('*') {
        Some(prefix) => var.starts_with(prefix),
        None => entry == var,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presentation_defaults() {
        let mut s = SecretSpec {
            from_env: Some("T".into()),
            from_file: None,
            from_api: false,
            hosts: vec!["api.test".parse().unwrap()],
            header: Some("Authorization".into()),
            format: None,
            basic_user: None,
            query: None,
            placeholder_env: None,
        };
        assert_eq!(
            s.presentation(),
            Presentation::Header {
                name: "Authorization".into(),
                template: "Bearer {secret}".into()
            }
        );
        s.header = Some("X-Api-Key".into());
        assert_eq!(
            s.presentation(),
            Presentation::Header {
                name: "X-Api-Key".into(),
                template: "{secret}".into()
            }
        );
        assert_eq!(s.placeholder_var("my-key"), "TASKBOX_SECRET_MY_KEY");
        assert!(passes("GIT*", "GITHUB_TOKEN"));
        assert!(!passes("GIT", "GITHUB_TOKEN"));
    }
}
