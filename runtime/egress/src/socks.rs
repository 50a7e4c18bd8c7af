//! SOCKS5 (RFC 1928), without authentication: `CONNECT` to an IPv4 or IPv6 address or a domain
//! name (resolved by the proxy: "socks5h"). `BIND` and `UDP ASSOCIATE` are refused with "command
//! not supported"; SOCKS4 clients get a SOCKS4 rejection.

/// Reply codes.
pub(crate) const SUCCEEDED: u8 = 0x00;
pub(crate) const GENERAL_FAILURE: u8 = 0x01;
pub(crate) const NOT_ALLOWED: u8 = 0x02;
pub(crate) const NETWORK_UNREACHABLE: u8 = 0x03;
pub(crate) const HOST_UNREACHABLE: u8 = 0x04;
pub(crate) const CONNECTION_REFUSED: u8 = 0x05;
pub(crate) const TTL_EXPIRED: u8 = 0x06;
pub(crate) const COMMAND_NOT_SUPPORTED: u8 = 0x07;
pub(crate) const ADDRESS_TYPE_NOT_SUPPORTED: u8 = 0x08;

/// The reply to a method selection offering no method this proxy supports.
pub(crate) const NO_ACCEPTABLE_METHOD: [u8; 2] = [0x05, 0xff];
/// "No authentication required".
pub(crate) const METHOD_SELECTED: [u8; 2] = [0x05, 0x00];
/// SOCKS4's "request rejected or failed".
pub(crate) const SOCKS4_REJECTED: [u8; 8] = [0x00, 0x5b, 0, 0, 0, 0, 0, 0];

/// A reply with `code` and an unspecified bound address (the proxy's own address is none of the
/// client's business).
pub(crate) fn reply(code: u8) -> [u8; 10] {
    [0x05, code, 0x00, 0x01, 0, 0, 0, 0, 0, 0]
}

/// How many bytes the method selection at the start of `buf` takes: `None` when more are needed.
pub(crate) fn greeting_len(buf: &[u8]) -> Option<usize> {
    let methods = usize::from(*buf.get(1)?);
    (buf.len() >= 2 + methods).then_some(2 + methods)
}

/// The greeting offers "no authentication".
pub(crate) fn offers_no_auth(greeting: &[u8]) -> bool {
    greeting
        .get(2..)
        .is_some_and(|methods| methods.contains(&0x00))
}

/// What a request asks for.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Request {
    /// CONNECT to a host (a domain as sent, or an address literal as text) and port.
    Connect {
        host: Result<String, String>,
        port: u16,
    },
    /// Another command, or a malformed request; the reply code to send.
    Refuse { code: u8, why: String },
}

/// Parses the request at the start of `buf`: `None` when more bytes are needed, else the request
/// and its length.
pub(crate) fn parse_request(buf: &[u8]) -> Option<(Request, usize)> {
    if buf.len() < 4 {
        return None;
    }
    if buf[0] != 0x05 {
        return Some((
            Request::Refuse {
                code: GENERAL_FAILURE,
                why: format!("SOCKS version {} in the request; expected 5", buf[0]),
            },
            buf.len(),
        ));
    }
    let addr_len = match buf[3] {
        0x01 => 4,
        0x04 => 16,
        0x03 => 1 + usize::from(*buf.get(4)?),
        other => {
            return Some((
                Request::Refuse {
                    code: ADDRESS_TYPE_NOT_SUPPORTED,
                    why: format!("address type {other:#04x} is not supported"),
                },
                buf.len(),
            ));
        }
    };
    let total = 4 + addr_len + 2;
    if buf.len() < total {
        return None;
    }
    let command = buf[1];
    if command != 0x01 {
        let name = match command {
            0x02 => "BIND".to_owned(),
            0x03 => "UDP ASSOCIATE".to_owned(),
            other => format!("command {other:#04x}"),
        };
        return Some((
            Request::Refuse {
                code: COMMAND_NOT_SUPPORTED,
                why: format!("SOCKS5 {name} is not supported; only CONNECT"),
            },
            total,
        ));
    }
    let port = u16::from_be_bytes([buf[total - 2], buf[total - 1]]);
    let host = decode_host(buf[3], &buf[4..4 + addr_len]);
    Some((Request::Connect { host, port }, total))
}

/// The host of a request's address field `addr` of type `atyp` (1, 3 or 4), as text.
fn decode_host(atyp: u8, addr: &[u8]) -> Result<String, String> {
    match (atyp, addr.len()) {
        (0x01, 4) => Ok(format!("{}.{}.{}.{}", addr[0], addr[1], addr[2], addr[3])),
        (0x04, 16) => {
            let mut octets = [0u8; 16];
            octets.copy_from_slice(addr);
            Ok(format!("[{}]", std::net::Ipv6Addr::from(octets)))
        }
        (0x03, _) => {
            let name = addr.get(1..).unwrap_or_default();
            if name.is_empty() {
                return Err("empty domain name".to_owned());
            }
            std::str::from_utf8(name)
                .map(str::to_owned)
                .map_err(|_| "the domain name is not UTF-8".to_owned())
        }
        _ => Err("malformed address".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests() {
        let mut domain = vec![5, 1, 0, 3, 11];
        domain.extend_from_slice(b"example.com");
        domain.extend_from_slice(&443u16.to_be_bytes());
        assert_eq!(
            parse_request(&domain),
            Some((
                Request::Connect {
                    host: Ok("example.com".into()),
                    port: 443
                },
                domain.len()
            ))
        );
        assert_eq!(parse_request(&domain[..domain.len() - 1]), None);
        assert_eq!(parse_request(&domain[..4]), None);
        let v4 = [5, 1, 0, 1, 127, 0, 0, 1, 0, 80];
        assert!(matches!(
            parse_request(&v4),
            Some((Request::Connect { host: Ok(h), port: 80 }, 10)) if h == "127.0.0.1"
        ));
        let mut v6 = vec![5, 1, 0, 4];
        v6.extend_from_slice(&std::net::Ipv6Addr::LOCALHOST.octets());
        v6.extend_from_slice(&[0, 22]);
        assert!(matches!(
            parse_request(&v6),
            Some((Request::Connect { host: Ok(h), port: 22 }, 22)) if h == "[::1]"
        ));
        let udp = [5, 3, 0, 1, 0, 0, 0, 0, 0, 0];
        assert!(matches!(
            parse_request(&udp),
            Some((
                Request::Refuse {
                    code: COMMAND_NOT_SUPPORTED,
                    ..
                },
                10
            ))
        ));
        let bind = [5, 2, 0, 1, 0, 0, 0, 0, 0, 0];
        assert!(matches!(
            parse_request(&bind),
            Some((
                Request::Refuse {
                    code: COMMAND_NOT_SUPPORTED,
                    ..
                },
                10
            ))
        ));
        assert!(matches!(
            parse_request(&[5, 1, 0, 9]),
            Some((
                Request::Refuse {
                    code: ADDRESS_TYPE_NOT_SUPPORTED,
                    ..
                },
                _
            ))
        ));
        assert!(matches!(
            parse_request(&[5, 1, 0, 3, 0, 0, 80]),
            Some((Request::Connect { host: Err(_), .. }, 7))
        ));
        assert!(matches!(
            parse_request(&[5, 1, 0, 3, 2, 0xff, 0xfe, 0, 80]),
            Some((Request::Connect { host: Err(_), .. }, 9))
        ));
    }

    #[test]
    fn greeting() {
        assert_eq!(greeting_len(&[5]), None);
        assert_eq!(greeting_len(&[5, 2, 0]), None);
        assert_eq!(greeting_len(&[5, 2, 0, 2]), Some(4));
        assert!(offers_no_auth(&[5, 2, 2, 0]));
        assert!(!offers_no_auth(&[5, 1, 2]));
        assert!(!offers_no_auth(&[5, 0]));
    }
}
