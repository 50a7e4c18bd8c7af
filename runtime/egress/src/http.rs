//! HTTP/1 on the proxy socket: `CONNECT host:port` and absolute-form requests
//! (`GET http://host/path HTTP/1.1`), parsed with `httparse`.
//!
//! A forwarded request is sent in origin form (`GET /path HTTP/1.1`) with `Host` set from the
//! URL, without hop-by-hop headers (`Connection`, `Keep-Alive`, `TE`, `Trailer`, `Upgrade`, the
//! headers `Connection` names) and without `Proxy-*` headers, and with `Connection: close`: the
//! proxy serves one request per client connection, and the response head gets `Connection:
//! close` too so the client opens a new connection (to be decided anew) for its next request.

use std::io;

use crate::meter::Meter;
use crate::splice::{self, Socket};

/// Headers per request or response head, at most.
pub(crate) const MAX_HEADERS: usize = 128;

/// A parsed proxy request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Request {
    /// `CONNECT host:port`.
    Connect { host: String, port: u16 },
    /// An absolute-form request; `head` is the rewritten head to send to the destination.
    Forward {
        host: String,
        port: u16,
        head: Vec<u8>,
    },
}

/// Why a request head cannot be served; each has its status code.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum BadRequest {
    /// 400.
    Malformed(String),
    /// 431: the head is larger than the limit or has too many headers.
    TooLarge(String),
}

impl BadRequest {
    pub(crate) fn status(&self) -> (u16, &'static str) {
        match self {
            BadRequest::Malformed(_) => (400, "Bad Request"),
            BadRequest::TooLarge(_) => (431, "Request Header Fields Too Large"),
        }
    }

    pub(crate) fn message(&self) -> &str {
        match self {
            BadRequest::Malformed(message) | BadRequest::TooLarge(message) => message,
        }
    }
}

/// Parses the request head at the start of `buf`: `Ok(None)` when more bytes are needed, else the
/// request and the length of its head.
pub(crate) fn parse_request(buf: &[u8]) -> Result<Option<(Request, usize)>, BadRequest> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(BadRequest::TooLarge(format!(
                "more than {MAX_HEADERS} header fields"
            )));
        }
        Err(err) => {
            return Err(BadRequest::Malformed(format!(
                "not an HTTP proxy request ({err}); this socket speaks HTTP CONNECT, HTTP with \
                 absolute URLs, and SOCKS5"
            )));
        }
    };
    let (Some(method), Some(target), Some(version)) = (req.method, req.path, req.version) else {
        return Err(BadRequest::Malformed("incomplete request line".to_owned()));
    };
    if method.eq_ignore_ascii_case("CONNECT") {
        let (host, port) = split_authority(target, None)?;
        return Ok(Some((Request::Connect { host, port }, len)));
    }
    let scheme_end = target.find("://");
    let Some(scheme_end) = scheme_end else {
        return Err(BadRequest::Malformed(format!(
            "{method} {target}: a proxy needs an absolute URL (http://host/path) or CONNECT \
             host:port"
        )));
    };
    let scheme = &target[..scheme_end];
    if !scheme.eq_ignore_ascii_case("http") {
        return Err(BadRequest::Malformed(format!(
            "{scheme}:// URLs are not forwarded; use CONNECT (HTTPS_PROXY) for https"
        )));
    }
    let rest = &target[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    // Userinfo is never sent on; the client puts credentials in Authorization itself.
    let authority = authority.rsplit('@').next().unwrap_or(authority);
    let mut path = rest[authority_end..].to_owned();
    if let Some(hash) = path.find('#') {
        path.truncate(hash);
    }
    if !path.starts_with('/') {
        path.insert(0, '/');
    }
    let (host, port) = split_authority(authority, Some(80))?;
    let head = forward_head(method, &path, version, authority, req.headers);
    Ok(Some((Request::Forward { host, port, head }, len)))
}

/// `host:port` or `[v6]:port` (the port defaulting to `default_port` when given).
fn split_authority(
    authority: &str,
    default_port: Option<u16>,
) -> Result<(String, u16), BadRequest> {
    let bad = |why: &str| BadRequest::Malformed(format!("invalid host:port {authority:?}: {why}"));
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (inner, after) = rest.split_once(']').ok_or_else(|| bad("no closing ']'"))?;
        let port = match after {
            "" => None,
            _ => Some(
                after
                    .strip_prefix(':')
                    .ok_or_else(|| bad("junk after ']'"))?,
            ),
        };
        (&authority[..inner.len() + 2], port)
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err(bad("no host"));
    }
    let port = match port {
        Some(port) => port
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0 && port.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| bad("the port is not a number from 1 to 65535"))?,
        None => default_port.ok_or_else(|| bad("CONNECT needs host:port"))?,
    };
    Ok((host.to_owned(), port))
}

/// Hop-by-hop and proxy headers, which are not sent on.
pub(crate) fn is_hop_by_hop(name: &str) -> bool {
    const HOP: [&str; 9] = [
        "connection",
        "proxy-connection",
        "keep-alive",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "upgrade",
        "host",
    ];
    HOP.iter().any(|h| name.eq_ignore_ascii_case(h))
        || name
            .get(..6)
            .is_some_and(|prefix| prefix.eq_ignore_ascii_case("proxy-"))
}

/// Header names a `Connection` header lists (lowercase); framing headers are never among them.
fn connection_tokens(headers: &[httparse::Header<'_>]) -> Vec<String> {
    headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("connection"))
        .flat_map(|h| {
            String::from_utf8_lossy(h.value)
                .split(',')
                .map(|t| t.trim().to_ascii_lowercase())
                .collect::<Vec<_>>()
        })
        .filter(|t| !t.is_empty() && t != "content-length" && t != "transfer-encoding")
        .collect()
}

fn kept<'h>(headers: &'h [httparse::Header<'h>]) -> impl Iterator<Item = &'h httparse::Header<'h>> {
    let listed = connection_tokens(headers);
    headers.iter().filter(move |h| {
        !is_hop_by_hop(h.name) && !listed.iter().any(|t| h.name.eq_ignore_ascii_case(t))
    })
}

fn forward_head(
    method: &str,
    path: &str,
    version: u8,
    authority: &str,
    headers: &[httparse::Header<'_>],
) -> Vec<u8> {
    let mut head = Vec::with_capacity(512);
    head.extend_from_slice(
        format!("{method} {path} HTTP/1.{version}\r\nHost: {authority}\r\n").as_bytes(),
    );
    for header in kept(headers) {
        head.extend_from_slice(header.name.as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(header.value);
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"Connection: close\r\n\r\n");
    head
}

/// Reads the destination's response head(s) from `upstream` and writes them to the client:
/// interim (1xx) heads unchanged, the final one without hop-by-hop headers and with
/// `Connection: close`. Anything that does not parse as a response head within `max_head` bytes
/// is passed on unchanged. Bytes after the head are written too.
pub(crate) async fn relay_response_head<U: Socket, C: Socket>(
    upstream: &U,
    client: &C,
    max_head: usize,
    meter: &Meter,
) -> io::Result<()> {
    let send = |bytes: Vec<u8>| async move {
        splice::write_all(client, &bytes).await?;
        meter.add(&meter.down, bytes.len());
        io::Result::Ok(())
    };
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut headers);
        match response.parse(&buf) {
            Ok(httparse::Status::Complete(len)) => {
                let code = response.code.unwrap_or(0);
                if (100..200).contains(&code) && code != 101 {
                    send(buf.drain(..len).collect()).await?;
                    continue;
                }
                let status_end = buf.windows(2).position(|w| w == b"\r\n").unwrap_or(0);
                let mut head = Vec::with_capacity(buf.len() + 32);
                head.extend_from_slice(&buf[..status_end]);
                head.extend_from_slice(b"\r\n");
                for header in kept(response.headers) {
                    head.extend_from_slice(header.name.as_bytes());
                    head.extend_from_slice(b": ");
                    head.extend_from_slice(header.value);
                    head.extend_from_slice(b"\r\n");
                }
                head.extend_from_slice(b"Connection: close\r\n\r\n");
                head.extend_from_slice(&buf[len..]);
                return send(head).await;
            }
            Ok(httparse::Status::Partial) if buf.len() < max_head => {}
            // Too large or not HTTP: not ours to fix; pass it on.
            Ok(httparse::Status::Partial) | Err(_) => return send(buf).await,
        }
        let n = splice::read(upstream, &mut chunk).await?;
        if n == 0 {
            return send(buf).await;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// A complete response with a one-line plain-text body, closing the connection.
pub(crate) fn response(code: u16, reason: &str, body: &str) -> Vec<u8> {
    let body = format!("{}\n", body.replace(['\r', '\n'], " "));
    format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: \
         {}\r\nConnection: close\r\nX-Taskbox-Egress: {}\r\n\r\n{body}",
        body.len(),
        if code == 403 { "denied" } else { "error" }
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Request {
        match parse_request(text.as_bytes()) {
            Ok(Some((request, len))) => {
                assert_eq!(len, text.len());
                request
            }
            other => panic!("{text:?}: {other:?}"),
        }
    }

    fn bad(text: &str) -> String {
        match parse_request(text.as_bytes()) {
            Err(err) => err.message().to_owned(),
            other => panic!("{text:?}: {other:?}"),
        }
    }

    #[test]
    fn connect() {
        assert_eq!(
            parse("CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"),
            Request::Connect {
                host: "example.com".into(),
                port: 443
            }
        );
        assert_eq!(
            parse("CONNECT [2001:db8::1]:8443 HTTP/1.1\r\n\r\n"),
            Request::Connect {
                host: "[2001:db8::1]".into(),
                port: 8443
            }
        );
        assert!(bad("CONNECT example.com HTTP/1.1\r\n\r\n").contains("CONNECT needs host:port"));
        assert!(bad("CONNECT example.com:0 HTTP/1.1\r\n\r\n").contains("port is not a number"));
        assert!(bad("CONNECT :443 HTTP/1.1\r\n\r\n").contains("no host"));
        assert_eq!(
            parse_request(b"CONNECT example.com:443 HTTP/1.1\r\n"),
            Ok(None)
        );
    }

    #[test]
    fn forward_rewrites_the_head() {
        let request = parse(
            "GET http://user:pw@Example.com:8080/a/b?q=1#frag HTTP/1.1\r\nHost: wrong\r\n\
             User-Agent: t\r\nProxy-Authorization: Basic x\r\nProxy-Connection: keep-alive\r\n\
             Connection: keep-alive, X-Secret\r\nX-Secret: 1\r\nKeep-Alive: 5\r\nTE: trailers\r\n\
             Content-Length: 0\r\n\r\n",
        );
        let Request::Forward { host, port, head } = request else {
            panic!("{request:?}");
        };
        assert_eq!((host.as_str(), port), ("Example.com", 8080));
        assert_eq!(
            String::from_utf8(head).unwrap(),
            "GET /a/b?q=1 HTTP/1.1\r\nHost: Example.com:8080\r\nUser-Agent: t\r\nContent-Length: 0\r\n\
             Connection: close\r\n\r\n"
        );
        let Request::Forward { head, port, .. } = parse("GET http://example.com HTTP/1.0\r\n\r\n")
        else {
            panic!();
        };
        assert_eq!(port, 80);
        assert_eq!(
            String::from_utf8(head).unwrap(),
            "GET / HTTP/1.0\r\nHost: example.com\r\nConnection: close\r\n\r\n"
        );
    }

    #[test]
    fn refusals() {
        assert!(bad("GET /index.html HTTP/1.1\r\n\r\n").contains("needs an absolute URL"));
        assert!(bad("GET https://example.com/ HTTP/1.1\r\n\r\n").contains("use CONNECT"));
        match parse_request(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03") {
            Err(BadRequest::Malformed(m)) => assert!(m.contains("not an HTTP proxy request")),
            other => panic!("{other:?}"),
        }
        assert!(bad("hello\r\n\r\n").contains("not an HTTP proxy request"));
        let many: String = (0..200).map(|i| format!("X-{i}: y\r\n")).collect();
        let text = format!("GET http://a.example/ HTTP/1.1\r\n{many}\r\n");
        assert!(matches!(
            parse_request(text.as_bytes()),
            Err(BadRequest::TooLarge(_))
        ));
    }

    #[test]
    fn denial_response_is_one_line() {
        let text =
            String::from_utf8(response(403, "Forbidden", "connect x:1 denied: a\nb")).unwrap();
        assert!(text.starts_with("HTTP/1.1 403 Forbidden\r\n"), "{text}");
        assert!(
            text.ends_with("\r\n\r\nconnect x:1 denied: a b\n"),
            "{text}"
        );
        assert!(text.contains("Content-Length: 24\r\n"), "{text}");
    }
}
