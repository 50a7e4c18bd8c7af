//! The connection front: accepting on TCP and the Unix socket and serving each connection with
//! hyper under the server's caps and timeouts, which axum's own `serve` does not have.
//!
//! For each connection:
//! - **Peer check** (Unix socket): a peer inside a sandbox ([`crate::peer`]) is closed before
//!   anything is read, as is one that cannot be inspected. The pid is pinned with a pidfd
//!   (`SO_PEERPIDFD`) where the kernel has one, so a peer that exits cannot lend its pid to
//!   another process while it is inspected.
//! - **Caps**: open connections per client (the peer's uid on the Unix socket, its IP address
//!   over TCP) and in total. Past one, the connection is answered 429 (its client's cap) or 503
//!   (the total) with `Retry-After` by a bounded number of short-lived answerers, and closed
//!   without an answer past those.
//! - **Timeouts**: a connection without a request in progress is closed after `idle_timeout`;
//!   a request's headers must arrive within `header_timeout` of its first byte; its body may not
//!   pause for `body_timeout` (408, see [`crate::body`]); an answer the client does not read for
//!   `idle_timeout` ends the connection.
//! - **Caller**: each request carries the connection's [`Caller`] (the peer's credentials or
//!   address) in its extensions.
//! - **Memory**: nothing is allocated for hyper's buffers before a connection's first byte, and
//!   the heap is trimmed when a burst of connections has closed ([`crate::sys::trim_heap`]).

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, Request, Response, header};
use axum::response::IntoResponse;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use taskbox_core::api::ApiError;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::body::{Guarded, TimedBody};
use crate::caller::Caller;
use crate::config::Connections;
use crate::error::HttpError;
use crate::peer::{Procfs, Verdict};
use crate::state::AppState;
use crate::sys;

/// What the listeners and their connections are asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Serving,
    /// Accept no more; finish the requests in progress, close idle connections.
    Draining,
    /// Close every connection now.
    Closing,
}

/// The most a connection buffers (hyper's default is about 400 KiB): also the largest request
/// head, past which hyper answers 431. Bounds what the caps let clients make the server hold.
const MAX_BUF: usize = 64 * 1024;
/// Refused connections answered 429/503 at the same time; past it they are closed unanswered.
const MAX_ANSWERING: usize = 64;
/// How long a refused connection has to send its request's headers.
const REFUSAL_HEAD_TIMEOUT: Duration = Duration::from_secs(2);
/// The heap is trimmed once at least this many connections have closed since the last peak
/// (and at least half of them).
const TRIM_AFTER: usize = 64;

/// Who a connection's caps count against.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Client {
    Uid(u32),
    Ip(IpAddr),
}

impl fmt::Display for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Client::Uid(u) => write!(f, "uid {u}"),
            Client::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// A stream the front can serve.
pub(crate) trait Stream: AsyncRead + AsyncWrite + AsFd + Unpin + Send + 'static {
    /// Completes when the stream may be readable (data, end of stream or an error).
    fn readable(&self) -> impl Future<Output = io::Result<()>> + Send + '_;
    /// Reads what is there without waiting (`WouldBlock` when nothing is).
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize>;
}

impl Stream for TcpStream {
    fn readable(&self) -> impl Future<Output = io::Result<()>> + Send + '_ {
        TcpStream::readable(self)
    }

    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        TcpStream::try_read(self, buf)
    }
}

impl Stream for UnixStream {
    fn readable(&self) -> impl Future<Output = io::Result<()>> + Send + '_ {
        UnixStream::readable(self)
    }

    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        UnixStream::try_read(self, buf)
    }
}

/// Who is at the other end of a new connection.
pub(crate) struct Peer {
    client: Client,
    /// The peer's pid in our pid namespace (0: outside it), for a Unix socket's peer check.
    pid: Option<i32>,
    /// What the handlers see of it (in every request's extensions).
    caller: Caller,
}

/// A listener the front can accept on.
pub(crate) trait Listener: Send + 'static {
    type Stream: Stream;
    fn accept(&self) -> impl Future<Output = io::Result<(Self::Stream, Peer)>> + Send;
}

impl Listener for TcpListener {
    type Stream = TcpStream;
    async fn accept(&self) -> io::Result<(TcpStream, Peer)> {
        let (s, addr) = TcpListener::accept(self).await?;
        let peer = Peer {
            client: Client::Ip(addr.ip()),
            pid: None,
            caller: Caller::Tcp(addr),
        };
        Ok((s, peer))
    }
}

impl Listener for UnixListener {
    type Stream = UnixStream;
    async fn accept(&self) -> io::Result<(UnixStream, Peer)> {
        let (s, _) = UnixListener::accept(self).await?;
        let cred = s.peer_cred()?;
        let pid = cred.pid().unwrap_or(0);
        let peer = Peer {
            client: Client::Uid(cred.uid()),
            pid: Some(pid),
            caller: Caller::Unix {
                uid: cred.uid(),
                gid: cred.gid(),
                pid: Some(pid).filter(|p| *p > 0),
            },
        };
        Ok((s, peer))
    }
}

/// Why a connection was turned away by a cap.
#[derive(Debug, Clone)]
enum Refusal {
    Total(usize),
    PerClient(Client, usize),
}

impl Refusal {
    fn reason(&self) -> &'static str {
        match self {
            Refusal::Total(_) => "max_connections",
            Refusal::PerClient(..) => "max_connections_per_client",
        }
    }

    fn error(&self) -> HttpError {
        HttpError::Api(match self {
            Refusal::Total(n) => ApiError::Unavailable(format!(
                "the server has {n} connections open, its limit (max_connections); try again shortly"
            )),
            Refusal::PerClient(c, n) => ApiError::LimitExceeded(format!(
                "{c} has {n} connections open, the limit per client \
                 (max_connections_per_client); close some or try again shortly"
            )),
        })
    }

    fn response(&self) -> Response<Body> {
        let mut r = self.error().into_response();
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        r.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        r
    }
}

/// At most one log line a second for a noisy event; says how many were left out.
#[derive(Default)]
struct Throttle {
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    /// `Some(n)` when a line may be logged now, `n` the events not logged since the last one.
    fn pass(&self) -> Option<u64> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        match s.0 {
            Some(last) if now.duration_since(last) < Duration::from_secs(1) => {
                s.1 += 1;
                None
            }
            _ => {
                let skipped = s.1;
                *s = (Some(now), 0);
                Some(skipped)
            }
        }
    }
}

#[derive(Default)]
struct Counts {
    total: usize,
    per_client: HashMap<Client, usize>,
    /// The most connections open since the heap was last trimmed.
    peak: usize,
}

/// The caps, timeouts and peer check shared by all listeners of one server.
pub(crate) struct Front {
    limits: Connections,
    state: AppState,
    counts: Mutex<Counts>,
    answering: AtomicUsize,
    procfs: Procfs,
    /// Our depth in the pid namespace tree, or why peers cannot be inspected.
    own_depth: Result<usize, String>,
    refused_log: Throttle,
    cap_log: Throttle,
    accept_log: Throttle,
}

/// A connection's place under the caps; dropping it frees the place.
pub(crate) struct Permit {
    front: Arc<Front>,
    client: Client,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut c = self.front.counts();
        c.total = c.total.saturating_sub(1);
        if let Some(n) = c.per_client.get_mut(&self.client) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                c.per_client.remove(&self.client);
            }
        }
        self.front.state.metrics().connection_ended(c.total);
    }
}

impl Front {
    pub(crate) fn new(limits: Connections, state: AppState) -> Arc<Front> {
        let procfs = Procfs::system();
        let own_depth = procfs.own_depth().map_err(|e| e.to_string());
        if let Err(e) = &own_depth {
            tracing::error!(
                error = %e,
                "cannot inspect the peers of the unix socket: every peer with a pid is refused"
            );
        }
        Arc::new(Front {
            limits,
            state,
            counts: Mutex::new(Counts::default()),
            answering: AtomicUsize::new(0),
            procfs,
            own_depth,
            refused_log: Throttle::default(),
            cap_log: Throttle::default(),
            accept_log: Throttle::default(),
        })
    }

    fn counts(&self) -> MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Open connections now.
    pub(crate) fn open(&self) -> usize {
        self.counts().total
    }

    fn admit(self: &Arc<Self>, client: &Client) -> Result<Permit, Refusal> {
        let mut c = self.counts();
        if c.total >= self.limits.max_total {
            return Err(Refusal::Total(self.limits.max_total));
        }
        let mine = c.per_client.get(client).copied().unwrap_or(0);
        if mine >= self.limits.max_per_client {
            return Err(Refusal::PerClient(
                client.clone(),
                self.limits.max_per_client,
            ));
        }
        c.per_client.insert(client.clone(), mine + 1);
        c.total += 1;
        c.peak = c.peak.max(c.total);
        self.state.metrics().connection_opened(c.total);
        Ok(Permit {
            front: self.clone(),
            client: client.clone(),
        })
    }

    /// Whether the Unix socket's peer `pid` may be served: not from inside a sandbox, and
    /// inspected for sure. `Err` names why not and is the metrics' reason.
    fn check_peer(&self, stream: &impl AsFd, pid: i32) -> Result<(), (&'static str, String)> {
        if pid == 0 {
            // Outside our pid namespace tree: no sandbox of ours lives there.
            return Ok(());
        }
        let uninspectable = |why: String| ("uninspectable_peer", why);
        let depth = *self
            .own_depth
            .as_ref()
            .map_err(|e| uninspectable(e.clone()))?;
        let pidfd = sys::peer_pidfd(stream.as_fd()).map_err(|e| {
            uninspectable(format!(
                "the process that connected (pid {pid}) is gone: {e}"
            ))
        })?;
        let verdict = self
            .procfs
            .classify(pid, depth)
            .map_err(|e| uninspectable(format!("cannot inspect pid {pid}: {e}")))?;
        if let Some(fd) = &pidfd
            && sys::pidfd_exited(fd.as_fd())
        {
            return Err(uninspectable(format!(
                "pid {pid} exited while it was inspected"
            )));
        }
        match verdict {
            Verdict::Sandboxed { helper } => Err((
                "sandboxed_peer",
                format!(
                    "pid {pid} runs inside a sandbox (its ancestor {helper} is {})",
                    crate::peer::HELPER_NAME
                ),
            )),
            Verdict::SameNamespace | Verdict::Nested => Ok(()),
        }
    }

    /// Answers a connection over a cap (or closes it when many are being answered already).
    fn turn_away<S: Stream>(self: &Arc<Self>, stream: S, refusal: Refusal, tasks: &TaskTracker) {
        self.state.metrics().connection_refused(refusal.reason());
        if let Some(skipped) = self.cap_log.pass() {
            tracing::warn!(
                limit = refusal.reason(),
                skipped,
                "connection over a cap turned away"
            );
        }
        if self.answering.fetch_add(1, Ordering::SeqCst) >= MAX_ANSWERING {
            self.answering.fetch_sub(1, Ordering::SeqCst);
            return;
        }
        let front = self.clone();
        tasks.spawn(async move {
            let answer = async move {
                let svc = hyper::service::service_fn(move |_req: Request<Incoming>| {
                    let r = refusal.response();
                    async move { Ok::<_, Infallible>(r) }
                });
                let mut b = http1::Builder::new();
                b.timer(TokioTimer::new())
                    .header_read_timeout(REFUSAL_HEAD_TIMEOUT)
                    .keep_alive(false);
                let _ = b.serve_connection(TokioIo::new(stream), svc).await;
            };
            let _ = tokio::time::timeout(2 * REFUSAL_HEAD_TIMEOUT, answer).await;
            front.answering.fetch_sub(1, Ordering::SeqCst);
        });
    }

    async fn accept_failed(&self, e: &io::Error) {
        if let Some(skipped) = self.accept_log.pass() {
            tracing::warn!(error = %e, skipped, "cannot accept a connection");
        }
        // Out of descriptors (or memory): let connections end before trying again.
        if matches!(
            e.raw_os_error(),
            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
        ) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Trims the heap after bursts of connections, forever (see [`crate::sys::trim_heap`]):
    /// every second while many connections have closed since the peak, until the count settles.
    pub(crate) async fn run_trimmer(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = 0;
        loop {
            tick.tick().await;
            let due = {
                let mut c = self.counts();
                let due = c.peak >= c.total + TRIM_AFTER && c.total <= c.peak / 2;
                if due && c.total == last {
                    // Settled: this trim is the last for this burst.
                    c.peak = c.total;
                }
                last = c.total;
                due
            };
            if due {
                let start = Instant::now();
                let _ = tokio::task::spawn_blocking(sys::trim_heap).await;
                tracing::debug!(took_ms = start.elapsed().as_millis() as u64, "heap trimmed");
            }
        }
    }

    /// Serves `listener` until the phase leaves `Serving`, then waits for its connections.
    pub(crate) async fn serve<L: Listener>(
        self: Arc<Self>,
        listener: L,
        app: Router,
        mut phase: watch::Receiver<Phase>,
    ) -> io::Result<()> {
        let tasks = TaskTracker::new();
        loop {
            let accepted = tokio::select! {
                r = listener.accept() => r,
                _ = phase.wait_for(|p| *p != Phase::Serving) => break,
            };
            let (stream, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    self.accept_failed(&e).await;
                    continue;
                }
            };
            let permit = match self.admit(&peer.client) {
                Ok(p) => p,
                Err(refusal) => {
                    self.turn_away(stream, refusal, &tasks);
                    continue;
                }
            };
            let front = self.clone();
            let app = app.clone();
            let phase = phase.clone();
            tasks.spawn(async move {
                if let Some(pid) = peer.pid
                    && let Err((reason, why)) = front.check_peer(&stream, pid)
                {
                    front.state.metrics().connection_refused(reason);
                    if let Some(skipped) = front.refused_log.pass() {
                        tracing::warn!(peer_pid = pid, client = %peer.client, reason, skipped, "{why}; connection refused");
                    }
                    return;
                }
                front.connection(stream, permit, peer.caller, app, phase).await;
            });
        }
        drop(listener);
        tasks.close();
        tasks.wait().await;
        Ok(())
    }

    /// Serves one connection until it ends, times out or the server closes it.
    async fn connection<S: Stream>(
        &self,
        stream: S,
        permit: Permit,
        caller: Caller,
        app: Router,
        mut phase: watch::Receiver<Phase>,
    ) {
        let limits = &self.limits;
        // Wait for the first bytes before hyper allocates its buffers: idle connections stay
        // small, and one closed unused costs nothing more.
        let deadline = Instant::now() + limits.idle_timeout;
        let mut first = [0u8; 256];
        let n = loop {
            tokio::select! {
                r = stream.readable() => if r.is_err() { return },
                () = tokio::time::sleep_until(deadline) => {
                    self.state.metrics().connection_timed_out("idle_timeout");
                    return;
                }
                _ = phase.wait_for(|p| *p != Phase::Serving) => return,
            }
            match stream.try_read(&mut first) {
                Ok(0) => return,
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(_) => return,
            }
        };
        let clock = Arc::new(ConnClock::new());
        clock.on_read();
        let io = TokioIo::new(Tracked {
            inner: stream,
            first: first[..n].to_vec(),
            clock: clock.clone(),
        });
        let svc = ConnService {
            app: TowerToHyperService::new(app),
            clock: clock.clone(),
            caller,
            body_timeout: limits.body_timeout,
        };
        // Half-close: a client that sends its request and shuts down its side (or goes away)
        // still has its request served; a destroy it sent completes, whether or not anyone
        // reads the answer. Without it hyper drops the request at the end of the client's
        // stream, before the handler has run.
        let mut conn = Box::pin(
            http1::Builder::new()
                .max_buf_size(MAX_BUF)
                .half_close(true)
                .serve_connection(io, svc),
        );
        let mut draining = false;
        loop {
            let deadline = clock.deadline(limits);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(client = %permit.client, error = %e, "connection ended with an error");
                    }
                    break;
                }
                changed = phase.changed() => {
                    let p = if changed.is_ok() { *phase.borrow_and_update() } else { Phase::Closing };
                    match p {
                        Phase::Serving => {}
                        Phase::Draining => if !draining {
                            draining = true;
                            conn.as_mut().graceful_shutdown();
                        },
                        Phase::Closing => break,
                    }
                }
                () = clock.changed.notified() => {}
                () = tokio::time::sleep_until(deadline) => {
                    if let Some(reason) = clock.expired(limits, Instant::now()) {
                        self.state.metrics().connection_timed_out(reason);
                        tracing::debug!(client = %permit.client, reason, "connection closed");
                        break;
                    }
                }
            }
        }
        drop(permit);
    }
}

/// When a connection last did what; the connection's task closes it from these.
struct Clock {
    /// Requests whose answer is not sent yet.
    busy: usize,
    /// Since when no request is in progress (the connection's start, or the last answer's end).
    idle_since: Instant,
    /// The first byte of a request whose headers are not complete yet.
    head_since: Option<Instant>,
    /// Since when the client has not taken what is written to it.
    write_blocked_since: Option<Instant>,
}

struct ConnClock {
    clock: Mutex<Clock>,
    /// Woken when a deadline may have come closer.
    changed: Notify,
}

impl ConnClock {
    fn new() -> ConnClock {
        ConnClock {
            clock: Mutex::new(Clock {
                busy: 0,
                idle_since: Instant::now(),
                head_since: None,
                write_blocked_since: None,
            }),
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Clock> {
        self.clock.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn on_read(&self) {
        let mut c = self.lock();
        if c.busy == 0 && c.head_since.is_none() {
            c.head_since = Some(Instant::now());
            drop(c);
            self.changed.notify_one();
        }
    }

    fn on_write(&self, blocked: bool) {
        let mut c = self.lock();
        if !blocked {
            c.write_blocked_since = None;
        } else if c.write_blocked_since.is_none() {
            c.write_blocked_since = Some(Instant::now());
            drop(c);
            self.changed.notify_one();
        }
    }

    fn begin(self: &Arc<Self>) -> Busy {
        let mut c = self.lock();
        c.busy += 1;
        c.head_since = None;
        Busy(self.clone())
    }

    /// When to look again: the earliest deadline now in force.
    fn deadline(&self, l: &Connections) -> Instant {
        let c = self.lock();
        let mut d = if c.busy > 0 {
            // A request is being answered, however long it takes; look again later.
            Instant::now() + l.idle_timeout
        } else if let Some(h) = c.head_since {
            h + l.header_timeout
        } else {
            c.idle_since + l.idle_timeout
        };
        if let Some(w) = c.write_blocked_since {
            d = d.min(w + l.idle_timeout);
        }
        d
    }

    /// The timeout that has run out at `now`, if one has.
    fn expired(&self, l: &Connections, now: Instant) -> Option<&'static str> {
        let c = self.lock();
        if c.write_blocked_since
            .is_some_and(|w| now >= w + l.idle_timeout)
        {
            return Some("write_timeout");
        }
        if c.busy > 0 {
            return None;
        }
        match c.head_since {
            Some(h) if now >= h + l.header_timeout => Some("header_timeout"),
            Some(_) => None,
            None if now >= c.idle_since + l.idle_timeout => Some("idle_timeout"),
            None => None,
        }
    }
}

/// A request in progress on a connection; dropped when its answer has been sent.
struct Busy(Arc<ConnClock>);

impl Drop for Busy {
    fn drop(&mut self) {
        let mut c = self.0.lock();
        c.busy = c.busy.saturating_sub(1);
        if c.busy == 0 {
            c.idle_since = Instant::now();
        }
        drop(c);
        self.0.changed.notify_one();
    }
}

/// The connection's stream, telling its clock about reads and blocked writes, and giving first
/// the bytes read before hyper took over.
struct Tracked<S> {
    inner: S,
    first: Vec<u8>,
    clock: Arc<ConnClock>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Tracked<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.first.is_empty() {
            let n = self.first.len().min(buf.remaining());
            buf.put_slice(&self.first[..n]);
            self.first.drain(..n);
            if self.first.is_empty() {
                self.first = Vec::new();
            }
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.clock.on_read();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tracked<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.clock.on_write(r.is_pending());
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.clock.on_write(r.is_pending());
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The router as one connection's hyper service: marks the connection busy until the answer is
/// sent and gives the body its deadline.
#[derive(Clone)]
struct ConnService {
    app: TowerToHyperService<Router>,
    clock: Arc<ConnClock>,
    caller: Caller,
    body_timeout: Duration,
}

type ServiceFuture<T> = Pin<Box<dyn Future<Output = Result<T, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for ConnService {
    type Response = Response<Guarded<Body, Busy>>;
    type Error = Infallible;
    type Future = ServiceFuture<Self::Response>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let busy = self.clock.begin();
        let timeout = self.body_timeout;
        let mut req = req.map(|b| Body::new(TimedBody::new(b, timeout)));
        req.extensions_mut().insert(self.caller.clone());
        let answer = self.app.call(req);
        Box::pin(async move {
            let resp = answer.await?;
            Ok(resp.map(|b| Guarded::new(b, busy)))
        })
    }
}
