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
    /// Largest capacity to grow to ([`Pipe::grow`]).
    max: usize,
}

impl Pipe {
    /// A non-blocking pipe of the system's default size (64 KiB), or of `max` bytes when that is
    /// smaller; [`Pipe::grow`] takes it up to `max`.
    pub(crate) fn new(max: usize) -> io::Result<Pipe> {
        let (read, write) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
        let size = fcntl(write.as_raw_fd(), FcntlArg::F_GETPIPE_SZ)
            .ok()
            .and_then(|size| usize::try_from(size).ok())
            .unwrap_or(64 * 1024);
        let mut pipe = Pipe {
            read,
            write,
            size,
            max,
        };
        if max < size {
            pipe.resize(max);
        }
        Ok(pipe)
    }

    /// Capacity in bytes.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// Makes the pipe four times larger, up to its `max`; for a direction that keeps it full.
    /// Call it when the pipe is empty. Past the system's limits (/proc/sys/fs/pipe-max-size, the
    /// user's pipe quota) the pipe keeps its size and stops growing.
    pub(crate) fn grow(&mut self) {
        if self.size < self.max {
            let want = self.size.saturating_mul(4).min(self.max);
            if !self.resize(want) {
                self.max = self.size;
            }
        }
    }

    fn resize(&mut self, size: usize) -> bool {
        let asked = i32::try_from(size).unwrap_or(i32::MAX);
        match fcntl(self.write.as_raw_fd(), FcntlArg::F_SETPIPE_SZ(asked))
            .ok()
            .and_then(|granted| usize::try_from(granted).ok())
        {
            Some(granted) => {
                self.size = granted;
                true
            }
            None => false,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pipe_starts_small_and_grows_to_its_limit() {
        let mut pipe = Pipe::new(1 << 20).unwrap();
        // The system's default, 64 KiB unless the user's pipe quota is spent.
        let start = pipe.size();
        assert!(start <= 64 * 1024, "{start}");
        for _ in 0..8 {
            pipe.grow();
        }
        // Up to 1 MiB, unless the system's limits stopped it earlier (then it stays put).
        let grown = pipe.size();
        assert!(grown >= start && grown <= 1 << 20, "{grown}");
        if start == 64 * 1024 && nix::unistd::geteuid().is_root() {
            assert_eq!(grown, 1 << 20);
        }
        // Smaller than the default: shrunk at once, never grown.
        let mut pipe = Pipe::new(16 * 1024).unwrap();
        assert_eq!(pipe.size(), 16 * 1024);
        pipe.grow();
        assert_eq!(pipe.size(), 16 * 1024);
    }
}
