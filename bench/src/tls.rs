//! `taskbox-bench egress-tls`: what an inspected host costs a request, against a plain tunnel.
//!
//! One process, three parties on loopback, as in `egress-hop`: an HTTPS server (a certificate
//! of a CA made now, for two names), the egress proxy (its own runtime, `--proxy-threads`)
//! that lets both names through but inspects one of them (a secret bound to it: the proxy
//! terminates TLS with the sandbox's CA, checks the server's certificate, presents the
//! secret, and re-encrypts), and a client. The two series run interleaved, request by request
//! (the order reversed every other round), so the machine's noise lands on both:
//!
//! - a new connection per request, as curl makes one: `CONNECT`, a full TLS handshake (the
//!   client resumes nothing), `GET /` with a small answer, close;
//! - requests on one kept-alive connection per round (the handshakes out of the way).
//!
//! Reports p50 and p99 of each, and what the inspection adds (target: < 2 ms at p50).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::stats;

#[derive(Args)]
pub struct TlsArgs {
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// Measured requests per series per round.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Unmeasured requests per series at the start of each round.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Worker threads of the proxy's runtime (a ProxyService's default for a backend: 2).
    #[arg(long, default_value_t = 2)]
    proxy_threads: usize,
}

const PLAIN: &str = "tunnel.test";
const INSPECTED: &str = "api.test";

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A CA, and a server configuration for both names signed by it.
fn server_tls() -> Result<(String, Arc<ServerConfig>)> {
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::default();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign];
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate()?;
    let mut leaf = CertificateParams::new(vec![PLAIN.to_owned(), INSPECTED.to_owned()])?;
    leaf.is_ca = IsCa::ExplicitNoCa;
    let cert = leaf.signed_by(&key, &issuer)?;
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok((ca_cert.pem(), Arc::new(config)))
}

/// The HTTPS server: 200 and a small body to every request, keep-alive.
async fn serve(listener: TcpListener, config: Arc<ServerConfig>) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let config = config.clone();
        tokio::spawn(async move {
            let Ok(tls) = tokio_rustls::TlsAcceptor::from(config).accept(tcp).await else {
                return;
            };
            let service = hyper::service::service_fn(|_req: Request<Incoming>| async {
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok\n"))))
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tls), service)
                .await;
        });
    }
}

fn client_config(pems: &[&str]) -> Result<Arc<ClientConfig>> {
    let mut roots = RootCertStore::empty();
    for pem in pems {
        for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            roots.add(cert?)?;
        }
    }
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    // As a new curl process: nothing to resume.
    config.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(config))
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

/// `CONNECT host:port` through the proxy, TLS, and an HTTP/1.1 connection on it.
async fn connect(
    proxy: SocketAddr,
    host: &str,
    port: u16,
    tls: Arc<ClientConfig>,
) -> Result<Sender> {
    let mut tcp = TcpStream::connect(proxy).await?;
    tcp.set_nodelay(true)?;
    tcp.write_all(
        format!("CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut head = Vec::with_capacity(64);
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if tcp.read(&mut byte).await? == 0 {
            bail!("the proxy closed after CONNECT");
        }
        head.push(byte[0]);
    }
    if !head.starts_with(b"HTTP/1.1 200") {
        bail!("CONNECT refused: {}", String::from_utf8_lossy(&head));
    }
    let name = ServerName::try_from(host.to_owned())?;
    let stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

async fn get(sender: &mut Sender, host: &str, port: u16) -> Result<()> {
    sender.ready().await?;
    let req = Request::builder()
        .uri("/")
        .header("host", format!("{host}:{port}"))
        .body(Full::new(Bytes::new()))?;
    let response = sender.send_request(req).await?;
    if !response.status().is_success() {
        bail!("{host}: status {}", response.status());
    }
    response.into_body().collect().await?;
    Ok(())
}

pub fn run(a: &TlsArgs) -> Result<()> {
    let (ca_pem, server_config) = server_tls()?;
    let upstream_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let listener = upstream_rt.block_on(TcpListener::bind("127.0.0.1:0"))?;
    let port = listener.local_addr()?.port();
    upstream_rt.spawn(serve(listener, server_config));

    let policy = taskbox_core::policy::parse(
        &format!(
            "[network]\nmode = \"proxy\"\nallow = [\"{PLAIN}\", \"{INSPECTED}\"]\n\
             [network.hosts]\n\"{PLAIN}\" = [\"127.0.0.1\"]\n\"{INSPECTED}\" = [\"127.0.0.1\"]\n\
             [secrets.bench]\nfrom_api = true\nhosts = [\"{INSPECTED}\"]\nheader = \"X-Api-Key\"\n"
        ),
        "egress-tls bench",
    )
    .map_err(|e| anyhow!("{e}"))?;
    let given = [(
        "bench".to_owned(),
        taskbox_core::api::SecretValue::new("bench-secret-value"),
    )]
    .into_iter()
    .collect();
    let secrets =
        taskbox_core::egress::resolve_secrets(&policy, &given).map_err(|e| anyhow!("{e}"))?;
    let proxy_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(a.proxy_threads.max(1))
        .thread_name("taskbox-egress")
        .enable_all()
        .build()?;
    let proxy = taskbox_egress::Proxy::builder(taskbox_egress::Rules::from_policy(&policy.network))
        .tag("bench")
        .inspect(
            taskbox_core::egress::EgressConfig {
                network: policy.network.clone(),
                secrets,
            },
            Some(ca_pem.as_bytes()),
        )?
        .build();
    let proxy_addr = proxy_rt.block_on(proxy.listen_tcp("127.0.0.1:0".parse()?))?;
    let trust = proxy.trust().context("the proxy inspects nothing")?;
    let tls = client_config(&[&ca_pem, &trust.ca_cert])?;

    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let hosts = [PLAIN, INSPECTED];
    // [new connection, kept alive] x [plain, inspected]
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); 4];
    let mut starts: Vec<Vec<usize>> = vec![Vec::new(); 4];
    client_rt.block_on(async {
        for round in 0..a.rounds {
            let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for s in 0..4 {
                starts[s].push(samples[s].len());
            }
            // New connections, interleaved request by request.
            for i in 0..a.warmup + a.requests {
                for &h in &order {
                    let started = Instant::now();
                    let mut sender = connect(proxy_addr, hosts[h], port, tls.clone()).await?;
                    get(&mut sender, hosts[h], port).await?;
                    let took = started.elapsed();
                    drop(sender);
                    if i >= a.warmup {
                        samples[h].push(took);
                    }
                }
            }
            // Kept-alive connections, one per host, interleaved request by request.
            let mut senders = Vec::new();
            for host in hosts {
                senders.push(connect(proxy_addr, host, port, tls.clone()).await?);
            }
            for i in 0..a.warmup + a.requests {
                for &h in &order {
                    let started = Instant::now();
                    get(&mut senders[h], hosts[h], port).await?;
                    let took = started.elapsed();
                    if i >= a.warmup {
                        samples[2 + h].push(took);
                    }
                }
            }
            let p50 = |s: &[Duration]| {
                stats::median(&s.iter().map(|d| d.as_secs_f64() * 1e3).collect::<Vec<_>>())
            };
            eprintln!(
                "egress-tls: round {}: new connection p50 tunnel {:.3} ms, inspected {:.3} ms; \
                 kept alive p50 tunnel {:.3} ms, inspected {:.3} ms",
                round + 1,
                p50(&samples[0][starts[0][round]..]),
                p50(&samples[1][starts[1][round]..]),
                p50(&samples[2][starts[2][round]..]),
                p50(&samples[3][starts[3][round]..]),
            );
        }
        anyhow::Ok(())
    })?;
    proxy_rt.block_on(proxy.shutdown());

    let names = [
        "new connection, plain tunnel",
        "new connection, inspected",
        "kept-alive connection, plain tunnel",
        "kept-alive connection, inspected",
    ];
    let series: Vec<Value> = (0..4)
        .map(|s| {
            let mut v = stats::summary(names[s], &samples[s]);
            v["rounds"] = stats::per_round(&samples[s], &starts[s]);
            v
        })
        .collect();
    let compare = |plain: usize, inspected: usize| {
        let p = |s: &Value, k: &str| s[k].as_f64().unwrap_or(f64::NAN);
        let (a, b) = (&series[plain], &series[inspected]);
        json!({
            "added_p50_ms": ((p(b, "p50_ms") - p(a, "p50_ms")) * 1000.0).round() / 1000.0,
            "added_p99_ms": ((p(b, "p99_ms") - p(a, "p99_ms")) * 1000.0).round() / 1000.0,
            "ratio_p50": ((p(b, "p50_ms") / p(a, "p50_ms")) * 100.0).round() / 100.0,
            "ratio_p99": ((p(b, "p99_ms") / p(a, "p99_ms")) * 100.0).round() / 100.0,
        })
    };
    let out = json!({
        "figure": "egress-tls",
        "rounds": a.rounds,
        "requests": a.requests,
        "proxy_threads": a.proxy_threads,
        "series": series,
        "new_connection": compare(0, 1),
        "kept_alive": compare(2, 3),
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
