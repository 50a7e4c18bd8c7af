//! Idempotency keys: a create or an applying export retried with the same `Idempotency-Key`
//! header (the IETF httpapi draft's name) is done once, and every retry gets the first answer.
//!
//! - **Scope.** A key belongs to its tenant: the table is kept per tenant, so the same key in
//!   two tenants names two independent operations, and no tenant can learn of another's keys.
//! - **Which request.** With a key goes the request's *fingerprint*: the SHA-256 of the
//!   operation, its sandbox (for an export) and the typed request serialized again (fields in
//!   their declared order, maps sorted, defaults filled in), so two bodies that mean the same
//!   thing match whatever their spacing or field order. The same key with another fingerprint
//!   is 422 `idempotency_key_reused`, before anything is done.
//! - **Once.** The first request with a key does the work on a task of its own, so a client that
//!   goes away mid-create still leaves the answer behind for its retry. A request with the key
//!   while that work runs waits for it and gets its answer; after it, the answer is replayed.
//!   Replays carry `Idempotent-Replayed: true`.
//! - **Successes are kept, errors are not.** An error answer frees the key (the requests waiting
//!   for that attempt get the same error): every error of these two routes means the change was
//!   not made, or, for an apply that failed midway, that running it again completes it (an apply
//!   writes the sandbox's state, it does not add to the host's).
//! - **Bounded.** An answer is kept [`Limits::idempotency_ttl`] (24 h by default) from when it
//!   was given. Each tenant holds at most `max_idempotency_keys_per_tenant` keys and
//!   `max_idempotency_bytes_per_tenant` bytes of kept answers; past either, its oldest answers
//!   go first (a retry after ten thousand newer requests is not one any client makes). When
//!   every key a tenant holds is still running, a new one is 429 `limit_exceeded`.
//! - **In memory.** The table lives as long as the process, as the sandboxes do: a restarted
//!   supervisor has destroyed every sandbox of the one before (see `docs/decisions.md`).
//!
//! [`Limits::idempotency_ttl`]: crate::config::Limits::idempotency_ttl

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use sha2::{Digest, Sha256};
use taskbox_core::api::ApiError;
use tokio::sync::watch;
use tracing::Instrument;

use crate::config::Limits;
use crate::error::{ErrorCode, HttpError};

/// The request header that carries a key.
pub const KEY_HEADER: &str = "idempotency-key";
/// The answer header that marks a replayed answer (`true`).
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// The longest key, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// A valid idempotency key: 1 to [`MAX_KEY_LEN`] printable ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Parses a header's value: a bare key, or the draft's form, a structured-field string
    /// (`"key"`, with `\"` and `\\` as its only escapes). Both name the same key.
    pub fn parse(raw: &[u8]) -> Result<IdempotencyKey, ApiError> {
        let bad = |why: &str| {
            ApiError::invalid(format!(
                "the Idempotency-Key header is invalid: {why}; a key is 1 to {MAX_KEY_LEN} \
                 printable ASCII characters (e.g. a UUID), sent bare or as a quoted string"
            ))
        };
        let key = match raw {
            [b'"', inner @ .., b'"'] => {
                let mut out = Vec::with_capacity(inner.len());
                let mut bytes = inner.iter();
                while let Some(&b) = bytes.next() {
                    match b {
                        b'\\' => match bytes.next() {
                            Some(&e @ (b'"' | b'\\')) => out.push(e),
                            _ => return Err(bad("a quoted key escapes only \" and \\")),
                        },
                        b'"' => return Err(bad("a quoted key has an unescaped \" inside")),
                        b => out.push(b),
                    }
                }
                out
            }
            _ => raw.to_vec(),
        };
        if key.is_empty() {
            return Err(bad("it is empty"));
        }
        if key.len() > MAX_KEY_LEN {
            return Err(bad(&format!("it is {} bytes long", key.len())));
        }
        if let Some(b) = key.iter().find(|b| !(b' '..=b'~').contains(*b)) {
            return Err(bad(&format!("it holds the byte 0x{b:02x}")));
        }
        // Only printable ASCII is left, so the bytes are UTF-8.
        Ok(IdempotencyKey(String::from_utf8_lossy(&key).into_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as a client sends it: the draft's structured-field string (`"key"`, with `"`
    /// and `\` escaped), which [`IdempotencyKey::parse`] reads back as this key.
    pub fn header_value(&self) -> String {
        let mut out = String::with_capacity(self.0.len() + 2);
        out.push('"');
        for c in self.0.chars() {
            if matches!(c, '"' | '\\') {
                out.push('\\');
            }
            out.push(c);
        }
        out.push('"');
        out
    }
}

/// The request's `Idempotency-Key`, if it has one; a bad one (or two of them) is 400
/// `invalid_argument` naming the header.
#[derive(Debug)]
pub struct KeyHeader(pub Option<IdempotencyKey>);

impl<S: Send + Sync> FromRequestParts<S> for KeyHeader {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<KeyHeader, HttpError> {
        let mut values = parts.headers.get_all(KEY_HEADER).iter();
        let Some(first) = values.next() else {
            return Ok(KeyHeader(None));
        };
        if values.next().is_some() {
            return Err(ApiError::invalid(
                "the Idempotency-Key header is given more than once; send one key",
            )
            .into());
        }
        Ok(KeyHeader(Some(IdempotencyKey::parse(first.as_bytes())?)))
    }
}

/// What a key stands for: the operation, its target and its request (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of `request` sent to `operation` (an operation id of the route table) on
    /// `target` (a sandbox id, or empty).
    pub fn of(operation: &str, target: &str, request: &impl Serialize) -> Fingerprint {
        let mut h = Sha256::new();
        for part in [operation, target] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        // Serializing a request type to memory cannot fail (string keys, no custom code); if
        // it ever did, the error's text stands in, which still tells requests apart by type.
        match serde_json::to_vec(request) {
            Ok(json) => h.update(&json),
            Err(e) => h.update(e.to_string().as_bytes()),
        }
        Fingerprint(h.finalize().into())
    }
}

/// An answer as it went out: what a retry gets again.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    /// The JSON body.
    pub body: Bytes,
    /// The error code, for an error answer.
    code: Option<&'static str>,
}

impl Answer {
    /// A JSON answer.
    pub fn json(status: StatusCode, value: &impl Serialize) -> Result<Answer, HttpError> {
        let body = serde_json::to_vec(value)
            .map_err(|e| ApiError::internal(format!("cannot encode the answer: {e}")))?;
        Ok(Answer {
            status,
            body: body.into(),
            code: None,
        })
    }

    fn error(e: &HttpError) -> Answer {
        Answer {
            status: e.status(),
            body: serde_json::to_vec(&e.body()).unwrap_or_default().into(),
            code: Some(e.code()),
        }
    }

    fn ok(&self) -> bool {
        self.code.is_none() && self.status.is_success()
    }

    fn response(&self, replayed: bool) -> Response {
        let mut r = (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            self.body.clone(),
        )
            .into_response();
        if replayed {
            r.headers_mut()
                .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
        }
        if let Some(code) = self.code {
            r.extensions_mut().insert(ErrorCode(code));
        }
        r
    }
}

/// The answer of a running attempt, once it has one (`None` before).
type Outcome = watch::Receiver<Option<Arc<Answer>>>;

enum Entry {
    Running {
        fingerprint: Fingerprint,
        outcome: Outcome,
        attempt: u64,
    },
    Answered {
        fingerprint: Fingerprint,
        answer: Arc<Answer>,
        expires: Instant,
    },
}

impl Entry {
    fn fingerprint(&self) -> Fingerprint {
        match self {
            Entry::Running { fingerprint, .. } | Entry::Answered { fingerprint, .. } => {
                *fingerprint
            }
        }
    }
}

/// One tenant's keys.
#[derive(Default)]
struct TenantKeys {
    entries: HashMap<IdempotencyKey, Entry>,
    /// The answered keys, oldest first: the order they expire in (the lifetime is one for all).
    answered: VecDeque<IdempotencyKey>,
    /// The bytes of their answers' bodies.
    bytes: usize,
}

impl TenantKeys {
    /// Drops answers that expired by `now`.
    fn purge(&mut self, now: Instant) {
        while let Some(key) = self.answered.front() {
            match self.entries.get(key) {
                Some(Entry::Answered { expires, .. }) if *expires > now => break,
                _ => {
                    self.evict_oldest();
                }
            }
        }
    }

    /// Drops the oldest answer; false when there is none.
    fn evict_oldest(&mut self) -> bool {
        let Some(key) = self.answered.pop_front() else {
            return false;
        };
        if let Some(Entry::Answered { answer, .. }) = self.entries.get(&key) {
            self.bytes = self.bytes.saturating_sub(answer.body.len());
            self.entries.remove(&key);
        }
        true
    }
}

/// What a request with a key does: the work, or wait for another's, or take a kept answer.
enum Claim {
    Lead(Lead),
    Wait(Outcome),
    Replay(Arc<Answer>),
}

/// The one attempt of a key that does the work; dropped without [`Lead::finish`] (its task
/// panicked or was cut), it frees the key and its waiters get an `internal` error.
struct Lead {
    table: Arc<Idempotency>,
    tenant: String,
    key: IdempotencyKey,
    attempt: u64,
    done: watch::Sender<Option<Arc<Answer>>>,
    finished: bool,
}

impl Lead {
    fn finish(mut self, answer: Answer, now: Instant) {
        let answer = Arc::new(answer);
        self.table.settle(&self, Some(&answer), now);
        self.finished = true;
        self.done.send_replace(Some(answer));
    }
}

impl Drop for Lead {
    fn drop(&mut self) {
        if !self.finished {
            let lead: &Lead = self;
            lead.table.settle(lead, None, Instant::now());
        }
    }
}

/// The keys of every tenant (see the module doc).
pub struct Idempotency {
    ttl: Duration,
    max_keys: usize,
    max_bytes: usize,
    tenants: Mutex<HashMap<String, TenantKeys>>,
    attempts: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("ttl", &self.ttl)
            .field("max_keys", &self.max_keys)
            .field("max_bytes", &self.max_bytes)
            .finish_non_exhaustive()
    }
}

impl Idempotency {
    /// An empty table with the bounds of `limits`.
    pub fn new(limits: &Limits) -> Idempotency {
        Idempotency {
            ttl: limits.idempotency_ttl,
            max_keys: limits.max_idempotency_keys_per_tenant.max(1),
            max_bytes: limits.max_idempotency_bytes_per_tenant,
            tenants: Mutex::new(HashMap::new()),
            attempts: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn tenants(&self) -> MutexGuard<'_, HashMap<String, TenantKeys>> {
        // Plain maps stay usable after a panic elsewhere.
        self.tenants
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// How many keys `tenant` holds (running and answered).
    pub fn keys(&self, tenant: &str) -> usize {
        self.tenants().get(tenant).map_or(0, |t| t.entries.len())
    }

    /// Drops the answers that expired, and the tenants left without keys.
    pub fn purge(&self) {
        let now = Instant::now();
        self.tenants().retain(|_, t| {
            t.purge(now);
            !t.entries.is_empty()
        });
    }

    fn claim(
        self: &Arc<Self>,
        tenant: &str,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        now: Instant,
    ) -> Result<Claim, HttpError> {
        let mut tenants = self.tenants();
        let t = tenants.entry(tenant.to_string()).or_default();
        t.purge(now);
        if let Some(entry) = t.entries.get(key) {
            if entry.fingerprint() != fingerprint {
                return Err(HttpError::IdempotencyKeyReused(format!(
                    "the Idempotency-Key {:?} was sent with another request (another operation, \
                     sandbox or body); a key names one request: send a new key for a new request",
                    key.as_str()
                )));
            }
            return Ok(match entry {
                Entry::Running { outcome, .. } => Claim::Wait(outcome.clone()),
                Entry::Answered { answer, .. } => Claim::Replay(answer.clone()),
            });
        }
        if t.entries.len() >= self.max_keys {
            if t.evict_oldest() {
                tracing::warn!(
                    tenant,
                    max = self.max_keys,
                    "idempotency keys: the tenant's oldest kept answer was dropped before it \
                     expired (max_idempotency_keys_per_tenant)"
                );
            } else {
                return Err(ApiError::LimitExceeded(format!(
                    "tenant {tenant} has {} requests with idempotency keys running \
                     (max_idempotency_keys_per_tenant); wait for one to end",
                    t.entries.len()
                ))
                .into());
            }
        }
        let attempt = self
            .attempts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (done, outcome) = watch::channel(None);
        t.entries.insert(
            key.clone(),
            Entry::Running {
                fingerprint,
                outcome,
                attempt,
            },
        );
        Ok(Claim::Lead(Lead {
            table: self.clone(),
            tenant: tenant.to_string(),
            key: key.clone(),
            attempt,
            done,
            finished: false,
        }))
    }

    /// Ends `lead`'s attempt: a success is kept; an error, or no answer, frees the key.
    fn settle(&self, lead: &Lead, answer: Option<&Arc<Answer>>, now: Instant) {
        let mut tenants = self.tenants();
        let Some(t) = tenants.get_mut(&lead.tenant) else {
            return;
        };
        let ours = matches!(
            t.entries.get(&lead.key),
            Some(Entry::Running { attempt, .. }) if *attempt == lead.attempt
        );
        if !ours {
            return;
        }
        match answer {
            Some(answer) if answer.ok() => {
                let fingerprint = t.entries.get(&lead.key).map(Entry::fingerprint);
                let Some(fingerprint) = fingerprint else {
                    return;
                };
                t.bytes += answer.body.len();
                t.entries.insert(
                    lead.key.clone(),
                    Entry::Answered {
                        fingerprint,
                        answer: answer.clone(),
                        expires: now + self.ttl,
                    },
                );
                t.answered.push_back(lead.key.clone());
                // The answer just kept stays, even alone over the bound: it is the one a
                // retry is most likely to ask for.
                while t.bytes > self.max_bytes && t.answered.len() > 1 {
                    t.evict_oldest();
                    tracing::warn!(
                        tenant = %lead.tenant,
                        max_bytes = self.max_bytes,
                        "idempotency keys: the tenant's oldest kept answer was dropped before \
                         it expired (max_idempotency_bytes_per_tenant)"
                    );
                }
            }
            _ => {
                t.entries.remove(&lead.key);
            }
        }
    }

    /// Serves a request with `key`: runs `work` once per key and fingerprint, on a task of its
    /// own (it finishes even if this request's client goes away), and answers every request
    /// with the key with its answer; `operation` names it in the metrics of replays.
    pub(crate) async fn run<W>(
        self: &Arc<Self>,
        state: &crate::state::AppState,
        operation: &'static str,
        tenant: &str,
        key: IdempotencyKey,
        fingerprint: Fingerprint,
        work: W,
    ) -> Result<Response, HttpError>
    where
        W: Future<Output = Result<Answer, HttpError>> + Send + 'static,
    {
        let (mut outcome, replayed) = match self.claim(tenant, &key, fingerprint, Instant::now())? {
            Claim::Replay(answer) => {
                state.metrics().idempotent_replay(operation);
                return Ok(answer.response(true));
            }
            Claim::Wait(outcome) => (outcome, true),
            Claim::Lead(lead) => {
                let outcome = lead.done.subscribe();
                tokio::spawn(
                    async move {
                        let answer = match work.await {
                            Ok(a) => a,
                            Err(e) => Answer::error(&e),
                        };
                        lead.finish(answer, Instant::now());
                    }
                    .instrument(tracing::Span::current()),
                );
                (outcome, false)
            }
        };
        let answer = match outcome.wait_for(Option::is_some).await {
            Ok(done) => done.clone(),
            Err(_) => None,
        };
        match answer {
            Some(answer) => {
                if replayed {
                    state.metrics().idempotent_replay(operation);
                }
                Ok(answer.response(replayed))
            }
            None => Err(ApiError::internal(
                "the request with this Idempotency-Key ended without an answer; nothing was \
                 kept for the key: send the request again",
            )
            .into()),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use taskbox_core::api::{CreateRequest, ExportRequest};

    fn key(s: &str) -> IdempotencyKey {
        IdempotencyKey::parse(s.as_bytes()).unwrap()
    }

    fn table(max_keys: usize, max_bytes: usize) -> Arc<Idempotency> {
        Arc::new(Idempotency::new(&Limits {
            idempotency_ttl: Duration::from_secs(60),
            max_idempotency_keys_per_tenant: max_keys,
            max_idempotency_bytes_per_tenant: max_bytes,
            ..Limits::default()
        }))
    }

    fn fp(n: u8) -> Fingerprint {
        Fingerprint([n; 32])
    }

    fn ok(body: &str) -> Answer {
        Answer {
            status: StatusCode::CREATED,
            body: Bytes::copy_from_slice(body.as_bytes()),
            code: None,
        }
    }

    fn lead(c: Claim) -> Lead {
        match c {
            Claim::Lead(l) => l,
            _ => panic!("expected to lead"),
        }
    }

    fn replayed(c: Claim) -> String {
        match c {
            Claim::Replay(a) => String::from_utf8(a.body.to_vec()).unwrap(),
            _ => panic!("expected a replay"),
        }
    }

    #[test]
    fn keys_are_printable_ascii_of_1_to_255_bytes_bare_or_quoted() {
        assert_eq!(key("abc-123").as_str(), "abc-123");
        assert_eq!(key("\"abc-123\"").as_str(), "abc-123");
        assert_eq!(key(r#""a\"b\\c""#).as_str(), r#"a"b\c"#);
        assert_eq!(key("a b").as_str(), "a b");
        assert_eq!(key(&"k".repeat(255)).as_str().len(), 255);
        for k in ["plain", r#"a"b\c"#, "\"quoted\"", " spaced "] {
            let parsed = key(k);
            let sent = parsed.header_value();
            assert!(sent.starts_with('"') && sent.ends_with('"'), "{sent}");
            assert_eq!(key(&sent), parsed, "{k:?} is read back from {sent:?}");
        }
        for bad in [
            "".as_bytes(),
            b"\"\"",
            "k".repeat(256).as_bytes(),
            b"tab\there",
            "caf\u{e9}".as_bytes(),
            b"\"a\"b\"",
            br#""a\nb""#,
        ] {
            let e = IdempotencyKey::parse(bad).unwrap_err();
            assert_eq!(e.code(), "invalid_argument", "{bad:?}");
            assert!(e.to_string().contains("Idempotency-Key"), "{e}");
        }
    }

    #[test]
    fn every_byte_is_a_key_exactly_when_printable_and_every_key_survives_quoting() {
        for b in 0..=255u8 {
            let printable = (b' '..=b'~').contains(&b);
            assert_eq!(
                IdempotencyKey::parse(&[b]).is_ok(),
                printable,
                "byte {b:#04x}"
            );
            assert_eq!(
                IdempotencyKey::parse(&[b'k', b, b'k']).is_ok(),
                printable,
                "byte {b:#04x} inside"
            );
            if printable {
                let k = IdempotencyKey::parse(&[b'a', b, b'"', b'\\', b]).unwrap();
                assert_eq!(key(&k.header_value()), k, "byte {b:#04x}");
            }
        }
    }

    #[test]
    fn a_fingerprint_is_the_request_meant_not_its_spelling() {
        let a: CreateRequest =
            serde_json::from_str(r#"{"workspace":"w","labels":{"b":"1","a":"2"}}"#).unwrap();
        let b: CreateRequest = serde_json::from_str(
            r#"{ "labels": {"a":"2", "b":"1"}, "env": {}, "workspace": "w" }"#,
        )
        .unwrap();
        let c: CreateRequest = serde_json::from_str(r#"{"workspace":"w2"}"#).unwrap();
        let of = |r: &CreateRequest| Fingerprint::of("create_sandbox", "", r);
        assert_eq!(of(&a), of(&b));
        assert_ne!(of(&a), of(&c));
        let e = ExportRequest {
            apply: true,
            ..ExportRequest::default()
        };
        assert_ne!(
            Fingerprint::of("export", "sb-1", &e),
            Fingerprint::of("export", "sb-2", &e),
            "another sandbox is another request"
        );
        // The parts are length-prefixed: moving a byte from one to the other changes it.
        assert_ne!(
            Fingerprint::of("ab", "c", &e),
            Fingerprint::of("a", "bc", &e)
        );
    }

    #[test]
    fn an_answer_is_replayed_and_another_request_with_its_key_is_refused() {
        let t = table(10, 1 << 20);
        let now = Instant::now();
        let k = key("k");
        lead(t.claim("alice", &k, fp(1), now).unwrap()).finish(ok("first"), now);
        assert_eq!(replayed(t.claim("alice", &k, fp(1), now).unwrap()), "first");
        let e = t.claim("alice", &k, fp(2), now).err().unwrap();
        assert_eq!(
            (e.code(), e.status().as_u16()),
            ("idempotency_key_reused", 422)
        );
        // Another tenant's key of the same name is its own.
        lead(t.claim("bob", &k, fp(2), now).unwrap()).finish(ok("bob's"), now);
        assert_eq!(replayed(t.claim("bob", &k, fp(2), now).unwrap()), "bob's");
        assert_eq!(replayed(t.claim("alice", &k, fp(1), now).unwrap()), "first");
    }

    #[test]
    fn a_running_attempt_is_waited_for_and_an_error_or_a_lost_attempt_frees_the_key() {
        let t = table(10, 1 << 20);
        let now = Instant::now();
        let k = key("k");
        let first = lead(t.claim("alice", &k, fp(1), now).unwrap());
        let Claim::Wait(mut waiting) = t.claim("alice", &k, fp(1), now).unwrap() else {
            panic!("expected to wait");
        };
        assert!(waiting.borrow().is_none());
        let err = HttpError::Api(ApiError::Unavailable("the daemon is down".into()));
        first.finish(Answer::error(&err), now);
        let got = waiting.borrow_and_update().clone().unwrap();
        assert_eq!(got.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(t.keys("alice"), 0, "an error is not kept");
        // A retry runs again, and may send another body now.
        let second = lead(t.claim("alice", &k, fp(2), now).unwrap());
        drop(second);
        assert_eq!(
            t.keys("alice"),
            0,
            "an attempt that ended without an answer is not kept"
        );
        lead(t.claim("alice", &k, fp(2), now).unwrap()).finish(ok("done"), now);
        assert_eq!(replayed(t.claim("alice", &k, fp(2), now).unwrap()), "done");
    }

    #[test]
    fn answers_expire_and_the_bounds_drop_the_oldest_first() {
        let t = table(3, 10);
        let now = Instant::now();
        for (i, k) in ["a", "b", "c"].into_iter().enumerate() {
            let at = now + Duration::from_secs(i as u64);
            lead(t.claim("alice", &key(k), fp(1), at).unwrap()).finish(ok("xx"), at);
        }
        assert_eq!(t.keys("alice"), 3);
        // A fourth key drops the oldest answer ("a").
        let at = now + Duration::from_secs(3);
        lead(t.claim("alice", &key("d"), fp(1), at).unwrap()).finish(ok("xx"), at);
        assert_eq!(t.keys("alice"), 3);
        assert!(matches!(
            t.claim("alice", &key("b"), fp(1), at).unwrap(),
            Claim::Replay(_)
        ));
        let Claim::Lead(again) = t.claim("alice", &key("a"), fp(9), at).unwrap() else {
            panic!("a dropped key is a new one");
        };
        drop(again);
        // Bytes: a 9-byte answer leaves room for itself and nothing older.
        let at = now + Duration::from_secs(4);
        lead(t.claim("alice", &key("e"), fp(1), at).unwrap()).finish(ok("123456789"), at);
        assert_eq!(t.keys("alice"), 1);
        assert_eq!(
            replayed(t.claim("alice", &key("e"), fp(1), at).unwrap()),
            "123456789"
        );
        // Alone over the bound, an answer is still kept.
        let at = now + Duration::from_secs(5);
        lead(t.claim("alice", &key("f"), fp(1), at).unwrap()).finish(ok(&"x".repeat(50)), at);
        assert_eq!(t.keys("alice"), 1);
        // Expiry: 60 s after its answer a key is forgotten.
        let later = at + Duration::from_secs(61);
        assert!(matches!(
            t.claim("alice", &key("f"), fp(2), later).unwrap(),
            Claim::Lead(_)
        ));
        assert_eq!(t.keys("alice"), 0);
    }

    #[test]
    fn running_keys_are_never_dropped_a_full_table_of_them_refuses() {
        let t = table(2, 1 << 20);
        let now = Instant::now();
        let _a = lead(t.claim("alice", &key("a"), fp(1), now).unwrap());
        let _b = lead(t.claim("alice", &key("b"), fp(1), now).unwrap());
        let e = t.claim("alice", &key("c"), fp(1), now).err().unwrap();
        assert_eq!((e.code(), e.status().as_u16()), ("limit_exceeded", 429));
        assert!(matches!(
            t.claim("bob", &key("c"), fp(1), now).unwrap(),
            Claim::Lead(_)
        ));
    }

    #[test]
    fn purge_forgets_expired_answers_and_empty_tenants() {
        let t = Arc::new(Idempotency::new(&Limits {
            idempotency_ttl: Duration::ZERO,
            ..Limits::default()
        }));
        let now = Instant::now();
        lead(t.claim("alice", &key("a"), fp(1), now).unwrap()).finish(ok("x"), now);
        t.purge();
        assert_eq!(t.keys("alice"), 0);
        assert!(t.tenants().is_empty());
    }
}
