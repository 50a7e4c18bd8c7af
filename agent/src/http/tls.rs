//! TLS for the HTTP client: rustls with the `ring` provider.
//!
//! A server's certificate must chain to a trusted root and be valid for the URL's host (its DNS
//! name, or its IP address; the name is also sent as SNI). The trusted roots are the system's
//! store, read by `rustls-native-certs` (the PEM bundle and directories of the distribution's
//! `ca-certificates`, or only `SSL_CERT_FILE` / `SSL_CERT_DIR` when either is set, as OpenSSL
//! does), plus the certificates of an optional CA file (PEM) for private endpoints. Why the
//! system's store and not a bundled list: it follows the host's trust configuration (a CA added
//! by the administrator is trusted, a distrusted one is removed by its updates) without
//! rebuilding taskbox.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{CertificateError, ClientConfig, RootCertStore};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use super::{HttpError, KeepReading};

/// Errors of setting up TLS (before any connection).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// the CA file cannot be read or parsed
    #[error("cannot read the CA file {path}: {why}")]
    CaFile { path: PathBuf, why: String },
    /// the CA file holds no certificate
    #[error("the CA file {path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")]
    CaFileEmpty { path: PathBuf },
    /// no root certificate to verify servers against
    #[error(
        "no trusted root certificates{why}: install the system's CA certificates \
         (ca-certificates), set SSL_CERT_FILE to a PEM bundle, or give a CA file"
    )]
    NoRoots { why: String },
    /// the TLS configuration cannot be built
    #[error("cannot set up TLS: {0}")]
    Setup(String),
}

/// A TLS client configuration: the trusted roots and the session cache, shared by every
/// connection of one [`super::Client`] (so repeated requests resume their sessions).
#[derive(Clone)]
pub struct Tls {
    config: Arc<ClientConfig>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").finish_non_exhaustive()
    }
}

impl Tls {
    /// Trusts the system's roots and, when given, the certificates of `ca_file` (PEM).
    pub fn new(ca_file: Option<&Path>) -> Result<Tls, TlsError> {
        let mut roots = RootCertStore::empty();
        let native = rustls_native_certs::load_native_certs();
        let (added, ignored) = roots.add_parsable_certificates(native.certs);
        if ignored > 0 || !native.errors.is_empty() {
            tracing::debug!(
                added,
                ignored,
                errors = ?native.errors.iter().map(|e| e.to_string()).collect::<Vec<_>>(),
                "system root certificates loaded with problems"
            );
        }
        if let Some(path) = ca_file {
            let bad = |why: String| TlsError::CaFile {
                path: path.to_owned(),
                why,
            };
            let pem = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
            let mut found = 0;
            for cert in CertificateDer::pem_slice_iter(&pem) {
                let cert = cert.map_err(|e| bad(e.to_string()))?;
                roots
                    .add(cert)
                    .map_err(|e| bad(format!("not a usable CA certificate: {e}")))?;
                found += 1;
            }
            if found == 0 {
                return Err(TlsError::CaFileEmpty {
                    path: path.to_owned(),
                });
            }
        }
        if roots.is_empty() {
            let why = native
                .errors
                .first()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default();
            return Err(TlsError::NoRoots { why });
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Setup(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Tls {
            config: Arc::new(config),
        })
    }

    /// Runs the handshake with `host` over `tcp` (the exchange's deadline bounds it).
    pub(super) async fn handshake(
        &self,
        host: &str,
        tcp: KeepReading<TcpStream>,
        target: &str,
    ) -> Result<TlsStream<KeepReading<TcpStream>>, HttpError> {
        let name = ServerName::try_from(host.to_owned()).map_err(|_| HttpError::Url {
            url: target.to_owned(),
            why: format!("{host:?} is not a valid DNS name or IP address for TLS"),
        })?;
        TlsConnector::from(self.config.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| {
                let tls = e
                    .get_ref()
                    .and_then(|inner| inner.downcast_ref::<rustls::Error>());
                match tls {
                    Some(err) => refused(host, target, err),
                    None => HttpError::Io {
                        target: target.to_owned(),
                        why: e.to_string(),
                    },
                }
            })
    }
}

/// The handshake failure, said so that a person knows what to change.
fn refused(host: &str, target: &str, err: &rustls::Error) -> HttpError {
    let mut unknown_issuer = false;
    let why = match err {
        rustls::Error::InvalidCertificate(c) => match c {
            CertificateError::UnknownIssuer => {
                unknown_issuer = true;
                "the server's certificate is not signed by a certificate authority this client \
                 trusts (the system's roots, SSL_CERT_FILE when set, and the CA file when given); \
                 if the server uses a private CA, give that CA's certificate (PEM) as the CA file"
                    .to_owned()
            }
            CertificateError::BadSignature => {
                unknown_issuer = true;
                "the server's certificate does not verify against the trusted certificate \
                 authority of its issuer's name (bad signature: another CA of the same name, \
                 such as a regenerated one, signed it); give the certificate (PEM) of the CA \
                 that signed it as the CA file"
                    .to_owned()
            }
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                format!(
                    "the server's certificate is not valid for the host {host:?} ({c}); use the \
                     host name the certificate was issued for in the URL"
                )
            }
            CertificateError::Expired
            | CertificateError::ExpiredContext { .. }
            | CertificateError::NotValidYet
            | CertificateError::NotValidYetContext { .. } => format!(
                "the server's certificate is outside its validity period ({c}); check this \
                 machine's clock, or have the server's certificate renewed"
            ),
            // webpki's reason comes wrapped in `Other`; its name is the stable part.
            CertificateError::Other(inner)
                if format!("{inner:?}").contains("CaUsedAsEndEntity") =>
            {
                "the server presents a CA certificate (basicConstraints CA:TRUE) as its own, \
                 as a self-signed certificate made with `openssl req -x509` defaults is; give \
                 the server a certificate with CA:FALSE and the host in subjectAltName (signed \
                 by a CA whose certificate is the CA file, or self-signed and itself the CA \
                 file)"
                    .to_owned()
            }
            other => format!("the server's certificate is refused: {other}"),
        },
        rustls::Error::AlertReceived(alert) => {
            format!("the server ended the handshake with the alert {alert:?}")
        }
        other => other.to_string(),
    };
    HttpError::Tls {
        target: target.to_owned(),
        why,
        unknown_issuer,
    }
}
