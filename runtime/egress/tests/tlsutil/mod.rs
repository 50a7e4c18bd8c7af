//! TLS for the tests of inspected hosts: a CA made at test time, HTTP(S) servers on loopback
//! that record every request they get and answer with it, and a client that reaches them
//! through the proxy (`CONNECT`, then TLS trusting the given CAs, then HTTP/1.1).

#![allow(dead_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A CA made for one test.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    pub pem: String,
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).unwrap();
        TestCa {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A server configuration with a certificate for `names`, signed by this CA.
    pub fn server(&self, names: &[&str]) -> Arc<ServerConfig> {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
                .unwrap();
        params.is_ca = IsCa::ExplicitNoCa;
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], key)
            .unwrap();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(config)
    }
}

/// An HTTP server on 127.0.0.1 (with TLS when given a configuration) that records each
/// request's head as text (`METHOD TARGET`, then `name: value` lines, names lowercase, sorted)
/// and answers 200 with that text; `/redirect?to=URL` answers 302 to URL.
pub struct Upstream {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<String>>>,
}

impl Upstream {
    pub async fn start(tls: Option<Arc<ServerConfig>>) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let log = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let log = log.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let log = log.clone();
                        async move { Ok::<_, Infallible>(answer(req, &log).await) }
                    });
                    let builder = hyper::server::conn::http1::Builder::new();
                    match tls {
                        Some(config) => {
                            let Ok(stream) =
                                tokio_rustls::TlsAcceptor::from(config).accept(tcp).await
                            else {
                                return;
                            };
                            let _ = builder
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        }
                        None => {
                            let _ = builder.serve_connection(TokioIo::new(tcp), service).await;
                        }
                    }
                });
            }
        });
        Upstream { addr, seen }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

async fn answer(req: Request<Incoming>, log: &Mutex<Vec<String>>) -> Response<Full<Bytes>> {
    let mut lines: Vec<String> = req
        .headers()
        .iter()
        .map(|(k, v)| format!("{}: {}", k.as_str(), String::from_utf8_lossy(v.as_bytes())))
        .collect();
    lines.sort();
    let head = format!("{} {}\n{}\n", req.method(), req.uri(), lines.join("\n"));
    log.lock().unwrap().push(head.clone());
    let redirect = req.uri().path() == "/redirect";
    let to = req
        .uri()
        .query()
        .and_then(|q| q.strip_prefix("to="))
        .unwrap_or("")
        .to_owned();
    let _ = req.into_body().collect().await;
    let mut response = Response::new(Full::new(Bytes::from(head)));
    if redirect {
        *response.status_mut() = StatusCode::FOUND;
        response
            .headers_mut()
            .insert(hyper::header::LOCATION, to.parse().unwrap());
    }
    response
}

/// A client configuration trusting the CAs of `pems`.
pub fn client_config(pems: &[&str]) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    for pem in pems {
        for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
    }
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}

/// One request: method, target, extra headers.
pub type Req<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)]);

/// What a request through the proxy got: the status, the response's headers as text, the
/// body; or the error that stopped it.
#[derive(Debug)]
pub struct Got {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

/// `CONNECT host:port` through the proxy at `proxy`, TLS with `tls` (SNI `host`), then
/// `requests` one after the other on the same connection: (method, target, extra headers).
pub async fn https(
    proxy: SocketAddr,
    host: &str,
    port: u16,
    tls: Arc<ClientConfig>,
    requests: &[Req<'_>],
) -> Result<Vec<Got>, String> {
    let mut tcp = TcpStream::connect(proxy).await.unwrap();
    tcp.write_all(
        format!("CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if tcp.read(&mut byte).await.unwrap() == 0 {
            return Err(format!(
                "the proxy closed: {}",
                String::from_utf8_lossy(&head)
            ));
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    if !head.starts_with("HTTP/1.1 200") {
        return Err(head);
    }
    let name = ServerName::try_from(host.to_owned()).unwrap();
    let stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS: {e}"))?;
    send_all(stream, host, port, requests).await
}

/// SOCKS5 `CONNECT` to `host:port` by name through the proxy, then TLS with `tls` and
/// `requests` on the connection.
pub async fn socks5_https(
    proxy: SocketAddr,
    host: &str,
    port: u16,
    tls: Arc<ClientConfig>,
    requests: &[Req<'_>],
) -> Result<Vec<Got>, String> {
    let mut tcp = TcpStream::connect(proxy).await.unwrap();
    tcp.write_all(&[5, 1, 0]).await.unwrap();
    let mut method = [0u8; 2];
    tcp.read_exact(&mut method).await.unwrap();
    assert_eq!(method, [5, 0]);
    let mut req = vec![5, 1, 0, 3, u8::try_from(host.len()).unwrap()];
    req.extend_from_slice(host.as_bytes());
    req.extend_from_slice(&port.to_be_bytes());
    tcp.write_all(&req).await.unwrap();
    let mut reply = [0u8; 10];
    tcp.read_exact(&mut reply).await.unwrap();
    if reply[1] != 0 {
        return Err(format!("SOCKS5 reply {}", reply[1]));
    }
    let name = ServerName::try_from(host.to_owned()).unwrap();
    let stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS: {e}"))?;
    send_all(stream, host, port, requests).await
}

/// Plain HTTP through the proxy: each request in absolute form (`GET http://host:port/...`) on
/// its own connection.
pub async fn http_forward(
    proxy: SocketAddr,
    host: &str,
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Got {
    let mut tcp = TcpStream::connect(proxy).await.unwrap();
    let mut text =
        format!("{method} http://{host}:{port}{path} HTTP/1.1\r\nHost: {host}:{port}\r\n");
    for (k, v) in headers {
        text.push_str(&format!("{k}: {v}\r\n"));
    }
    text.push_str("Content-Length: 0\r\nConnection: close\r\n\r\n");
    tcp.write_all(text.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut out)).await;
    let out = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Got {
        status,
        headers: head.to_owned(),
        body: body.to_owned(),
    }
}

async fn send_all<S>(
    stream: S,
    host: &str,
    port: u16,
    requests: &[Req<'_>],
) -> Result<Vec<Got>, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let mut out = Vec::new();
    for (method, target, headers) in requests {
        let mut req = Request::builder()
            .method(*method)
            .uri(*target)
            .header("host", format!("{host}:{port}"));
        for (k, v) in *headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(Bytes::new())).unwrap();
        sender.ready().await.map_err(|e| e.to_string())?;
        let response = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let headers: String = response
            .headers()
            .iter()
            .map(|(k, v)| {
                format!(
                    "{}: {}\n",
                    k.as_str(),
                    String::from_utf8_lossy(v.as_bytes())
                )
            })
            .collect();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        out.push(Got {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        });
    }
    Ok(out)
}
