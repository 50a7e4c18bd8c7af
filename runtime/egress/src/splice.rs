//! Zero-copy relaying on Linux: bytes move socket -> pipe -> socket with splice(2), never through
//! the proxy's memory. Readiness comes from tokio (`ready` + `try_io`), so a splice that would
//! block returns `WouldBlock` and the task waits like any other socket operation.

use std::future::Future;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, OFlag, SpliceFFlags, fcntl, splice};
use tokio::io::{Interest, Ready};
use tokio::net::{TcpStream, UnixStream};

/// A tokio socket the relay can drive by hand: TCP or Unix stream.
pub(crate) trait Socket: AsFd + Send + Sync {
    fn ready(&self, interest: Interest) -> impl Future<Output = io::Result<Ready>> + Send;
    fn try_io<R>(&self, interest: Interest, f: impl FnOnce() -> io::Result<R>) -> io::Result<R>;
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize>;
    fn try_write(&self, buf: &[u8]) -> io::Result<usize>;
}

macro_rules! socket {
    ($t:ty) => {
        impl Socket for $t {
            fn ready(&self, interest: Interest) -> impl Future<Output = io::Result<Ready>> + Send {
                <$t>::ready(self, interest)
            }
            fn try_io<R>(
                &self,
                interest: Interest,
                f: impl FnOnce() -> io::Result<R>,
            ) -> io::Result<R> {
                <$t>::try_io(self, interest, f)
            }
            fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
                <$t>::try_read(self, buf)
            }
            fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
                <$t>::try_write(self, buf)
            }
        }
    };
}

socket!(TcpStream);
socket!(UnixStream);

/// Runs `op` when `socket` is ready for `interest`, until it does not report `WouldBlock`.
pub(crate) async fn when_ready<S: Socket, R>(
    socket: &S,
    interest: Interest,
    mut op: impl FnMut() -> io::Result<R>,
) -> io::Result<R> {
    loop {
        socket.ready(interest).await?;
        match socket.try_io(interest, &mut op) {
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => continue,
            result => return result,
        }
    }
}

/// Reads what `socket` has into `buf` (0: end of stream).
pub(crate) async fn read<S: Socket>(socket: &S, buf: &mut [u8]) -> io::Result<usize> {
    when_ready(socket, Interest::READABLE, || socket.try_read(buf)).await
}

/// Writes all of `buf` to `socket`.
pub(crate) async fn write_all<S: Socket>(socket: &S, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        let n = when_ready(socket, Interest::WRITABLE, || socket.try_write(buf)).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        buf = &buf[n..];
    }
    Ok(())
}

/// Ends the writing direction of `socket` (the peer reads end of stream); errors are ignored,
/// the peer may be gone already.
pub(crate) fn shutdown_write<S: Socket>(socket: &S) {
    let _ = nix::sys::socket::shutdown(
        socket.as_fd().as_raw_fd(),
        nix::sys::socket::Shutdown::Write,
    );
}

/// A pipe that carries one direction of a connection.
pub(crate) struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    /// Capacity in bytes.
    size: usize,
}

impl Pipe {
    /// A non-blocking pipe of (up to) `size` bytes; smaller when the system's limits say so.
    pub(crate) fn new(size: usize) -> io::Result<Pipe> {
        let (read, write) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
        let asked = i32::try_from(size).unwrap_or(i32::MAX);
        // Growing the pipe is an optimisation; past /proc/sys/fs/pipe-max-size or the user's
        // pipe quota it fails and the default (64 KiB) stays.
        let size = fcntl(write.as_raw_fd(), FcntlArg::F_SETPIPE_SZ(asked))
            .ok()
            .and_then(|granted| usize::try_from(granted).ok())
            .unwrap_or(64 * 1024);
        Ok(Pipe { read, write, size })
    }

    /// Moves what `from` has (up to the pipe's size) into the pipe; 0 at end of stream.
    pub(crate) async fn fill<S: Socket>(&self, from: &S) -> io::Result<usize> {
        when_ready(from, Interest::READABLE, || {
            splice(
                from.as_fd(),
                None,
                self.write.as_fd(),
                None,
                self.size,
                flags(),
            )
            .map_err(io::Error::from)
        })
        .await
    }

    /// Moves `len` bytes from the pipe to `to`.
    pub(crate) async fn drain<S: Socket>(&self, to: &S, mut len: usize) -> io::Result<()> {
        while len > 0 {
            let n = when_ready(to, Interest::WRITABLE, || {
                splice(self.read.as_fd(), None, to.as_fd(), None, len, flags())
                    .map_err(io::Error::from)
            })
            .await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            len -= n;
        }
        Ok(())
    }
}

fn flags() -> SpliceFFlags {
    SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK
}

/// The error splice gives for descriptors it cannot join (then the relay copies instead).
pub(crate) fn unsupported(err: &io::Error) -> bool {
    err.raw_os_error() == Some(Errno::EINVAL as i32)
}
