//! Entry points for the fuzz targets (`tests/fuzz`) and their corpus test: what a sandbox's
//! client sends the proxy goes through the same parsers and checks as on a live socket, and each
//! function panics when one of the proxy's promises breaks. Not part of the API.

use std::sync::OnceLock;

use taskbox_core::netpattern::Host;
use taskbox_core::policy;

use crate::http::{self, Request as HttpRequest};
use crate::rules::Rules;
use crate::socks::{self, Request as SocksRequest};

/// The rules every fuzzed request is decided by: subdomains of `example.com` on any port, one
/// exact host on one port, and a denied subdomain.
const POLICY: &str = r#"
[network]
mode = "proxy"
allow = ["*.example.com", "api.example.org:443"]
deny = ["bad.example.com"]
"#;

fn rules() -> &'static Rules {
    static RULES: OnceLock<Rules> = OnceLock::new();
    RULES.get_or_init(|| {
        let policy = match policy::parse(POLICY, "fuzz policy") {
            Ok(p) => p,
            Err(e) => panic!("the fuzz policy does not parse: {e}"),
        };
        Rules::from_policy(&policy.network)
    })
}

/// `buf` as the start of what a client sent on the proxy socket: the HTTP head parser, the
/// SOCKS5 greeting and request parsers, and the rules on whatever host they yield.
pub fn proxy_request(buf: &[u8]) {
    match http::parse_request(buf) {
        Ok(Some((req, len))) => {
            assert!(
                len <= buf.len(),
                "head length {len} beyond the {} bytes",
                buf.len()
            );
            // The head alone is the same request: nothing after it changed the verdict.
            match http::parse_request(&buf[..len]) {
                Ok(Some((again, again_len))) => {
                    assert_eq!(again, req, "the head alone parses differently");
                    assert_eq!(again_len, len);
                }
                other => panic!("the head alone does not parse: {other:?}"),
            }
            match req {
                HttpRequest::Connect { host, port } => decide(&host, port),
                HttpRequest::Forward { host, port, head } => {
                    forwarded_head(&head);
                    decide(&host, port);
                }
            }
        }
        Ok(None) => {}
        Err(bad) => {
            let (status, _) = bad.status();
            assert!(status == 400 || status == 431);
            assert!(!bad.message().is_empty(), "a refusal without a reason");
        }
    }

    if let Some(len) = socks::greeting_len(buf) {
        assert!(len <= buf.len());
        let _ = socks::offers_no_auth(&buf[..len]);
        socks_request(&buf[len..]);
    }
    socks_request(buf);
}

fn socks_request(buf: &[u8]) {
    let Some((req, len)) = socks::parse_request(buf) else {
        return;
    };
    assert!(
        len <= buf.len(),
        "request length {len} beyond the {} bytes",
        buf.len()
    );
    match req {
        SocksRequest::Connect {
            host: Ok(host),
            port,
        } => decide(&host, port),
        SocksRequest::Connect { host: Err(why), .. } => assert!(!why.is_empty()),
        SocksRequest::Refuse { code, why } => {
            assert!(code != socks::SUCCEEDED, "a refusal that reads as success");
            assert!(!why.is_empty(), "a refusal without a reason");
        }
    }
}

/// The rewritten head sent to the destination: one complete request, exactly one `Host`, no
/// proxy or hop-by-hop header of the client's, and `Connection: close` as its only connection
/// header.
fn forwarded_head(head: &[u8]) {
    let mut headers = [httparse::EMPTY_HEADER; 2 * http::MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Complete(len)) => {
            assert_eq!(len, head.len(), "bytes after the forwarded head")
        }
        other => panic!(
            "the forwarded head does not parse ({other:?}): {:?}",
            String::from_utf8_lossy(head)
        ),
    }
    let count = |name: &str| {
        req.headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case(name))
            .count()
    };
    assert_eq!(
        count("host"),
        1,
        "Host headers in {:?}",
        String::from_utf8_lossy(head)
    );
    assert_eq!(count("connection"), 1);
    for name in ["keep-alive", "te", "trailer", "upgrade", "proxy-connection"] {
        assert_eq!(count(name), 0, "{name} forwarded");
    }
    assert!(
        req.headers
            .iter()
            .all(|h| !h.name.to_ascii_lowercase().starts_with("proxy-")),
        "a Proxy-* header forwarded"
    );
}

/// The verdict on `host:port` agrees with the rules as written.
fn decide(host: &str, port: u16) {
    let Ok(parsed) = Host::parse(host) else {
        return;
    };
    let verdict = rules().check_request(&parsed, port);
    let allowed_by_text = match &parsed {
        Host::Name(name) => {
            name != "bad.example.com"
                && (name.ends_with(".example.com") || (name == "api.example.org" && port == 443))
        }
        Host::Ip(_) => false,
    };
    assert_eq!(
        verdict.is_ok(),
        allowed_by_text,
        "{host:?} port {port} parsed as {parsed:?}: {verdict:?}"
    );
}
