//! Special-purpose addresses the proxy refuses unless a rule names them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use taskbox_core::netpattern::canonical_ip;

/// Why an address is not an ordinary public one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Special {
    /// A cloud provider's instance metadata endpoint; reachable only through an allow rule that
    /// names the exact address (or a `[network.hosts]` entry).
    Metadata,
    /// Loopback, private, shared, link-local or reserved: reachable when an allowed address
    /// pattern covers it (or a `[network.hosts]` entry lists it).
    Internal(&'static str),
    /// Unspecified, multicast or broadcast: never a TCP destination, whatever the rules say.
    Never(&'static str),
}

impl Special {
    /// "a cloud metadata endpoint", "a loopback address", ...
    pub fn describe(self) -> &'static str {
        match self {
            Special::Metadata => "a cloud metadata endpoint",
            Special::Internal(what) | Special::Never(what) => what,
        }
    }
}

/// The cloud metadata endpoints (AWS/GCP/Azure/OpenStack link-local, AWS IPv6, Alibaba, Azure
/// wire server).
pub const METADATA: [IpAddr; 4] = [
    IpAddr::V4(Ipv4Addr::new(169, 254, 169, 254)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254)),
    IpAddr::V4(Ipv4Addr::new(100, 100, 100, 200)),
    IpAddr::V4(Ipv4Addr::new(168, 63, 129, 16)),
];

/// Classifies `ip` (IPv4-mapped addresses as the IPv4 address; IPv6 forms that embed an IPv4
/// address — NAT64 `64:ff9b::/96`, 6to4 `2002::/16`, IPv4-compatible `::/96` — as the embedded
/// address when that one is special). `None`: an ordinary public address.
pub fn classify(ip: IpAddr) -> Option<Special> {
    let ip = canonical_ip(ip);
    if METADATA.contains(&ip) {
        return Some(Special::Metadata);
    }
    match ip {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => classify_v6(v6),
    }
}

fn classify_v4(ip: Ipv4Addr) -> Option<Special> {
    let [a, b, c, _] = ip.octets();
    Some(match (a, b, c) {
        (0, _, _) => Special::Never("an unspecified (\"this network\") address"),
        (127, _, _) => Special::Internal("a loopback address"),
        (10, _, _) | (192, 168, _) => Special::Internal("a private address"),
        (172, 16..=31, _) => Special::Internal("a private address"),
        (100, 64..=127, _) => Special::Internal("a shared (carrier-grade NAT) address"),
        (169, 254, _) => Special::Internal("a link-local address"),
        (192, 0, 0) => Special::Internal("a reserved (IETF protocol) address"),
        (198, 18..=19, _) => Special::Internal("a reserved (benchmarking) address"),
        (255, 255, 255) if ip == Ipv4Addr::BROADCAST => Special::Never("the broadcast address"),
        (224..=239, _, _) => Special::Never("a multicast address"),
        (240..=255, _, _) => Special::Internal("a reserved address"),
        _ => return None,
    })
}

fn classify_v6(ip: Ipv6Addr) -> Option<Special> {
    let segments = ip.segments();
    if ip.is_unspecified() {
        return Some(Special::Never("an unspecified address"));
    }
    if ip.is_loopback() {
        return Some(Special::Internal("a loopback address"));
    }
    let embedded = |hi: u16, lo: u16| {
        let [h1, h2] = hi.to_be_bytes();
        let [l1, l2] = lo.to_be_bytes();
        Ipv4Addr::new(h1, h2, l1, l2)
    };
    // IPv4-compatible (::a.b.c.d), NAT64 (64:ff9b::a.b.c.d) and 6to4 (2002:aabb:ccdd::).
    let inner =
        if segments[..6] == [0, 0, 0, 0, 0, 0] || segments[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
            Some(embedded(segments[6], segments[7]))
        } else if segments[0] == 0x2002 {
            Some(embedded(segments[1], segments[2]))
        } else {
            None
        };
    if let Some(inner) = inner {
        if METADATA.contains(&IpAddr::V4(inner)) {
            return Some(Special::Metadata);
        }
        if let Some(special) = classify_v4(inner) {
            return Some(special);
        }
    }
    Some(match segments[0] {
        0xff00..=0xffff => Special::Never("a multicast address"),
        0xfe80..=0xfebf => Special::Internal("a link-local address"),
        0xfec0..=0xfeff => Special::Internal("a site-local address"),
        0xfc00..=0xfdff => Special::Internal("a unique local (private) address"),
        0x0100 if segments[1..4] == [0, 0, 0] => Special::Internal("a discard-only address"),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(text: &str) -> Option<Special> {
        classify(text.parse().unwrap())
    }

    #[test]
    fn special_ranges() {
        for text in [
            "169.254.169.254",
            "fd00:ec2::254",
            "100.100.100.200",
            "168.63.129.16",
        ] {
            assert_eq!(class(text), Some(Special::Metadata), "{text}");
        }
        assert_eq!(class("::ffff:169.254.169.254"), Some(Special::Metadata));
        assert_eq!(class("64:ff9b::a9fe:a9fe"), Some(Special::Metadata));
        for text in [
            "127.0.0.1",
            "127.1.2.3",
            "10.0.0.1",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "100.64.0.1",
            "100.127.255.254",
            "169.254.1.1",
            "::1",
            "fe80::1",
            "fc00::1",
            "fd12:3456::1",
            "::ffff:10.0.0.1",
            "::ffff:127.0.0.1",
            "::127.0.0.1",
            "64:ff9b::7f00:1",
            "2002:c0a8:0101::1",
            "fec0::1",
        ] {
            assert!(
                matches!(class(text), Some(Special::Internal(_))),
                "{text}: {:?}",
                class(text)
            );
        }
        for text in [
            "0.0.0.0",
            "0.1.2.3",
            "::",
            "224.0.0.1",
            "255.255.255.255",
            "ff02::1",
        ] {
            assert!(matches!(class(text), Some(Special::Never(_))), "{text}");
        }
        for text in [
            "1.1.1.1",
            "8.8.8.8",
            "172.32.0.1",
            "100.128.0.1",
            "192.0.2.1",
            "2606:4700::1111",
            "2001:db8::1",
            "64:ff9b::808:808",
        ] {
            assert_eq!(class(text), None, "{text}");
        }
    }
}
