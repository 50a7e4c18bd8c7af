//! The model client over HTTPS: mock model servers that present a certificate made for the test
//! (a throwaway CA from the `openssl` tool), reached over a real TLS connection on a local
//! socket. The loop completes a task over HTTPS with the CA given as the CA file; a server whose
//! certificate chains to no trusted root, or names another host, is refused before any request
//! is sent, with a message that says what to do.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use taskbox_agent::Termination;
use taskbox_agent::http::{Client, HttpError, Request};
use taskbox_agent::mock::{MockServer, MockTls, Step};
use taskbox_agent::model::{Finish, Message, ModelConfig, ModelError, ModelRequest, Provider};

fn request() -> ModelRequest {
    ModelRequest {
        system: "s".into(),
        messages: vec![Message::user("u")],
        tools: vec![],
        max_tokens: 10,
    }
}

fn trusting(mock: &MockServer, provider: Provider, pki: &Pki) -> ModelConfig {
    let mut cfg = model_config(mock, provider);
    cfg.ca_file = Some(pki.ca.clone());
    cfg
}

#[test]
fn the_loop_fixes_the_repository_over_https_with_both_protocols() {
    let Some(pki) = Pki::new(&["localhost"]) else {
        return;
    };
    for provider in [Provider::Openai, Provider::Anthropic] {
        let fx = Fx::new();
        let mock = MockServer::start_tls(provider, fixing_steps(), pki.server()).unwrap();
        assert!(
            mock.base_url().starts_with("https://localhost:"),
            "{}",
            mock.base_url()
        );
        let model = trusting(&mock, provider, &pki).build().unwrap();
        let report =
            taskbox_agent::start(fx.api.clone(), model, fx.spec(fx.contract()), fx.options())
                .unwrap();
        assert_eq!(report.termination, Termination::Completed, "{report:#?}");
        assert!(
            report.diff.contains("+add() { echo $(( $1 + $2 )); }"),
            "{provider:?}: {}",
            report.diff
        );
        // Every request crossed the TLS connection intact: headers (the key) and JSON body.
        let got = mock.received();
        assert_eq!(got.len(), 4, "{provider:?}");
        match provider {
            Provider::Openai => {
                assert_eq!(got[0].header("authorization"), Some("Bearer test-key"));
                assert_eq!(got[0].path, "/v1/chat/completions");
            }
            Provider::Anthropic => {
                assert_eq!(got[0].header("x-api-key"), Some("test-key"));
                assert_eq!(got[0].path, "/v1/messages");
            }
        }
        assert_eq!(got[0].body["model"], "mock-model");
        let host = got[0].header("host").unwrap();
        assert!(host.starts_with("localhost:"), "{host}");
    }
}

#[test]
fn over_https_5xx_is_retried_and_chunked_answers_are_read() {
    let Some(pki) = Pki::new(&["localhost"]) else {
        return;
    };
    for provider in [Provider::Openai, Provider::Anthropic] {
        let steps = vec![
            Step::status(503, Some("0")),
            Step::cut("partial answer, long enough to span several chunks of the body").chunked(),
        ];
        let mock = MockServer::start_tls(provider, steps, pki.server()).unwrap();
        let r = trusting(&mock, provider, &pki)
            .build()
            .unwrap()
            .complete(&request())
            .unwrap();
        assert_eq!(
            r.attempts, 2,
            "{provider:?}: a new connection and handshake"
        );
        assert_eq!(r.finish, Finish::Length, "{provider:?}");
        assert_eq!(
            r.text,
            "partial answer, long enough to span several chunks of the body"
        );
        assert_eq!(mock.received().len(), 2);
    }
}

#[test]
fn an_https_answer_is_bounded_by_the_timeout() {
    let Some(pki) = Pki::new(&["localhost"]) else {
        return;
    };
    let steps = vec![Step::text("late").delayed(Duration::from_secs(3))];
    let mock = MockServer::start_tls(Provider::Openai, steps, pki.server()).unwrap();
    let mut cfg = trusting(&mock, Provider::Openai, &pki);
    cfg.timeout_secs = 1;
    cfg.max_retries = 0;
    let started = std::time::Instant::now();
    let e = cfg.build().unwrap().complete(&request()).unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::Unreachable {
                source: HttpError::Timeout { .. },
                ..
            }
        ),
        "{e}"
    );
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn an_untrusted_certificate_is_refused_and_the_message_says_what_to_do() {
    let (Some(pki), Some(other)) = (Pki::new(&["localhost"]), Pki::new(&["localhost"])) else {
        return;
    };
    for provider in [Provider::Openai, Provider::Anthropic] {
        let mock =
            MockServer::start_tls(provider, vec![Step::text("never")], pki.server()).unwrap();
        // The system's roots only, then another CA's file: neither signed the server's
        // certificate.
        for ca_file in [None, Some(other.ca.clone())] {
            let mut cfg = model_config(&mock, provider);
            cfg.ca_file = ca_file.clone();
            let e = cfg.build().unwrap().complete(&request()).unwrap_err();
            let ModelError::Tls(HttpError::Tls {
                unknown_issuer: true,
                ..
            }) = &e
            else {
                panic!("{provider:?} {ca_file:?}: not a refused certificate: {e}");
            };
            let msg = e.to_string();
            assert!(
                msg.contains("not signed by a certificate authority this client trusts"),
                "{msg}"
            );
            assert!(msg.contains("--ca-file"), "{msg}");
            assert!(msg.contains("TASKBOX_MODEL_CA_FILE"), "{msg}");
        }
        // Refused during the handshake: no request (prompt, key) reached the server, and a
        // refusal is not retried.
        assert!(mock.received().is_empty(), "{:?}", mock.received());
        assert_eq!(mock.used(), [0]);
    }
}

#[test]
fn a_certificate_from_another_ca_of_the_same_name_is_refused() {
    let (Some(pki), Some(twin)) = (
        Pki::with_ca_name(Some("taskbox twin CA"), &["localhost"]),
        Pki::with_ca_name(Some("taskbox twin CA"), &["localhost"]),
    ) else {
        return;
    };
    let mock = MockServer::start_tls(Provider::Anthropic, vec![Step::text("never")], pki.server())
        .unwrap();
    let mut cfg = model_config(&mock, Provider::Anthropic);
    cfg.ca_file = Some(twin.ca.clone());
    let e = cfg.build().unwrap().complete(&request()).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            ModelError::Tls(HttpError::Tls {
                unknown_issuer: true,
                ..
            })
        ),
        "{msg}"
    );
    assert!(msg.contains("another CA of the same name"), "{msg}");
    assert!(msg.contains("--ca-file"), "{msg}");
    assert!(mock.received().is_empty());
}

#[test]
fn a_certificate_for_another_host_is_refused() {
    let (Some(localhost), Some(elsewhere)) = (Pki::new(&["localhost"]), Pki::new(&["model.test"]))
    else {
        return;
    };
    // Trusted CA, but the URL names 127.0.0.1, which the certificate does not.
    let mock = MockServer::start_tls(Provider::Openai, vec![], localhost.server()).unwrap();
    let mut cfg = trusting(&mock, Provider::Openai, &localhost);
    cfg.base_url = mock.base_url_for("127.0.0.1");
    let e = cfg.build().unwrap().complete(&request()).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            ModelError::Tls(HttpError::Tls {
                unknown_issuer: false,
                ..
            })
        ),
        "{msg}"
    );
    assert!(
        msg.contains("not valid for the host \"127.0.0.1\""),
        "{msg}"
    );
    assert!(msg.contains("localhost"), "the names it holds: {msg}");
    assert!(
        !msg.contains("--ca-file"),
        "a CA file would not help: {msg}"
    );
    assert!(mock.received().is_empty());

    // A certificate made for model.test, reached as localhost.
    let mock = MockServer::start_tls(Provider::Openai, vec![], elsewhere.server()).unwrap();
    let client = Client::new(&mock.base_url(), Some(&elsewhere.ca)).unwrap();
    let e = client
        .send(&Request::new("GET", "/v1/models"), Duration::from_secs(10))
        .unwrap_err();
    assert!(matches!(e, HttpError::Tls { .. }), "{e}");
    assert!(
        !e.is_transient(),
        "a refused certificate is not retried: {e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("\"localhost\"") && msg.contains("model.test"),
        "{msg}"
    );
    assert!(mock.received().is_empty());
}

#[test]
fn a_server_presenting_a_ca_certificate_is_refused_with_how_to_make_one() {
    let Some(pki) = Pki::new(&["localhost"]) else {
        return;
    };
    // The CA's own certificate (CA:TRUE, self-signed) as the server's, the CA trusted.
    let tls = MockTls::from_pem_files(&pki.ca, &pki.ca_key).unwrap();
    let mock = MockServer::start_tls(Provider::Openai, vec![Step::text("never")], tls).unwrap();
    let e = trusting(&mock, Provider::Openai, &pki)
        .build()
        .unwrap()
        .complete(&request())
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ModelError::Tls(_)), "{msg}");
    assert!(msg.contains("CA:FALSE"), "{msg}");
    assert!(mock.received().is_empty());
}

#[test]
fn a_self_signed_server_certificate_is_its_own_ca_file() {
    let Some(pki) = Pki::new(&["localhost"]) else {
        return;
    };
    // A self-signed leaf (CA:FALSE, the host in subjectAltName), as private servers often have.
    let dir = pki.dir.path();
    let out = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
        ])
        .args([
            "-nodes", "-keyout", "self.key", "-out", "self.pem", "-days", "2",
        ])
        .args([
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
        ])
        .args(["-addext", "basicConstraints=critical,CA:FALSE"])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tls = MockTls::from_pem_files(&dir.join("self.pem"), &dir.join("self.key")).unwrap();
    let mock = MockServer::start_tls(Provider::Openai, vec![Step::text("hello")], tls).unwrap();
    let mut cfg = model_config(&mock, Provider::Openai);
    cfg.ca_file = Some(dir.join("self.pem"));
    let r = cfg.build().unwrap().complete(&request()).unwrap();
    assert_eq!(r.text, "hello");
    assert_eq!(mock.received().len(), 1);
}

#[test]
fn a_bad_ca_file_is_a_configuration_error_naming_the_file() {
    let Some(pki) = Pki::new(&["localhost"]) else {
        return;
    };
    // The server's key is PEM, but not a certificate.
    let mut cfg = ModelConfig::new(Provider::Openai, "https://localhost:1/v1", "m");
    cfg.ca_file = Some(pki.key.clone());
    let Err(ModelError::Config(msg)) = cfg.build() else {
        panic!("a CA file without a certificate must be refused");
    };
    assert!(msg.contains(&pki.key.display().to_string()), "{msg}");
    assert!(msg.contains("holds no PEM certificate"), "{msg}");
}
