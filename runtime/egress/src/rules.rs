//! The decision: may a client connect to `host:port`, and to which addresses.
//!
//! [`Rules`] holds a policy's `[network]` rules; [`decide`] applies them to one request in this
//! order:
//!
//! 1. the host is parsed (a name or an address literal); a malformed one is refused;
//! 2. a `deny` pattern that matches the requested name or literal refuses it;
//! 3. an `allow` pattern must match it (name patterns match names, address patterns literals);
//! 4. a name is resolved — by `[network.hosts]` when it lists the name, else by the [`Resolver`] —
//!    and EVERY address must pass: no `deny` address pattern may match it, and a special address
//!    ([`crate::addr::classify`]) must be *named by the policy*: covered by an `allow` address
//!    pattern with a matching port (for a cloud metadata endpoint: a pattern of exactly that
//!    address), or listed in `[network.hosts]`. Unspecified, multicast and broadcast addresses
//!    never pass;
//! 5. the addresses checked are returned, and the proxy connects to those and no others (it never
//!    resolves again, so a rebinding DNS answer cannot slip in between check and connect).

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, PoisonError, RwLock};

use taskbox_core::netpattern::{Host, HostMatch, HostPattern, canonical_ip};
use taskbox_core::policy::Network;

use crate::addr::{Special, classify};

/// A policy's `[network]` rules, ready to match.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rules {
    allow: Vec<HostPattern>,
    deny: Vec<HostPattern>,
    hosts: BTreeMap<String, Vec<IpAddr>>,
}

impl Rules {
    /// Rules from patterns and a fixed resolver map (names lowercase, without a trailing dot, as
    /// the policy validates them). Unlike a policy file, this does not refuse a catch-all `allow`.
    pub fn new(
        allow: Vec<HostPattern>,
        deny: Vec<HostPattern>,
        hosts: BTreeMap<String, Vec<IpAddr>>,
    ) -> Rules {
        let hosts = hosts
            .into_iter()
            .map(|(name, addrs)| {
                let name = name.trim_end_matches('.').to_ascii_lowercase();
                (name, addrs.into_iter().map(canonical_ip).collect())
            })
            .collect();
        Rules { allow, deny, hosts }
    }

    /// The rules of a policy's `[network]` section (its `mode` is the caller's business).
    pub fn from_policy(network: &Network) -> Rules {
        Rules::new(
            network.allow.clone(),
            network.deny.clone(),
            network.hosts.clone(),
        )
    }

    pub fn allow(&self) -> &[HostPattern] {
        &self.allow
    }

    pub fn deny(&self) -> &[HostPattern] {
        &self.deny
    }

    /// Steps 1–3 of [`decide`]: the verdict on the request before any name is resolved. `Ok`
    /// holds the allow rule that matched.
    pub fn check_request(&self, host: &Host, port: u16) -> Result<&HostPattern, Denial> {
        let target = target_text(host, port);
        if let Some(rule) = self.deny.iter().find(|p| p.matches(host, port)) {
            return Err(Denial {
                reason: format!("matches \"{rule}\" in network.deny"),
                rule: Some(format!("deny {rule}")),
                hint: Some(format!(
                    "the policy refuses it on purpose; to allow it, remove \"{rule}\" from network.deny"
                )),
                ip: None,
            });
        }
        if let Some(rule) = self.allow.iter().find(|p| p.matches(host, port)) {
            return Ok(rule);
        }
        let hint = match host {
            Host::Name(_) => format!("to allow it, add \"{target}\" to network.allow"),
            Host::Ip(ip) => format!(
                "to allow it, add \"{target}\" to network.allow{}",
                special_note(*ip)
            ),
        };
        Err(Denial {
            reason: "not in allowlist".to_owned(),
            rule: None,
            hint: Some(hint),
            ip: None,
        })
    }

    /// Step 4 of [`decide`] for one address `ip` that `host` resolved to; `from_hosts`: the
    /// address came from `[network.hosts]`.
    pub fn check_address(
        &self,
        host: &Host,
        ip: IpAddr,
        port: u16,
        from_hosts: bool,
    ) -> Result<(), Denial> {
        let ip = canonical_ip(ip);
        let what = match host {
            Host::Name(name) => format!("{name} resolves to {ip}, which"),
            Host::Ip(_) => format!("{ip}"),
        };
        let address_rule =
            |p: &&HostPattern| matches!(p.host, HostMatch::Net(_)) && p.matches_ip(ip, port);
        if let Some(rule) = self.deny.iter().find(address_rule) {
            return Err(Denial {
                reason: format!("{what} matches \"{rule}\" in network.deny"),
                rule: Some(format!("deny {rule}")),
                hint: Some(format!(
                    "the policy refuses it on purpose; to allow it, remove \"{rule}\" from network.deny"
                )),
                ip: Some(ip),
            });
        }
        let Some(special) = classify(ip) else {
            return Ok(());
        };
        let target = target_text(&Host::Ip(ip), port);
        match special {
            Special::Never(kind) => Err(Denial {
                reason: format!("{what} is {kind}, never a destination"),
                rule: None,
                hint: None,
                ip: Some(ip),
            }),
            Special::Metadata => {
                let named = from_hosts
                    || self.allow.iter().any(|p| {
                        matches!(p.host, HostMatch::Net(net) if net.is_host())
                            && p.matches_ip(ip, port)
                    });
                if named {
                    return Ok(());
                }
                Err(Denial {
                    reason: format!("{what} is a cloud metadata endpoint"),
                    rule: None,
                    hint: Some(format!(
                        "it hands out the host's cloud credentials; only an allow rule naming the exact \
                         address reaches it: \"{target}\""
                    )),
                    ip: Some(ip),
                })
            }
            Special::Internal(kind) => {
                if from_hosts || self.allow.iter().any(|p| address_rule(&p)) {
                    return Ok(());
                }
                Err(Denial {
                    reason: format!("{what} is {kind}"),
                    rule: None,
                    hint: Some(format!(
                        "internal addresses are refused unless an allow rule names them; to allow it, \
                         add \"{target}\" (or its range) to network.allow"
                    )),
                    ip: Some(ip),
                })
            }
        }
    }

    /// The addresses `[network.hosts]` lists for `name`, if any.
    pub fn fixed_addresses(&self, name: &str) -> Option<&[IpAddr]> {
        self.hosts.get(name).map(Vec::as_slice)
    }
}

/// `host:port`, with an IPv6 literal in brackets.
fn target_text(host: &Host, port: u16) -> String {
    format!("{host}:{port}")
}

fn special_note(ip: IpAddr) -> &'static str {
    match classify(ip) {
        Some(Special::Never(_)) => " (but this address is never a destination)",
        _ => "",
    }
}

/// A refusal: why, by which rule (none when no rule matched), and what to change to allow it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    /// One line: "not in allowlist", "matches \"*.example.com\" in network.deny", ...
    pub reason: String,
    /// The rule that refused, as "deny PATTERN"; `None` when no rule allowed it.
    pub rule: Option<String>,
    /// What to add to or remove from the policy; `None` when nothing can allow it.
    pub hint: Option<String>,
    /// The address that was refused, when an address was the problem.
    pub ip: Option<IpAddr>,
}

/// The outcome of [`decide`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Connect to `addrs` (all checked, in resolver order) and nothing else.
    Allow {
        /// The allow pattern that matched.
        rule: HostPattern,
        addrs: Vec<IpAddr>,
    },
    /// Refused by the policy.
    Deny {
        denial: Denial,
        /// Every address the name resolved to (empty when refused before resolving).
        addrs: Vec<IpAddr>,
    },
    /// The host could not be resolved (not a policy decision).
    Unresolved { reason: String },
}

/// Resolves names to addresses. The proxy's own DNS lookups go through this; tests plug in fakes
/// (a resolver whose answers change between calls, for instance).
pub trait Resolver: Send + Sync + 'static {
    /// The addresses of `name` (normalised: lowercase, no trailing dot).
    fn resolve<'a>(
        &'a self,
        name: &'a str,
        port: u16,
    ) -> Pin<Box<dyn Future<Output = io::Result<Vec<IpAddr>>> + Send + 'a>>;
}

/// The host's resolver (`getaddrinfo`, through tokio).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

impl Resolver for SystemResolver {
    fn resolve<'a>(
        &'a self,
        name: &'a str,
        port: u16,
    ) -> Pin<Box<dyn Future<Output = io::Result<Vec<IpAddr>>> + Send + 'a>> {
        Box::pin(async move {
            let addrs = tokio::net::lookup_host((name, port)).await?;
            let mut ips: Vec<IpAddr> = Vec::new();
            for addr in addrs {
                if !ips.contains(&addr.ip()) {
                    ips.push(addr.ip());
                }
            }
            Ok(ips)
        })
    }
}

/// Decides on a request for `host` (a name or a literal) and `port`; see the module doc for the
/// steps. The resolver is asked at most once.
pub async fn decide(rules: &Rules, resolver: &dyn Resolver, host: &Host, port: u16) -> Verdict {
    let rule = match rules.check_request(host, port) {
        Ok(rule) => rule.clone(),
        Err(denial) => {
            return Verdict::Deny {
                denial,
                addrs: Vec::new(),
            };
        }
    };
    let (addrs, from_hosts) = match host {
        Host::Ip(ip) => (vec![*ip], false),
        Host::Name(name) => match rules.fixed_addresses(name) {
            Some(fixed) => (fixed.to_vec(), true),
            None => match resolver.resolve(name, port).await {
                Ok(addrs) if addrs.is_empty() => {
                    return Verdict::Unresolved {
                        reason: format!("cannot resolve {name}: no addresses"),
                    };
                }
                Ok(addrs) => (addrs.into_iter().map(canonical_ip).collect(), false),
                Err(err) => {
                    return Verdict::Unresolved {
                        reason: format!("cannot resolve {name}: {err}"),
                    };
                }
            },
        },
    };
    for ip in &addrs {
        if let Err(denial) = rules.check_address(host, *ip, port, from_hosts) {
            return Verdict::Deny { denial, addrs };
        }
    }
    Verdict::Allow { rule, addrs }
}

/// The rules of a live proxy, replaceable while it runs. Clones share the rules. A connection
/// is decided under the rules current when its request arrives; replacing them does not touch
/// connections already open.
#[derive(Debug, Clone, Default)]
pub struct RulesHandle(Arc<RwLock<Arc<Rules>>>);

impl RulesHandle {
    pub fn new(rules: Rules) -> RulesHandle {
        RulesHandle(Arc::new(RwLock::new(Arc::new(rules))))
    }

    /// The rules now in force.
    pub fn current(&self) -> Arc<Rules> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Puts `rules` in force for every request from now on.
    pub fn replace(&self, rules: Rules) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(rules);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn rules(allow: &[&str], deny: &[&str], hosts: &[(&str, &[&str])]) -> Rules {
        Rules::new(
            allow.iter().map(|p| p.parse().unwrap()).collect(),
            deny.iter().map(|p| p.parse().unwrap()).collect(),
            hosts
                .iter()
                .map(|(n, a)| {
                    (
                        (*n).to_owned(),
                        a.iter().map(|ip| ip.parse().unwrap()).collect(),
                    )
                })
                .collect(),
        )
    }

    /// Answers from a list, one per call (the last one repeating), counting calls.
    struct Scripted {
        answers: Vec<Vec<IpAddr>>,
        calls: AtomicUsize,
    }

    impl Scripted {
        fn new(answers: &[&[&str]]) -> Scripted {
            Scripted {
                answers: answers
                    .iter()
                    .map(|a| a.iter().map(|ip| ip.parse().unwrap()).collect())
                    .collect(),
                calls: AtomicUsize::new(0),
            }
        }
    }

    impl Resolver for Scripted {
        fn resolve<'a>(
            &'a self,
            _name: &'a str,
            _port: u16,
        ) -> Pin<Box<dyn Future<Output = io::Result<Vec<IpAddr>>> + Send + 'a>> {
            let call = self.calls.fetch_add(1, Ordering::SeqCst);
            let answer = self.answers[call.min(self.answers.len() - 1)].clone();
            Box::pin(async move { Ok(answer) })
        }
    }

    fn run(rules: &Rules, resolver: &dyn Resolver, host: &str, port: u16) -> Verdict {
        let host = Host::parse(host).unwrap();
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(decide(rules, resolver, &host, port))
    }

    fn denial(verdict: Verdict) -> Denial {
        match verdict {
            Verdict::Deny { denial, .. } => denial,
            other => panic!("expected a denial, got {other:?}"),
        }
    }

    fn allowed(verdict: Verdict) -> Vec<IpAddr> {
        match verdict {
            Verdict::Allow { addrs, .. } => addrs,
            other => panic!("expected allow, got {other:?}"),
        }
    }

    const PUBLIC: &[&str] = &["192.0.2.10"];

    #[test]
    fn allow_deny_and_hints() {
        let r = rules(
            &["example.com", "*.example.org:443"],
            &["bad.example.org"],
            &[],
        );
        let dns = Scripted::new(&[PUBLIC]);
        assert_eq!(
            allowed(run(&r, &dns, "EXAMPLE.com.", 80)),
            [PUBLIC[0].parse::<IpAddr>().unwrap()]
        );
        allowed(run(&r, &dns, "a.example.org", 443));
        let d = denial(run(&r, &dns, "a.example.org", 80));
        assert_eq!(d.reason, "not in allowlist");
        assert_eq!(
            d.hint.as_deref(),
            Some("to allow it, add \"a.example.org:80\" to network.allow")
        );
        // The apex is not a subdomain; look-alikes are other names.
        denial(run(&r, &dns, "example.org", 443));
        denial(run(&r, &dns, "example.com.evil", 80));
        denial(run(&r, &dns, "www.example.com", 80));
        // Deny wins.
        let d = denial(run(&r, &dns, "bad.example.org", 443));
        assert_eq!(d.reason, "matches \"bad.example.org\" in network.deny");
        assert_eq!(d.rule.as_deref(), Some("deny bad.example.org"));
        // Refused before resolving: the resolver was only asked for the allowed ones.
        assert_eq!(dns.calls.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn every_resolved_address_must_pass() {
        let r = rules(&["example.com"], &[], &[]);
        for (answer, reason) in [
            (
                &["127.0.0.1"][..],
                "example.com resolves to 127.0.0.1, which is a loopback address",
            ),
            (
                &["192.0.2.10", "10.1.2.3"],
                "example.com resolves to 10.1.2.3, which is a private address",
            ),
            (
                &["::ffff:192.168.0.1"],
                "example.com resolves to 192.168.0.1, which is a private address",
            ),
            (
                &["169.254.169.254"],
                "example.com resolves to 169.254.169.254, which is a cloud metadata endpoint",
            ),
            (
                &["fd00:ec2::254"],
                "example.com resolves to fd00:ec2::254, which is a cloud metadata endpoint",
            ),
            (
                &["0.0.0.0"],
                "example.com resolves to 0.0.0.0, which is an unspecified (\"this network\") address, never a destination",
            ),
        ] {
            let d = denial(run(&r, &Scripted::new(&[answer]), "example.com", 443));
            assert_eq!(d.reason, reason);
        }
        let d = denial(run(
            &r,
            &Scripted::new(&[&["10.1.2.3"]]),
            "example.com",
            443,
        ));
        assert_eq!(
            d.hint.as_deref(),
            Some(
                "internal addresses are refused unless an allow rule names them; to allow it, add \
                 \"10.1.2.3:443\" (or its range) to network.allow"
            )
        );
        assert_eq!(d.ip, Some("10.1.2.3".parse().unwrap()));
    }

    #[test]
    fn address_rules_name_internal_addresses() {
        let r = rules(
            &["example.com", "10.0.0.0/8:443", "169.254.0.0/16"],
            &["10.9.0.0/16"],
            &[],
        );
        allowed(run(
            &r,
            &Scripted::new(&[&["10.1.2.3"]]),
            "example.com",
            443,
        ));
        // The port must match too.
        denial(run(&r, &Scripted::new(&[&["10.1.2.3"]]), "example.com", 80));
        // Deny address patterns apply to resolved addresses.
        let d = denial(run(
            &r,
            &Scripted::new(&[&["10.9.1.1"]]),
            "example.com",
            443,
        ));
        assert_eq!(
            d.reason,
            "example.com resolves to 10.9.1.1, which matches \"10.9.0.0/16\" in network.deny"
        );
        // A range does not name the metadata endpoint; the exact address does.
        denial(run(
            &r,
            &Scripted::new(&[&["169.254.169.254"]]),
            "example.com",
            80,
        ));
        allowed(run(
            &r,
            &Scripted::new(&[&["169.254.1.1"]]),
            "example.com",
            80,
        ));
        let r = rules(&["169.254.169.254:80"], &[], &[]);
        allowed(run(&r, &Scripted::new(&[]), "169.254.169.254", 80));
    }

    #[test]
    fn literals_need_address_rules() {
        let r = rules(&["example.com", "192.0.2.0/24"], &[], &[]);
        let dns = Scripted::new(&[]);
        allowed(run(&r, &dns, "192.0.2.77", 443));
        let d = denial(run(&r, &dns, "198.51.100.1", 443));
        assert_eq!(
            d.hint.as_deref(),
            Some("to allow it, add \"198.51.100.1:443\" to network.allow")
        );
        let d = denial(run(&r, &dns, "::1", 443));
        assert_eq!(
            d.hint.as_deref(),
            Some("to allow it, add \"[::1]:443\" to network.allow")
        );
        denial(run(&r, &dns, "127.0.0.1", 443));
        // A name pattern never matches a literal.
        let r = rules(&["example.com", "*.example.com"], &[], &[]);
        denial(run(&r, &dns, "192.0.2.1", 443));
        let r = rules(&["127.0.0.1"], &[], &[]);
        allowed(run(&r, &dns, "127.0.0.1", 8080));
        allowed(run(&r, &dns, "[::ffff:127.0.0.1]", 8080));
        let r = rules(&["0.0.0.0/0"], &[], &[]);
        denial(run(&r, &dns, "0.0.0.0", 80));
        denial(run(&r, &dns, "224.0.0.1", 80));
    }

    #[test]
    fn fixed_hosts_are_named_and_skip_dns() {
        let r = rules(
            &["pkg.test"],
            &["*.evil.test"],
            &[
                ("pkg.test", &["127.0.0.1"]),
                ("x.evil.test", &["127.0.0.1"]),
            ],
        );
        let dns = Scripted::new(&[&["192.0.2.1"]]);
        assert_eq!(
            allowed(run(&r, &dns, "PKG.test", 8080)),
            ["127.0.0.1".parse::<IpAddr>().unwrap()]
        );
        denial(run(&r, &dns, "x.evil.test", 80));
        assert_eq!(dns.calls.load(Ordering::SeqCst), 0);
        // Listed in hosts is not allowed: the allowlist still decides.
        let r = rules(&[], &[], &[("pkg.test", &["127.0.0.1"])]);
        denial(run(&r, &dns, "pkg.test", 80));
    }

    #[test]
    fn resolution_failures() {
        let r = rules(&["example.com"], &[], &[]);
        let verdict = run(&r, &Scripted::new(&[&[]]), "example.com", 443);
        assert_eq!(
            verdict,
            Verdict::Unresolved {
                reason: "cannot resolve example.com: no addresses".into()
            }
        );
    }

    #[test]
    fn handle_replaces_rules() {
        let handle = RulesHandle::new(rules(&["a.test"], &[], &[]));
        let before = handle.current();
        handle.replace(rules(&["b.test"], &[], &[]));
        assert_eq!(before.allow()[0].to_string(), "a.test");
        assert_eq!(handle.current().allow()[0].to_string(), "b.test");
    }
}
