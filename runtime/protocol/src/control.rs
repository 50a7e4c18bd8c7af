//! The control channels of a long-lived sandbox, each a `SOCK_SEQPACKET` socket pair: one between
//! the runtime and the sandbox's pid 1, and one between the runtime and each of the sandbox's
//! exec starters (pid 1 makes a starter and hands the runtime its end, [`Event::Starter`]). Each
//! message is one JSON object; file descriptors travel with it as `SCM_RIGHTS`.
//!
//! An exec goes from the runtime straight to its user's starter ([`Request::Exec`], with the
//! exec's stdin, stdout and stderr and the write end of its event pipe), or to a reaper the
//! starter forked ahead and announced ([`Event::Reaper`]); the exec's reaper writes
//! [`Event::Exited`] on that pipe, one JSON line, once nothing of the exec is left, and closes
//! it. pid 1 is not on an exec's way.
//!
//! A datagram is bounded by the socket's send buffer (about 208 KiB by default), but an exec's
//! argv and environment may take up to what execve takes (6 MiB, more once JSON escapes them). So
//! a message over [`INLINE_MAX`] travels in a sealed memfd instead: the datagram is then a small
//! header (a NUL byte, then the body's length as 8 little-endian bytes; JSON never starts with
//! NUL) and the memfd is the first descriptor passed with it, before the message's own.
//!
//! The command processes never hold these sockets: they are closed in every exec before
//! confinement, so nothing inside the sandbox can ask pid 1 or a starter for anything.

use std::io::{IoSlice, IoSliceMut, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MemFdCreateFlag, memfd_create};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use serde::{Deserialize, Serialize};

use crate::config::MountOp;

/// The descriptor number of the control socket in the helper and the sandbox's pid 1.
pub const CONTROL_FD: i32 = 4;

/// The descriptors an [`Request::Exec`] carries, in this order: the command's stdin, stdout and
/// stderr, and the write end of the exec's event pipe.
pub const EXEC_FDS: usize = 4;

/// Largest message sent as the datagram itself; a larger one goes through a memfd.
pub const INLINE_MAX: usize = 64 * 1024;

/// Largest message body, in bytes: what execve takes at most (6 MiB of argv and environment),
/// with room for JSON's escapes of control characters (up to six bytes for one).
pub const MAX_BODY: usize = 64 * 1024 * 1024;

/// The first byte of a header whose body is in a memfd.
const BODY_IN_MEMFD: u8 = 0;

/// Descriptors one message may carry: an exec's four, and the memfd of a large body.
const MAX_FDS: usize = 8;

/// The seals a body's memfd carries: its content is fixed once sent.
fn body_seals() -> SealFlag {
    SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_SEAL
}

/// A request from the runtime: to the sandbox's pid 1 (`Starter`, `Remount`, `Merge`) or to an exec
/// starter (`Exec`, `Signal`, `KillTree`, `KillAll`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Start a command; [`EXEC_FDS`] descriptors come with the message (stdin, stdout, stderr,
    /// the exec's event pipe).
    Exec {
        id: u64,
        argv: Vec<String>,
        cwd: String,
        env: Vec<(String, String)>,
        /// Another user of the sandbox than its default one (ids inside the sandbox): the user
        /// of the starter it is sent to, which refuses an exec for anyone else.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<ExecIds>,
    },
    /// Send `signal` to the main process of exec `id` (its reaper passes it on).
    Signal { id: u64, signal: i32 },
    /// Kill every process of exec `id`.
    KillTree { id: u64 },
    /// Kill the processes of every exec the starter started, leaving the sandbox running.
    KillAll,
    /// To pid 1: start an exec starter for `user` (`None`: the sandbox's own); its socket comes
    /// back with [`Event::Starter`].
    Starter {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<ExecIds>,
    },
    /// Detach the workspace overlay at `path` and carry out these ops in its place (their host
    /// paths are the sandbox's private view of its state, see the runtime's sandbox module).
    /// pid 1 ends the starters first (their Landlock rules name the old mount) and sends a new
    /// one for the sandbox's own user before [`Event::Remounted`].
    Remount { path: String, ops: Vec<MountOp> },
    /// To pid 1: write an upper layer, whose directory comes with the message (a descriptor
    /// opened read-only by the runtime), through the workspace overlay mounted at `workspace`,
    /// whose own upper layer is empty: a warm fork's changes, taken without a remount (the
    /// starters stay). Sent only to a sandbox that has run nothing, so no command of it can
    /// reach the descriptor; pid 1 closes it when done. Answered by [`Event::Merged`]; on an
    /// error the workspace may hold part of the layer.
    Merge { workspace: String },
}

/// Who an exec runs as, in the sandbox's own ids: uid, primary gid, supplementary groups.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ExecIds {
    pub uid: u32,
    pub gid: u32,
    #[serde(default)]
    pub groups: Vec<u32>,
}

/// An event from the sandbox to the runtime: from pid 1 on the control socket (`Ready`,
/// `Starter`, `Remounted`, `Merged`, `Error`), from a starter on its socket (`Reaper`), or from an exec's
/// reaper on the exec's event pipe (`Exited`, one JSON line, the pipe's last).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The sandbox is built and waits for requests (its own user's starter was sent before).
    Ready,
    /// An exec starter for `user`: its socket comes with the message, unless `error` says why
    /// there is none.
    Starter {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<ExecIds>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    /// A reaper forked ahead of the next exec: its socket comes with the message, and an
    /// [`Request::Exec`] sent there starts without the starter.
    Reaper,
    /// Exec `id` could not start or ended. All its processes are gone when this is sent.
    Exited {
        id: u64,
        code: Option<i32>,
        signal: Option<i32>,
        landlock: String,
        seccomp: bool,
        /// errno of a failed execve, with the program name.
        exec_failed: Option<(i32, String)>,
        /// The sandbox could not confine or start the command.
        setup_error: Option<String>,
        /// CPU time of the command and the descendants it waited for, in milliseconds.
        cpu_ms: u64,
        /// Peak resident memory of the largest of them, in bytes.
        max_rss_bytes: u64,
        /// A process of the exec was killed for writing past the file size limit (SIGXFSZ),
        /// or its main process reported that a child was (exit status 128 + SIGXFSZ).
        #[serde(default)]
        file_size_exceeded: bool,
        /// The reaper that sent this waits for another exec on the same socket: the runtime
        /// may send it the next one there (see the helper's server module). False when it
        /// exits instead.
        #[serde(default)]
        reusable: bool,
    },
    /// A remount finished (`error` set when it failed).
    Remounted { error: Option<String> },
    /// A merge finished (`error` set when it failed).
    Merged { error: Option<String> },
    /// A request was malformed.
    Error { message: String },
}

/// Why a message was not sent.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// Nothing was sent and the channel is as it was: the message could not be encoded, was
    /// over [`MAX_BODY`], or its memfd could not be made.
    #[error("cannot prepare a control message of {len} bytes: {reason}")]
    Prepare { len: usize, reason: String },
    /// The socket refused the message: the channel is broken.
    #[error("the control channel failed: {0}")]
    Channel(#[source] std::io::Error),
}

/// Why no message was received.
#[derive(Debug, thiserror::Error)]
pub enum RecvError {
    /// A message came but cannot be read (cut short, a bad body, JSON that does not parse); the
    /// channel itself still works. `exec_id` is the `id` of an exec request when it could be
    /// read, so pid 1 can end that exec instead of leaving the runtime waiting for it.
    #[error("bad control message: {reason}")]
    Malformed {
        reason: String,
        exec_id: Option<u64>,
    },
    /// The socket failed.
    #[error("the control channel failed: {0}")]
    Channel(#[source] std::io::Error),
}

fn malformed(reason: impl Into<String>) -> RecvError {
    RecvError::Malformed {
        reason: reason.into(),
        exec_id: None,
    }
}

/// Sends `msg` with `fds` on `sock`: inline when it fits, else its body in a sealed memfd.
pub fn send<T: Serialize>(sock: BorrowedFd<'_>, msg: &T, fds: &[RawFd]) -> Result<(), SendError> {
    let body = serde_json::to_vec(msg).map_err(|e| SendError::Prepare {
        len: 0,
        reason: e.to_string(),
    })?;
    if body.len() <= INLINE_MAX {
        match send_datagram(sock, &body, fds) {
            // A send buffer smaller than the message (a host's tuning): take the memfd.
            Err(nix::Error::EMSGSIZE) => {}
            other => return other.map_err(|e| SendError::Channel(e.into())),
        }
    }
    if body.len() > MAX_BODY {
        return Err(SendError::Prepare {
            len: body.len(),
            reason: format!("over the channel's limit of {MAX_BODY} bytes"),
        });
    }
    let memfd = stage(&body).map_err(|e| SendError::Prepare {
        len: body.len(),
        reason: format!("memfd: {e}"),
    })?;
    let mut header = [0u8; 9];
    header[0] = BODY_IN_MEMFD;
    header[1..].copy_from_slice(&(body.len() as u64).to_le_bytes());
    let all: Vec<RawFd> = std::iter::once(memfd.as_raw_fd())
        .chain(fds.iter().copied())
        .collect();
    send_datagram(sock, &header, &all).map_err(|e| SendError::Channel(e.into()))
}

/// `body` in a new memfd, sealed against any change.
fn stage(body: &[u8]) -> std::io::Result<OwnedFd> {
    let fd = memfd_create(
        c"taskbox-control",
        MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING,
    )?;
    let mut file = std::fs::File::from(fd);
    file.write_all(body)?;
    fcntl(file.as_raw_fd(), FcntlArg::F_ADD_SEALS(body_seals()))?;
    Ok(OwnedFd::from(file))
}

fn send_datagram(sock: BorrowedFd<'_>, data: &[u8], fds: &[RawFd]) -> nix::Result<()> {
    let iov = [IoSlice::new(data)];
    let cmsgs;
    let cmsg_slice: &[ControlMessage] = if fds.is_empty() {
        &[]
    } else {
        cmsgs = [ControlMessage::ScmRights(fds)];
        &cmsgs
    };
    loop {
        match sendmsg::<()>(
            sock.as_raw_fd(),
            &iov,
            cmsg_slice,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(_) => return Ok(()),
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(e),
        }
    }
}

/// What [`try_recv`] or [`recv_within`] found.
pub enum Received<T> {
    /// A message and the descriptors that came with it.
    Message(T, Vec<OwnedFd>),
    /// Nothing is waiting (or came within the time given).
    Nothing,
    /// The other end closed.
    Closed,
}

/// Receives one message if one is waiting, without blocking.
pub fn try_recv<T: for<'de> Deserialize<'de>>(
    sock: BorrowedFd<'_>,
    buf: &mut Vec<u8>,
) -> Result<Received<T>, RecvError> {
    match recv_with(sock, buf, MsgFlags::MSG_DONTWAIT) {
        Ok(Some((msg, fds))) => Ok(Received::Message(msg, fds)),
        Ok(None) => Ok(Received::Closed),
        Err(RecvError::Channel(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {
            Ok(Received::Nothing)
        }
        Err(e) => Err(e),
    }
}

/// Receives one message, waiting at most `timeout` for it.
pub fn recv_within<T: for<'de> Deserialize<'de>>(
    sock: BorrowedFd<'_>,
    buf: &mut Vec<u8>,
    timeout: std::time::Duration,
) -> Result<Received<T>, RecvError> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        // Rounded up: a wait cut short of the deadline would answer "nothing" too early.
        let ms = i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
        let mut fds = [PollFd::new(sock, PollFlags::POLLIN)];
        match poll(
            &mut fds,
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
        ) {
            Ok(0) if std::time::Instant::now() < deadline => continue,
            Ok(0) => return Ok(Received::Nothing),
            Ok(_) => match try_recv(sock, buf)? {
                // Woken with nothing to read: wait out the rest.
                Received::Nothing if !left.is_zero() => continue,
                got => return Ok(got),
            },
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(RecvError::Channel(e.into())),
        }
    }
}

/// Receives one message and the descriptors that came with it. `Ok(None)` at end of stream.
pub fn recv<T: for<'de> Deserialize<'de>>(
    sock: BorrowedFd<'_>,
    buf: &mut Vec<u8>,
) -> Result<Option<(T, Vec<OwnedFd>)>, RecvError> {
    recv_with(sock, buf, MsgFlags::empty())
}

fn recv_with<T: for<'de> Deserialize<'de>>(
    sock: BorrowedFd<'_>,
    buf: &mut Vec<u8>,
    flags: MsgFlags,
) -> Result<Option<(T, Vec<OwnedFd>)>, RecvError> {
    buf.resize(INLINE_MAX, 0);
    let mut cmsg_space = nix::cmsg_space!([RawFd; MAX_FDS]);
    let (len, flags, mut fds) = loop {
        let mut iov = [IoSliceMut::new(buf)];
        match recvmsg::<()>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg_space),
            MsgFlags::MSG_CMSG_CLOEXEC | flags,
        ) {
            Ok(msg) => {
                let mut fds = Vec::new();
                if let Ok(cmsgs) = msg.cmsgs() {
                    for c in cmsgs {
                        if let ControlMessageOwned::ScmRights(raw) = c {
                            for fd in raw {
                                // SAFETY: the kernel just installed `fd` in our table for this
                                // message; nothing else owns it.
                                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                            }
                        }
                    }
                }
                break (msg.bytes, msg.flags, fds);
            }
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(RecvError::Channel(e.into())),
        }
    };
    if len == 0 {
        return Ok(None);
    }
    if flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC) {
        return Err(malformed(format!(
            "a message was cut short (over {INLINE_MAX} bytes or {MAX_FDS} descriptors)"
        )));
    }
    let large;
    let body: &[u8] = if buf[0] == BODY_IN_MEMFD {
        if len != 9 || fds.is_empty() {
            return Err(malformed("a body header without its memfd"));
        }
        let mut n = [0u8; 8];
        n.copy_from_slice(&buf[1..9]);
        let memfd = fds.remove(0);
        large = read_body(memfd.as_fd(), u64::from_le_bytes(n)).map_err(malformed)?;
        &large
    } else {
        &buf[..len]
    };
    match serde_json::from_slice(body) {
        Ok(msg) => Ok(Some((msg, fds))),
        Err(e) => {
            #[derive(Deserialize)]
            struct Head {
                op: Option<String>,
                id: Option<u64>,
            }
            let exec_id = serde_json::from_slice::<Head>(body)
                .ok()
                .filter(|h| h.op.as_deref() == Some("exec"))
                .and_then(|h| h.id);
            Err(RecvError::Malformed {
                reason: e.to_string(),
                exec_id,
            })
        }
    }
}

/// Reads a body of `len` bytes from a sealed memfd.
fn read_body(memfd: BorrowedFd<'_>, len: u64) -> Result<Vec<u8>, String> {
    if len > MAX_BODY as u64 {
        return Err(format!("a body of {len} bytes, over {MAX_BODY}"));
    }
    let seals = fcntl(memfd.as_raw_fd(), FcntlArg::F_GET_SEALS)
        .map_err(|e| format!("the body is not in a memfd: {e}"))?;
    let want = body_seals().bits() & !SealFlag::F_SEAL_SEAL.bits();
    if seals & want != want {
        return Err("the body's memfd is not sealed".into());
    }
    let size = nix::sys::stat::fstat(memfd.as_raw_fd())
        .map_err(|e| format!("fstat of the body: {e}"))?
        .st_size;
    if u64::try_from(size).ok() != Some(len) {
        return Err(format!("the body is {size} bytes, its header says {len}"));
    }
    let mut body = vec![0u8; len as usize];
    let mut done = 0;
    while done < body.len() {
        // The sender's writes moved the shared offset to the end: read by position.
        match nix::sys::uio::pread(memfd, &mut body[done..], done as i64) {
            Ok(0) => return Err("the body ended early".into()),
            Ok(n) => done += n,
            Err(nix::Error::EINTR) => {}
            Err(e) => return Err(format!("cannot read the body: {e}")),
        }
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};

    fn pair() -> (OwnedFd, OwnedFd) {
        socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap()
    }

    #[test]
    fn a_receive_within_a_time_gives_the_message_nothing_or_the_end() {
        use std::time::{Duration, Instant};
        let (a, b) = pair();
        let mut buf = Vec::new();
        let t = Instant::now();
        let got = recv_within::<u64>(b.as_fd(), &mut buf, Duration::from_millis(30)).unwrap();
        assert!(matches!(got, Received::Nothing));
        assert!(t.elapsed() >= Duration::from_millis(30));
        send(a.as_fd(), &7u64, &[]).unwrap();
        let got = recv_within::<u64>(b.as_fd(), &mut buf, Duration::from_secs(5)).unwrap();
        assert!(matches!(got, Received::Message(7, _)));
        drop(a);
        let got = recv_within::<u64>(b.as_fd(), &mut buf, Duration::from_secs(5)).unwrap();
        assert!(matches!(got, Received::Closed));
    }

    fn exec(argv: Vec<String>) -> Request {
        Request::Exec {
            id: 7,
            argv,
            cwd: "/w".into(),
            env: vec![("K".into(), "v".into())],
            user: None,
        }
    }

    #[test]
    fn small_and_large_messages_arrive_whole_with_their_descriptors() {
        let (a, b) = pair();
        let (r, w) = nix::unistd::pipe().unwrap();
        let mut buf = Vec::new();
        for size in [10, INLINE_MAX, 300_000, 3 << 20] {
            // One argument of control characters: JSON makes six bytes of each.
            let msg = exec(vec!["echo".into(), "\u{1}".repeat(size / 6)]);
            // A reader on another thread: a large body is bigger than the socket's buffer.
            std::thread::scope(|s| {
                s.spawn(|| send(a.as_fd(), &msg, &[r.as_raw_fd(), w.as_raw_fd()]).unwrap());
                let (got, fds) = recv::<Request>(b.as_fd(), &mut buf).unwrap().unwrap();
                assert_eq!(got, msg, "size {size}");
                assert_eq!(fds.len(), 2, "size {size}");
            });
        }
    }

    #[test]
    fn a_body_over_the_limit_is_refused_before_anything_is_sent() {
        let (a, b) = pair();
        let msg = exec(vec!["a".repeat(MAX_BODY)]);
        let e = send(a.as_fd(), &msg, &[]).unwrap_err();
        assert!(matches!(e, SendError::Prepare { .. }), "{e}");
        // Nothing is waiting on the other end.
        nix::sys::socket::shutdown(a.as_raw_fd(), nix::sys::socket::Shutdown::Both).unwrap();
        assert!(
            recv::<Request>(b.as_fd(), &mut Vec::new())
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn an_unsealed_or_lying_body_is_malformed_and_names_the_exec_when_it_can() {
        let (a, b) = pair();
        let mut buf = Vec::new();
        // A plain pipe instead of a memfd.
        let (r, _w) = nix::unistd::pipe().unwrap();
        let mut header = [0u8; 9];
        header[1..].copy_from_slice(&5u64.to_le_bytes());
        send_datagram(a.as_fd(), &header, &[r.as_raw_fd()]).unwrap();
        let e = recv::<Request>(b.as_fd(), &mut buf).unwrap_err();
        assert!(matches!(e, RecvError::Malformed { .. }), "{e}");
        // A sealed memfd whose length is not the header's.
        let fd = stage(b"{}").unwrap();
        send_datagram(a.as_fd(), &header, &[fd.as_raw_fd()]).unwrap();
        let e = recv::<Request>(b.as_fd(), &mut buf).unwrap_err();
        assert!(e.to_string().contains("header says 5"), "{e}");
        // JSON that is not a request, with an id.
        send_datagram(a.as_fd(), br#"{"op":"exec","id":9}"#, &[]).unwrap();
        match recv::<Request>(b.as_fd(), &mut buf).unwrap_err() {
            RecvError::Malformed { exec_id, .. } => assert_eq!(exec_id, Some(9)),
            other => panic!("{other}"),
        }
        // The channel still works.
        send(a.as_fd(), &Request::KillAll, &[]).unwrap();
        let (got, _) = recv::<Request>(b.as_fd(), &mut buf).unwrap().unwrap();
        assert_eq!(got, Request::KillAll);
    }
}
