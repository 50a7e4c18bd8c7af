//! Request rules: what an HTTP request to an inspected host may do (`[[network.requests]]`).
//!
//! ```toml
//! [[network.requests]]
//! hosts = ["pkg.example.com"]
//! allow = ["GET /simple/**", "HEAD /simple/**", "GET /files/*.whl"]
//! deny = ["POST"]
//! deny_reason = "the package index is read-only for this task"
//! ```
//!
//! A host matched by an entry's `hosts` is *inspected*: the egress proxy terminates its TLS with
//! the sandbox's own CA and reads every request (see `docs/secrets.md`). For one request, every
//! entry whose `hosts` match is consulted: a `deny` pattern of any of them refuses it (deny
//! wins); else an `allow` pattern of any of them lets it through; else, when one of them has an
//! `allow` list, it is refused (an allow list means "only these"); else it goes through. A
//! refusal carries the `deny_reason` of the entry that refused it.
//!
//! A pattern is `METHOD PATH`, `METHOD` or `PATH`: the method exactly (uppercase) or `*`; the
//! path a glob over `/`-separated segments of the request's path (its query left out), where
//! `**` is any number of segments (none included) and `*` any run of characters within one
//! segment.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::netpattern::HostPattern;

/// One `[[network.requests]]` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestRules {
    /// The hosts it is about: names (`pkg.example.com`, `*.example.com`), optionally with
    /// `:PORT`; no addresses and no `*`.
    #[serde(default)]
    pub hosts: Vec<HostPattern>,
    /// Requests let through; when not empty, other requests to these hosts are refused.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<RequestPattern>,
    /// Requests refused, even when `allow` (of this entry or another) matches them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<RequestPattern>,
    /// Said to the client (in the 403's body) and to the model (in the violation) when this
    /// entry refuses a request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deny_reason: Option<String>,
}

/// A request pattern: a method (or any), a path glob (or any path).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestPattern {
    /// `None`: any method (`*`, or a pattern of a path alone).
    pub method: Option<String>,
    /// `None`: any path (a pattern of a method alone).
    pub path: Option<PathGlob>,
}

/// A glob over a path's segments (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PathGlob {
    text: String,
    segments: Vec<String>,
}

impl PathGlob {
    /// Whether `path` (a decoded path beginning with `/`, without its query) matches.
    pub fn matches(&self, path: &str) -> bool {
        let Some(rest) = path.strip_prefix('/') else {
            return false;
        };
        let segments: Vec<&str> = rest.split('/').collect();
        let pattern: Vec<&str> = self.segments.iter().map(String::as_str).collect();
        match_segments(&pattern, &segments)
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }
}

fn match_segments(pattern: &[&str], path: &[&str]) -> bool {
    match pattern.split_first() {
        None => path.is_empty(),
        Some((&"**", rest)) => (0..=path.len()).any(|skip| match_segments(rest, &path[skip..])),
        Some((first, rest)) => match path.split_first() {
            Some((segment, path_rest)) => {
                match_wildcard(first.as_bytes(), segment.as_bytes())
                    && match_segments(rest, path_rest)
            }
            None => false,
        },
    }
}

/// `*` matches any run of bytes (within one segment: the caller split on `/`).
fn match_wildcard(pattern: &[u8], text: &[u8]) -> bool {
    // Iterative, with one backtrack point: linear in practice, never exponential.
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() && pattern[p] == b'*' {
            star = Some((p, t));
            p += 1;
        } else if p < pattern.len() && pattern[p] == text[t] {
            p += 1;
            t += 1;
        } else if let Some((sp, st)) = star {
            p = sp + 1;
            t = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|b| *b == b'*')
}

impl RequestPattern {
    /// Whether a request with `method` for `path` (decoded, without its query) matches.
    pub fn matches(&self, method: &str, path: &str) -> bool {
        self.method.as_deref().is_none_or(|m| m == method)
            && self.path.as_ref().is_none_or(|glob| glob.matches(path))
    }
}

/// Methods are tokens (RFC 9110): letters, digits and a few marks; taskbox wants them in
/// uppercase, as clients send them.
fn is_method(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 32
        && text
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b"-_".contains(&b))
}

impl FromStr for RequestPattern {
    type Err = String;

    fn from_str(text: &str) -> Result<RequestPattern, String> {
        let words: Vec<&str> = text.split_whitespace().collect();
        let (method, path) = match words.as_slice() {
            [one] if one.starts_with('/') => (None, Some(*one)),
            [one] => (Some(*one), None),
            [method, path] => (Some(*method), Some(*path)),
            [] => return Err("empty pattern".to_owned()),
            _ => {
                return Err(
                    "expected METHOD PATH, METHOD or PATH (as in \"GET /simple/**\")".to_owned(),
                );
            }
        };
        let method = match method {
            None | Some("*") => None,
            Some(m) if is_method(m) => Some(m.to_owned()),
            Some(m) if is_method(&m.to_ascii_uppercase()) => {
                return Err(format!(
                    "write the method in uppercase: {}",
                    m.to_ascii_uppercase()
                ));
            }
            Some(m) => return Err(format!("{m:?} is not an HTTP method (or *)")),
        };
        let path = match path {
            None => None,
            Some(p) => Some(p.parse::<PathGlob>()?),
        };
        Ok(RequestPattern { method, path })
    }
}

impl FromStr for PathGlob {
    type Err = String;

    fn from_str(text: &str) -> Result<PathGlob, String> {
        let Some(rest) = text.strip_prefix('/') else {
            return Err(format!("the path {text:?} must start with '/'"));
        };
        if text.contains(['?', '#']) {
            return Err(format!(
                "the path {text:?} has a query or fragment; paths are matched without them"
            ));
        }
        if let Some(bad) = text.chars().find(|c| c.is_control() || *c == '\\') {
            return Err(format!("the path {text:?} contains {bad:?}"));
        }
        let segments: Vec<String> = rest.split('/').map(str::to_owned).collect();
        for segment in &segments {
            if segment.contains("**") && segment != "**" {
                return Err(format!(
                    "in {text:?}, '**' must be a whole segment (as in /a/**/b)"
                ));
            }
            if segment == "." || segment == ".." {
                return Err(format!(
                    "the path {text:?} has a {segment:?} segment; requests with one are refused \
                     anyway"
                ));
            }
        }
        Ok(PathGlob {
            text: text.to_owned(),
            segments,
        })
    }
}

impl fmt::Display for RequestPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.method, &self.path) {
            (Some(m), Some(p)) => write!(f, "{m} {}", p.text),
            (Some(m), None) => f.write_str(m),
            (None, Some(p)) => f.write_str(&p.text),
            (None, None) => f.write_str("*"),
        }
    }
}

impl Serialize for RequestPattern {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for RequestPattern {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(|reason| {
            serde::de::Error::custom(format!("invalid request pattern {text:?}: {reason}"))
        })
    }
}

/// What the request rules say about one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestVerdict {
    /// No entry is about this host.
    NotInspected,
    /// Let through; the pattern that allowed it, if one did (entries of deny lists alone let
    /// everything else through).
    Allow { rule: Option<String> },
    /// Refused: which entry (its index in `network.requests`), by which pattern (none: not in
    /// the entry's allow list), and the entry's reason.
    Deny {
        entry: usize,
        rule: Option<String>,
        reason: Option<String>,
    },
}

/// Decides one request to `host:port` (a normalised name) by `rules` (see the module doc).
pub fn check_request(
    rules: &[RequestRules],
    host: &str,
    port: u16,
    method: &str,
    path: &str,
) -> RequestVerdict {
    let about: Vec<(usize, &RequestRules)> = rules
        .iter()
        .enumerate()
        .filter(|(_, r)| r.hosts.iter().any(|h| h.matches_name(host, port)))
        .collect();
    if about.is_empty() {
        return RequestVerdict::NotInspected;
    }
    for (entry, r) in &about {
        if let Some(p) = r.deny.iter().find(|p| p.matches(method, path)) {
            return RequestVerdict::Deny {
                entry: *entry,
                rule: Some(format!("deny {p}")),
                reason: r.deny_reason.clone(),
            };
        }
    }
    for (_, r) in &about {
        if let Some(p) = r.allow.iter().find(|p| p.matches(method, path)) {
            return RequestVerdict::Allow {
                rule: Some(format!("allow {p}")),
            };
        }
    }
    match about.iter().find(|(_, r)| !r.allow.is_empty()) {
        Some((entry, r)) => RequestVerdict::Deny {
            entry: *entry,
            rule: None,
            reason: r.deny_reason.clone(),
        },
        None => RequestVerdict::Allow { rule: None },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str) -> RequestPattern {
        text.parse().unwrap()
    }

    #[test]
    fn patterns_parse_and_print_back() {
        for text in ["GET /simple/**", "POST", "/health", "* /a/*.whl", "HEAD /"] {
            let printed = p(text).to_string();
            assert_eq!(p(&printed), p(text), "{text}");
        }
        assert_eq!(p("* /x").method, None);
        for (bad, why) in [
            ("", "empty"),
            ("get /x", "uppercase: GET"),
            ("GET simple", "must start with '/'"),
            ("GET /a/b**/c", "whole segment"),
            ("GET /a/../b", "\"..\" segment"),
            ("GET /a?x=1", "query"),
            ("GET /a b", "expected METHOD PATH"),
            ("G{T /a", "not an HTTP method"),
        ] {
            let err = bad.parse::<RequestPattern>().unwrap_err();
            assert!(err.contains(why), "{bad:?}: {err}");
        }
    }

    #[test]
    fn globs_match_segments() {
        let g = |t: &str| t.parse::<PathGlob>().unwrap();
        assert!(g("/simple/**").matches("/simple"));
        assert!(g("/simple/**").matches("/simple/"));
        assert!(g("/simple/**").matches("/simple/a/b/c"));
        assert!(!g("/simple/**").matches("/simplex/a"));
        assert!(!g("/simple/**").matches("/other/simple/a"));
        assert!(g("/files/*.whl").matches("/files/a-1.0.whl"));
        assert!(!g("/files/*.whl").matches("/files/a/b.whl"));
        assert!(g("/a/**/z").matches("/a/z"));
        assert!(g("/a/**/z").matches("/a/b/c/z"));
        assert!(!g("/a/**/z").matches("/a/b/c/zz"));
        assert!(g("/**").matches("/anything/at/all"));
        assert!(g("/").matches("/"));
        assert!(!g("/").matches("/a"));
        assert!(!g("/a").matches("a"));
        // No exponential blow-up on many stars.
        let many = format!("/{}", "*a".repeat(30));
        assert!(!g(&many).matches(&format!("/{}", "a".repeat(29))));
    }

    fn entry(hosts: &[&str], allow: &[&str], deny: &[&str], reason: Option<&str>) -> RequestRules {
        RequestRules {
            hosts: hosts.iter().map(|h| h.parse().unwrap()).collect(),
            allow: allow.iter().map(|x| p(x)).collect(),
            deny: deny.iter().map(|x| p(x)).collect(),
            deny_reason: reason.map(str::to_owned),
        }
    }

    #[test]
    fn deny_wins_and_an_allow_list_means_only_these() {
        let rules = vec![
            entry(
                &["pkg.test"],
                &["GET /simple/**", "HEAD /simple/**"],
                &[],
                Some("read-only index"),
            ),
            entry(
                &["pkg.test", "*.pkg.test"],
                &[],
                &["POST"],
                Some("no uploads"),
            ),
        ];
        let check = |host: &str, m: &str, path: &str| check_request(&rules, host, 443, m, path);
        assert_eq!(
            check("pkg.test", "GET", "/simple/x/"),
            RequestVerdict::Allow {
                rule: Some("allow GET /simple/**".into())
            }
        );
        assert_eq!(
            check("pkg.test", "POST", "/simple/x/"),
            RequestVerdict::Deny {
                entry: 1,
                rule: Some("deny POST".into()),
                reason: Some("no uploads".into())
            }
        );
        assert_eq!(
            check("pkg.test", "GET", "/admin"),
            RequestVerdict::Deny {
                entry: 0,
                rule: None,
                reason: Some("read-only index".into())
            }
        );
        // Only the deny-only entry is about a subdomain: the rest goes through.
        assert_eq!(
            check("a.pkg.test", "GET", "/admin"),
            RequestVerdict::Allow { rule: None }
        );
        assert_eq!(
            check("pkg.test.evil", "POST", "/"),
            RequestVerdict::NotInspected
        );
        assert_eq!(check("pkgtest", "POST", "/"), RequestVerdict::NotInspected);
    }
}
