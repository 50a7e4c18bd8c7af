//! Host patterns of a policy's `[network]` section, and the hosts they are matched against.
//!
//! A pattern ([`HostPattern`]) is one of
//!
//! | pattern | matches |
//! |---|---|
//! | `example.com` | exactly that name (case-insensitive, a trailing dot ignored) |
//! | `*.example.com` | strict subdomains: `a.example.com`, `a.b.example.com`, never `example.com` itself |
//! | `192.0.2.7`, `2001:db8::7` | that address, when the client asks for it as a literal |
//! | `192.0.2.0/24`, `2001:db8::/32` | any address in the range |
//! | `*` | every host (refused in `allow` by the policy; meant for `deny`) |
//!
//! each optionally followed by `:PORT` (`example.com:443`, `[2001:db8::7]:443`,
//! `[2001:db8::/32]:443`); without a port a pattern matches every port. Names are plain ASCII
//! (internationalised names in their `xn--` form). Name patterns match the name a client asked for,
//! never the addresses it resolves to; address patterns match an address, whether the client gave it
//! as a literal or the egress proxy resolved a name to it (how the proxy combines the two is
//! documented in `docs/egress.md`). IPv4-mapped IPv6 addresses (`::ffff:10.0.0.1`) are the IPv4
//! address they map, both in patterns and in targets.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// One allow or deny rule: a host part and an optional port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostPattern {
    pub host: HostMatch,
    /// `None` matches every port.
    pub port: Option<u16>,
}

/// The host part of a [`HostPattern`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HostMatch {
    /// `*`: every host.
    Any,
    /// A name, lowercase, without a trailing dot.
    Exact(String),
    /// `*.SUFFIX`: names that end in `.SUFFIX` and have at least one more label; holds `SUFFIX`.
    Subdomains(String),
    /// An address range; a single address has the full prefix length (32 or 128).
    Net(IpNet),
}

/// An IP address range: an address whose bits past `prefix` are zero, and the prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpNet {
    addr: IpAddr,
    prefix: u8,
}

impl IpNet {
    /// The range of `addr`/`prefix`; `None` when the prefix is too long or `addr` has bits set past
    /// it. IPv4-mapped IPv6 ranges of prefix 96 or more become IPv4 ranges.
    pub fn new(addr: IpAddr, prefix: u8) -> Option<IpNet> {
        let (addr, prefix) = match addr {
            IpAddr::V6(v6) if prefix >= 96 => match v6.to_ipv4_mapped() {
                Some(v4) => (IpAddr::V4(v4), prefix - 96),
                None => (addr, prefix),
            },
            _ => (addr, prefix),
        };
        let net = IpNet { addr, prefix };
        if prefix > net.max_prefix() || net.network_bits() != net.addr_bits() {
            return None;
        }
        Some(net)
    }

    /// The range holding exactly `addr`.
    pub fn host(addr: IpAddr) -> IpNet {
        let addr = canonical_ip(addr);
        let prefix = if addr.is_ipv4() { 32 } else { 128 };
        IpNet { addr, prefix }
    }

    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// The range is one address.
    pub fn is_host(&self) -> bool {
        self.prefix == self.max_prefix()
    }

    /// Whether `ip` (canonicalised: IPv4-mapped addresses count as IPv4) lies in the range.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical_ip(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                mask32(u32::from(ip), self.prefix) == u32::from(net)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                mask128(u128::from(ip), self.prefix) == u128::from(net)
            }
            _ => false,
        }
    }

    fn max_prefix(&self) -> u8 {
        if self.addr.is_ipv4() { 32 } else { 128 }
    }

    fn addr_bits(&self) -> u128 {
        match self.addr {
            IpAddr::V4(v4) => u128::from(u32::from(v4)),
            IpAddr::V6(v6) => u128::from(v6),
        }
    }

    fn network_bits(&self) -> u128 {
        match self.addr {
            IpAddr::V4(v4) => u128::from(mask32(u32::from(v4), self.prefix.min(32))),
            IpAddr::V6(v6) => mask128(u128::from(v6), self.prefix.min(128)),
        }
    }
}

impl fmt::Display for IpNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_host() {
            write!(f, "{}", self.addr)
        } else {
            write!(f, "{}/{}", self.addr, self.prefix)
        }
    }
}

fn mask32(bits: u32, prefix: u8) -> u32 {
    match prefix {
        0 => 0,
        p => bits & (u32::MAX << (32 - u32::from(p.min(32)))),
    }
}

fn mask128(bits: u128, prefix: u8) -> u128 {
    match prefix {
        0 => 0,
        p => bits & (u128::MAX << (128 - u32::from(p.min(128)))),
    }
}

/// `addr`, with an IPv4-mapped IPv6 address replaced by the IPv4 address it maps.
pub fn canonical_ip(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => addr,
        },
        v4 => v4,
    }
}

/// A host a client asked for: a name or an address literal.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Host {
    /// A name, lowercase, without a trailing dot.
    Name(String),
    /// An address (IPv4-mapped IPv6 given as IPv4).
    Ip(IpAddr),
}

impl Host {
    /// Parses what a client sent as a host: a name, an IPv4 literal, or an IPv6 literal with or
    /// without brackets. Names are lowercased and lose a trailing dot.
    pub fn parse(text: &str) -> Result<Host, String> {
        let inner = text
            .strip_prefix('[')
            .and_then(|rest| rest.strip_suffix(']'));
        if let Some(inner) = inner {
            return inner
                .parse::<Ipv6Addr>()
                .map(|v6| Host::Ip(canonical_ip(IpAddr::V6(v6))))
                .map_err(|_| format!("{text:?} is not a valid IPv6 address"));
        }
        if let Ok(ip) = text.parse::<IpAddr>() {
            return Ok(Host::Ip(canonical_ip(ip)));
        }
        normalize_name(text).map(Host::Name)
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Name(name) => f.write_str(name),
            Host::Ip(IpAddr::V6(v6)) => write!(f, "[{v6}]"),
            Host::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// Lowercases a host name and removes one trailing dot; an error says why the text is not a name.
/// Labels hold ASCII letters, digits, `-` and `_` (1 to 63 of them); the name is at most 253
/// characters and its last label is not all digits (that would be a malformed address).
pub fn normalize_name(text: &str) -> Result<String, String> {
    let name = text.strip_suffix('.').unwrap_or(text);
    if name.is_empty() {
        return Err("empty host name".to_owned());
    }
    if !name.is_ascii() {
        return Err(format!(
            "{text:?} is not ASCII; write internationalised names in their xn-- form"
        ));
    }
    if name.len() > 253 {
        return Err(format!("{text:?} is longer than 253 characters"));
    }
    let name = name.to_ascii_lowercase();
    for label in name.split('.') {
        if label.is_empty() {
            return Err(format!("{text:?} has an empty label"));
        }
        if label.len() > 63 {
            return Err(format!("{text:?} has a label longer than 63 characters"));
        }
        if let Some(bad) = label
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
        {
            return Err(format!(
                "{text:?} contains {bad:?}; a host name holds only letters, digits, '-', '_' and '.'"
            ));
        }
    }
    if name
        .rsplit('.')
        .next()
        .is_some_and(|last| last.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(format!("{text:?} is not a valid IP address"));
    }
    Ok(name)
}

impl HostPattern {
    /// Whether the pattern matches a client's request for `name` on `port` (a name, normalised by
    /// [`normalize_name`]). Address patterns never match a name.
    pub fn matches_name(&self, name: &str, port: u16) -> bool {
        self.port_matches(port)
            && match &self.host {
                HostMatch::Any => true,
                HostMatch::Exact(exact) => exact == name,
                HostMatch::Subdomains(suffix) => name
                    .strip_suffix(suffix.as_str())
                    .and_then(|head| head.strip_suffix('.'))
                    .is_some_and(|head| !head.is_empty()),
                HostMatch::Net(_) => false,
            }
    }

    /// Whether the pattern matches a connection to `ip` on `port`. Name patterns never match an
    /// address.
    pub fn matches_ip(&self, ip: IpAddr, port: u16) -> bool {
        self.port_matches(port)
            && match &self.host {
                HostMatch::Any => true,
                HostMatch::Net(net) => net.contains(ip),
                HostMatch::Exact(_) | HostMatch::Subdomains(_) => false,
            }
    }

    /// Whether the pattern matches `host` on `port`.
    pub fn matches(&self, host: &Host, port: u16) -> bool {
        match host {
            Host::Name(name) => self.matches_name(name, port),
            Host::Ip(ip) => self.matches_ip(*ip, port),
        }
    }

    /// The pattern lets everything through: `*` or a `/0` range, with or without a port.
    pub fn is_catch_all(&self) -> bool {
        match &self.host {
            HostMatch::Any => true,
            HostMatch::Net(net) => net.prefix() == 0,
            HostMatch::Exact(_) | HostMatch::Subdomains(_) => false,
        }
    }

    fn port_matches(&self, port: u16) -> bool {
        self.port.is_none_or(|p| p == port)
    }
}

impl FromStr for HostPattern {
    type Err = String;

    /// Parses a pattern; the error says what is wrong with it (without repeating it).
    fn from_str(text: &str) -> Result<HostPattern, String> {
        if text.trim() != text || text.is_empty() {
            return Err(if text.trim().is_empty() {
                "empty pattern".to_owned()
            } else {
                "leading or trailing spaces".to_owned()
            });
        }
        if text.contains("://") {
            return Err("give a host, not a URL (no scheme)".to_owned());
        }
        let (host, port, bracketed) = split_port(text)?;
        let port = port.map(parse_port).transpose()?;
        let host = parse_host_part(host)?;
        if bracketed && !matches!(&host, HostMatch::Net(net) if net.addr().is_ipv6()) {
            return Err(
                "brackets hold an IPv6 address or range, like [2001:db8::1]:443".to_owned(),
            );
        }
        Ok(HostPattern { host, port })
    }
}

/// Splits `HOST[:PORT]`, where an IPv6 host with a port is bracketed (`[::1]:443`) and an unbracketed
/// host with more than one `:` is an IPv6 address without a port.
fn split_port(text: &str) -> Result<(&str, Option<&str>, bool), String> {
    if let Some(rest) = text.strip_prefix('[') {
        let Some((inner, after)) = rest.split_once(']') else {
            return Err("'[' without a closing ']'".to_owned());
        };
        return match after {
            "" => Ok((inner, None, true)),
            _ => match after.strip_prefix(':') {
                Some(port) => Ok((inner, Some(port), true)),
                None => Err(format!("unexpected {after:?} after ']'")),
            },
        };
    }
    match text.matches(':').count() {
        0 => Ok((text, None, false)),
        1 => {
            let (host, port) = text.split_once(':').unwrap_or((text, ""));
            Ok((host, Some(port), false))
        }
        _ => Ok((text, None, false)),
    }
}

fn parse_port(text: &str) -> Result<u16, String> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("port {text:?} is not a number from 1 to 65535"));
    }
    match text.parse::<u16>() {
        Ok(port) if port > 0 => Ok(port),
        _ => Err(format!("port {text} is not a number from 1 to 65535")),
    }
}

fn parse_host_part(host: &str) -> Result<HostMatch, String> {
    if host == "*" {
        return Ok(HostMatch::Any);
    }
    if let Some(suffix) = host.strip_prefix("*.") {
        if suffix.contains('*') {
            return Err("'*' may only be the whole first label, as in *.example.com".to_owned());
        }
        if suffix.parse::<IpAddr>().is_ok() || suffix.contains('/') {
            return Err(
                "'*.' needs a domain; for an address range use CIDR, like 10.0.0.0/8".to_owned(),
            );
        }
        return normalize_name(suffix).map(HostMatch::Subdomains);
    }
    if host.contains('*') {
        return Err("'*' may only be the whole first label, as in *.example.com".to_owned());
    }
    if let Some((addr, prefix)) = host.split_once('/') {
        let ip = addr
            .parse::<IpAddr>()
            .map_err(|_| format!("{addr:?} is not an IP address"))?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        let prefix = prefix
            .parse::<u8>()
            .ok()
            .filter(|p| *p <= max && !prefix.starts_with('+'))
            .ok_or_else(|| format!("prefix length {prefix:?} is not a number from 0 to {max}"))?;
        return IpNet::new(ip, prefix).map(HostMatch::Net).ok_or_else(|| {
            let net = IpNet::new(masked(ip, prefix), prefix);
            match net {
                Some(net) => format!("host bits are set past the prefix; did you mean {net}?"),
                None => "not a valid range".to_owned(),
            }
        });
    }
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(HostMatch::Net(IpNet::host(ip)));
    }
    normalize_name(host).map(HostMatch::Exact)
}

fn masked(ip: IpAddr, prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(Ipv4Addr::from(mask32(u32::from(v4), prefix))),
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(mask128(u128::from(v6), prefix))),
    }
}

impl fmt::Display for HostPattern {
    /// The canonical spelling, which parses back to the same pattern.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let host = match &self.host {
            HostMatch::Any => "*".to_owned(),
            HostMatch::Exact(name) => name.clone(),
            HostMatch::Subdomains(suffix) => format!("*.{suffix}"),
            HostMatch::Net(net) => net.to_string(),
        };
        match self.port {
            None => f.write_str(&host),
            Some(port) if matches!(self.host, HostMatch::Net(net) if net.addr().is_ipv6()) => {
                write!(f, "[{host}]:{port}")
            }
            Some(port) => write!(f, "{host}:{port}"),
        }
    }
}

impl Serialize for HostPattern {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HostPattern {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(|reason| {
            serde::de::Error::custom(format!("invalid pattern {text:?}: {reason}"))
        })
    }
}

impl schemars::JsonSchema for HostPattern {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "HostPattern".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        String::json_schema(generator)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(text: &str) -> HostPattern {
        text.parse()
            .unwrap_or_else(|err| panic!("{text:?} should parse: {err}"))
    }

    fn bad(text: &str) -> String {
        match text.parse::<HostPattern>() {
            Ok(p) => panic!("{text:?} should be refused, parsed {p:?}"),
            Err(err) => err,
        }
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn exact_names_are_case_insensitive_and_ignore_a_trailing_dot() {
        let p = pattern("Example.COM.");
        assert_eq!(p.to_string(), "example.com");
        assert!(p.matches_name("example.com", 443));
        assert!(!p.matches_name("www.example.com", 443));
        assert!(!p.matches_name("example.com.evil", 443));
        assert!(!p.matches_name("notexample.com", 443));
        assert_eq!(
            Host::parse("EXAMPLE.com.").unwrap(),
            Host::Name("example.com".into())
        );
    }

    #[test]
    fn wildcard_means_strict_subdomains() {
        let p = pattern("*.example.com");
        assert!(p.matches_name("a.example.com", 80));
        assert!(p.matches_name("a.b.example.com", 80));
        assert!(!p.matches_name("example.com", 80));
        assert!(!p.matches_name("badexample.com", 80));
        assert!(!p.matches_name("a.example.com.evil", 80));
        assert!(!p.matches_ip(ip("192.0.2.1"), 80));
    }

    #[test]
    fn ports() {
        let p = pattern("example.com:443");
        assert!(p.matches_name("example.com", 443));
        assert!(!p.matches_name("example.com", 80));
        let p = pattern("[2001:db8::7]:443");
        assert_eq!(p.to_string(), "[2001:db8::7]:443");
        assert!(p.matches_ip(ip("2001:db8::7"), 443));
        assert!(!p.matches_ip(ip("2001:db8::7"), 22));
        let p = pattern("[2001:db8::/32]:443");
        assert_eq!(p.to_string(), "[2001:db8::/32]:443");
        assert!(p.matches_ip(ip("2001:db8:1::1"), 443));
        assert_eq!(pattern("10.0.0.0/8:22").to_string(), "10.0.0.0/8:22");
        assert!(pattern("*:25").matches_name("mail.example.com", 25));
        assert!(!pattern("*:25").matches_name("mail.example.com", 587));
    }

    #[test]
    fn addresses_and_ranges() {
        let p = pattern("10.0.0.0/8");
        assert!(p.matches_ip(ip("10.1.2.3"), 1));
        assert!(p.matches_ip(ip("::ffff:10.1.2.3"), 1));
        assert!(!p.matches_ip(ip("11.0.0.1"), 1));
        assert!(!p.matches_name("10.example", 1));
        let p = pattern("2001:db8::7");
        assert!(p.matches_ip(ip("2001:db8::7"), 1));
        assert!(!p.matches_ip(ip("2001:db8::8"), 1));
        let p = pattern("::ffff:192.0.2.1");
        assert_eq!(p.to_string(), "192.0.2.1");
        assert!(p.matches_ip(ip("192.0.2.1"), 1));
        assert_eq!(pattern("::ffff:10.0.0.0/104").to_string(), "10.0.0.0/8");
        assert!(pattern("0.0.0.0/0").is_catch_all());
        assert!(pattern("*").is_catch_all());
        assert!(pattern("*:443").is_catch_all());
        assert!(!pattern("*.com").is_catch_all());
        assert_eq!(
            Host::parse("[::ffff:127.0.0.1]").unwrap(),
            Host::Ip(ip("127.0.0.1"))
        );
    }

    #[test]
    fn malformed_patterns_say_why() {
        assert_eq!(bad(""), "empty pattern");
        assert_eq!(bad(" example.com"), "leading or trailing spaces");
        assert_eq!(
            bad("https://example.com"),
            "give a host, not a URL (no scheme)"
        );
        assert!(bad("*.").contains("empty host name"));
        assert!(bad("a.*.example.com").contains("'*' may only be"));
        assert!(bad("*example.com").contains("'*' may only be"));
        assert!(bad("**.example.com").contains("'*' may only be"));
        assert!(bad("example.com:0").contains("port 0 is not a number"));
        assert!(bad("example.com:65536").contains("port 65536"));
        assert!(bad("example.com:http").contains("port \"http\""));
        assert!(bad("example.com:").contains("port \"\""));
        assert!(bad("exa mple.com").contains("contains ' '"));
        assert!(bad("example..com").contains("empty label"));
        assert!(bad("example.com/path").contains("is not an IP address"));
        assert!(bad("10.0.0.1/33").contains("prefix length"));
        assert!(bad("10.0.0.1/8").contains("did you mean 10.0.0.0/8?"));
        assert!(bad("300.1.1.1").contains("not a valid IP address"));
        assert!(bad("1.2.3").contains("not a valid IP address"));
        assert!(bad("[::1").contains("without a closing"));
        assert!(bad("[::1]x").contains("after ']'"));
        assert!(bad("[example.com]:80").contains("brackets hold an IPv6"));
        assert!(bad("[10.0.0.1]:80").contains("brackets hold an IPv6"));
        assert!(bad("bücher.example").contains("xn--"));
        assert!(bad(&format!("{}.com", "a".repeat(64))).contains("longer than 63"));
    }

    #[test]
    fn display_round_trips() {
        for text in [
            "example.com",
            "*.example.com:8443",
            "*",
            "*:25",
            "192.0.2.7",
            "192.0.2.7:80",
            "10.0.0.0/8",
            "2001:db8::/32",
            "[2001:db8::/32]:443",
            "fd00:ec2::254",
        ] {
            assert_eq!(pattern(text).to_string(), text);
            assert_eq!(pattern(&pattern(text).to_string()), pattern(text));
        }
    }
}
