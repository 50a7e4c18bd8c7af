//! TLS of inspected connections: the sandbox's own CA and the certificates it mints per host
//! (the client's side), and how the real upstream's certificate is checked (the upstream's
//! side).
//!
//! Each sandbox with inspected hosts gets a CA of its own, made when its proxy starts: an
//! ECDSA P-256 key that never leaves the proxy's memory, and a certificate that only that
//! sandbox is told to trust. The CA is name-constrained to the sandbox's inspected names, so a
//! client that checks name constraints (OpenSSL, rustls, Go) would refuse anything it signed
//! for another name even if the key leaked. A leaf for a host is minted on the first
//! connection to it and cached (with its rustls configuration, whose session cache lets a
//! client resume) for the proxy's life.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, GeneralSubtree, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, NameConstraints,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use taskbox_core::netpattern::{HostMatch, HostPattern};

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// Making the CA or a certificate failed.
    #[error("cannot make a certificate: {0}")]
    Mint(#[from] rcgen::Error),
    /// rustls refused a configuration.
    #[error("cannot configure TLS: {0}")]
    Config(#[from] rustls::Error),
    /// No root certificate to check upstreams against.
    #[error("no trusted root certificate found on this host{0}")]
    NoRoots(String),
    /// The extra CA (PEM) given to the proxy is not usable.
    #[error("the extra CA is not usable: {0}")]
    ExtraCa(String),
}

/// Only what the protocols need: HTTP/1.1 on both sides (an h2 offer is answered with
/// HTTP/1.1, which every client falls back to).
const ALPN: &[&[u8]] = &[b"http/1.1"];

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A sandbox's CA, and the server configurations of the hosts it has minted for.
pub(crate) struct SandboxCa {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
    leaves: Mutex<HashMap<String, Arc<ServerConfig>>>,
}

/// A certificate's validity: from a day ago (clocks differ a little) for `days`.
fn validity(params: &mut CertificateParams, days: i64) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(1);
    params.not_after = now + time::Duration::days(days);
}

impl SandboxCa {
    /// A CA for sandbox `tag`, constrained to the names `hosts` cover.
    pub(crate) fn new(tag: &str, hosts: &[HostPattern]) -> Result<SandboxCa, TlsError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(
            DnType::CommonName,
            format!("taskbox egress CA for sandbox {tag}"),
        );
        params
            .distinguished_name
            .push(DnType::OrganizationName, "taskbox");
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let mut permitted: Vec<GeneralSubtree> = Vec::new();
        for pattern in hosts {
            let name = match &pattern.host {
                HostMatch::Exact(name) | HostMatch::Subdomains(name) => name.clone(),
                HostMatch::Any | HostMatch::Net(_) => continue,
            };
            let subtree = GeneralSubtree::DnsName(name);
            if !permitted.contains(&subtree) {
                permitted.push(subtree);
            }
        }
        params.name_constraints = Some(NameConstraints {
            permitted_subtrees: permitted,
            excluded_subtrees: Vec::new(),
        });
        validity(&mut params, 3650);
        let cert = params.self_signed(&key)?;
        Ok(SandboxCa {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The CA's certificate (PEM).
    pub(crate) fn pem(&self) -> &str {
        &self.pem
    }

    /// The server configuration presenting a certificate for `host` (a normalised name),
    /// minted on first use.
    pub(crate) fn server_config(&self, host: &str) -> Result<Arc<ServerConfig>, TlsError> {
        let mut leaves = self.leaves.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(config) = leaves.get(host) {
            return Ok(config.clone());
        }
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec![host.to_owned()])?;
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, host);
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        validity(&mut params, 397);
        let cert = params.signed_by(&key, &self.issuer)?;
        let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], key_der)?;
        config.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
        let config = Arc::new(config);
        leaves.insert(host.to_owned(), config.clone());
        Ok(config)
    }
}

/// How upstreams of inspected hosts are checked: the host's trusted roots, and an extra CA the
/// supervisor was given (never the sandbox: a sandbox cannot change what the proxy trusts).
pub(crate) struct UpstreamTls {
    pub(crate) config: Arc<ClientConfig>,
    /// The host's roots as PEM, the head of every sandbox's CA bundle.
    pub(crate) roots_pem: String,
}

impl UpstreamTls {
    /// The host's roots (`rustls-native-certs`: the system store, or `SSL_CERT_FILE` of the
    /// supervisor) and `extra` (PEM certificates).
    pub(crate) fn new(extra: Option<&[u8]>) -> Result<UpstreamTls, TlsError> {
        let mut roots = RootCertStore::empty();
        let native = rustls_native_certs::load_native_certs();
        let mut roots_pem = String::new();
        for cert in &native.certs {
            if roots.add(cert.clone()).is_ok() {
                roots_pem.push_str(&pem_certificate(cert));
            }
        }
        if !native.errors.is_empty() {
            tracing::debug!(
                errors = ?native.errors.iter().map(ToString::to_string).collect::<Vec<_>>(),
                "some system root certificates could not be loaded"
            );
        }
        if let Some(pem) = extra {
            let mut found = 0;
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|e| TlsError::ExtraCa(e.to_string()))?;
                roots
                    .add(cert)
                    .map_err(|e| TlsError::ExtraCa(format!("not a CA certificate: {e}")))?;
                found += 1;
            }
            if found == 0 {
                return Err(TlsError::ExtraCa("no PEM certificate in it".to_owned()));
            }
        }
        if roots.is_empty() {
            let why = native
                .errors
                .first()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default();
            return Err(TlsError::NoRoots(why));
        }
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
        Ok(UpstreamTls {
            config: Arc::new(config),
            roots_pem,
        })
    }
}

/// A DER certificate as PEM.
fn pem_certificate(der: &CertificateDer<'_>) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der.as_ref());
    let mut out = String::with_capacity(b64.len() + b64.len() / 64 + 64);
    out.push_str("-----BEGIN CERTIFICATE-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(chunk));
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

/// Says why an upstream's handshake failed, and whether its certificate was the reason.
pub(crate) fn upstream_failure(host: &str, port: u16, err: &std::io::Error) -> (bool, String) {
    let tls = err
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>());
    match tls {
        Some(rustls::Error::InvalidCertificate(c)) => (
            true,
            format!("the certificate of {host}:{port} is not valid ({c})"),
        ),
        Some(other) => (
            false,
            format!("the TLS handshake with {host}:{port} failed: {other}"),
        ),
        None => (
            false,
            format!("the TLS handshake with {host}:{port} failed: {err}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minted_leaf_is_cached_and_the_ca_is_pem() {
        let hosts: Vec<HostPattern> = vec!["api.test".parse().unwrap()];
        let ca = SandboxCa::new("sb-1", &hosts).unwrap();
        assert!(ca.pem().starts_with("-----BEGIN CERTIFICATE-----"));
        let a = ca.server_config("api.test").unwrap();
        let b = ca.server_config("api.test").unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(a.alpn_protocols, vec![b"http/1.1".to_vec()]);
    }
}
