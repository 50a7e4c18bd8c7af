//! Starting the helper with `posix_spawn` instead of `fork` + `exec`.
//!
//! The supervisor is a large, many-threaded process. `fork` copies its page tables (and the
//! child's first writes and its `exec` tear the copy down again, while the parent's own writes
//! take copy-on-write faults meanwhile): a fifth of the supervisor's CPU per sandbox start in
//! `scripts/bench.sh fork`'s creation-rate profile. glibc's `posix_spawn` starts the child
//! with `clone(CLONE_VM | CLONE_VFORK)` on a stack of its own, so nothing is copied. The
//! standard library takes that path too, but only when no `pre_exec` closure is set, and the
//! helper needs its descriptors on fixed numbers (`STATUS_FD`, `CONTROL_FD`, ...), which
//! `Command` cannot do without one. Here the file actions do it.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

use taskbox_protocol::config::{ZYGOTE_ARG, ZYGOTE_FD, ZygoteReply, ZygoteRequest};
use taskbox_protocol::control;

/// Where one of the child's standard streams goes.
pub(crate) enum Stream<'a> {
    /// This process's own descriptor of that number, as it is.
    Inherit,
    Null,
    To(BorrowedFd<'a>),
}

/// A helper started by [`spawn`]: the parts of `std::process::Child` the backend uses.
#[derive(Debug)]
pub(crate) struct Spawned {
    pid: libc::pid_t,
    /// Once reaped: how it ended, and the CPU time (ms) and peak RSS (bytes) of it and the
    /// descendants it reaped.
    reaped: Option<(ExitStatus, (u64, u64))>,
}

impl Spawned {
    pub(crate) fn id(&self) -> u32 {
        self.pid as u32
    }

    /// The exit status, if the child has ended (reaping it).
    pub(crate) fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.wait_with(libc::WNOHANG)
    }

    /// Waits at most `timeout` for the child to end (reaping it): woken by the child's end
    /// through a pidfd, not by polling; `None` when it still runs.
    pub(crate) fn wait_timeout(
        &mut self,
        timeout: std::time::Duration,
    ) -> io::Result<Option<ExitStatus>> {
        if let Some(st) = self.try_wait()? {
            return Ok(Some(st));
        }
        let deadline = std::time::Instant::now() + timeout;
        // SAFETY: pidfd_open takes a pid and flags; the child is not reaped yet, so its pid is
        // still its own. The descriptor is new and owned here.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, self.pid, 0) };
        let pidfd = (raw >= 0).then(|| {
            // SAFETY: as above.
            unsafe { OwnedFd::from_raw_fd(raw as RawFd) }
        });
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match &pidfd {
                Some(fd) => {
                    let mut fds = [libc::pollfd {
                        fd: fd.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    }];
                    let ms = left.as_millis().min(i32::MAX as u128) as libc::c_int;
                    // SAFETY: one valid pollfd, its length given.
                    unsafe { libc::poll(fds.as_mut_ptr(), 1, ms) };
                }
                // Before Linux 5.3: a look every 2 ms.
                None => std::thread::sleep(left.min(std::time::Duration::from_millis(2))),
            }
            if let Some(st) = self.try_wait()? {
                return Ok(Some(st));
            }
            if left.is_zero() {
                return Ok(None);
            }
        }
    }

    /// Waits for the child to end (reaping it).
    pub(crate) fn wait(&mut self) -> io::Result<ExitStatus> {
        self.wait_with(0)?
            .ok_or_else(|| io::Error::other("a blocking wait returned no status"))
    }

    /// The CPU time (ms) and peak RSS (bytes) of the reaped child and of the descendants it
    /// reaped; `None` before it is reaped.
    pub(crate) fn usage(&self) -> Option<(u64, u64)> {
        self.reaped.map(|(_, usage)| usage)
    }

    /// SIGKILL, unless the child was reaped already (its pid may be another process's now).
    pub(crate) fn kill(&mut self) -> io::Result<()> {
        if self.reaped.is_some() {
            return Ok(());
        }
        // SAFETY: kill takes integers.
        if unsafe { libc::kill(self.pid, libc::SIGKILL) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn wait_with(&mut self, flags: libc::c_int) -> io::Result<Option<ExitStatus>> {
        if let Some((st, _)) = self.reaped {
            return Ok(Some(st));
        }
        let mut raw = 0;
        // SAFETY: rusage is plain old data; all-zero is valid.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        loop {
            // SAFETY: wait4 writes only into `raw` and `ru`, live locals.
            let r = unsafe { libc::wait4(self.pid, &mut raw, flags, &mut ru) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if r == 0 {
                return Ok(None);
            }
            let st = ExitStatus::from_raw(raw);
            let ms = |tv: libc::timeval| tv.tv_sec as u64 * 1000 + tv.tv_usec as u64 / 1000;
            let usage = (
                ms(ru.ru_utime) + ms(ru.ru_stime),
                ru.ru_maxrss as u64 * 1024,
            );
            self.reaped = Some((st, usage));
            return Ok(Some(st));
        }
    }
}

fn cstr(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} holds a NUL byte", s.to_string_lossy()),
        )
    })
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(r))
    }
}

/// Owns initialised `posix_spawn` objects so that every return path destroys them.
struct Actions(libc::posix_spawn_file_actions_t);
impl Drop for Actions {
    fn drop(&mut self) {
        // SAFETY: initialised by posix_spawn_file_actions_init in `spawn`.
        unsafe { libc::posix_spawn_file_actions_destroy(&mut self.0) };
    }
}
struct Attr(libc::posix_spawnattr_t);
impl Drop for Attr {
    fn drop(&mut self) {
        // SAFETY: initialised by posix_spawnattr_init in `spawn`.
        unsafe { libc::posix_spawnattr_destroy(&mut self.0) };
    }
}

/// Starts `program` with `args`, an empty environment, the three streams, and each `(fd, to)`
/// of `fds` installed as descriptor `to` (without close-on-exec; every other descriptor of
/// this process is close-on-exec, as the standard library and the backend open them).
///
/// The signal mask is emptied and SIGPIPE set back to its default, as `Command` does.
pub(crate) fn spawn(
    program: &OsStr,
    args: &[&OsStr],
    stdin: Stream,
    stdout: Stream,
    stderr: Stream,
    fds: &[(BorrowedFd, RawFd)],
) -> io::Result<Spawned> {
    let prog = cstr(program)?;
    let mut argv_c = vec![prog.clone()];
    for a in args {
        argv_c.push(cstr(a)?);
    }
    let mut argv: Vec<*mut libc::c_char> = argv_c.iter().map(|c| c.as_ptr().cast_mut()).collect();
    argv.push(std::ptr::null_mut());
    let mut envp: [*mut libc::c_char; 1] = [std::ptr::null_mut()];

    // Each source first moves above every target number (close-on-exec, in this process), so
    // that installing one target cannot overwrite a source still to be installed, and a source
    // already on its target still loses close-on-exec (dup2 onto itself would keep it).
    let mut moved: Vec<(OwnedFd, RawFd)> = Vec::with_capacity(fds.len() + 3);
    let lift = |fd: RawFd| -> io::Result<OwnedFd> {
        // SAFETY: fcntl on a descriptor the caller keeps open for this call.
        let r = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 64) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just made, owned by nothing else.
        Ok(unsafe { OwnedFd::from_raw_fd(r) })
    };
    let mut nulls = Vec::new();
    for (stream, to) in [(stdin, 0), (stdout, 1), (stderr, 2)] {
        match stream {
            Stream::To(fd) => moved.push((lift(fd.as_raw_fd())?, to)),
            Stream::Null => nulls.push(to),
            Stream::Inherit => {}
        }
    }
    for (fd, to) in fds {
        moved.push((lift(fd.as_raw_fd())?, *to));
    }

    // SAFETY: zeroed storage is what the init functions expect to initialise.
    let mut actions = Actions(unsafe { std::mem::zeroed() });
    // SAFETY: initialising the object just allocated; destroyed by Actions' drop.
    check(unsafe { libc::posix_spawn_file_actions_init(&mut actions.0) })?;
    let dev_null = c"/dev/null";
    for to in nulls {
        let mode = if to == 0 {
            libc::O_RDONLY
        } else {
            libc::O_WRONLY
        };
        // SAFETY: the path is a static C string; the actions object is initialised.
        check(unsafe {
            libc::posix_spawn_file_actions_addopen(&mut actions.0, to, dev_null.as_ptr(), mode, 0)
        })?;
    }
    for (fd, to) in &moved {
        // SAFETY: the actions object is initialised; the descriptor stays open until spawn ends.
        check(unsafe {
            libc::posix_spawn_file_actions_adddup2(&mut actions.0, fd.as_raw_fd(), *to)
        })?;
    }

    // SAFETY: as for the actions above.
    let mut attr = Attr(unsafe { std::mem::zeroed() });
    // SAFETY: initialising the object just allocated; destroyed by Attr's drop.
    check(unsafe { libc::posix_spawnattr_init(&mut attr.0) })?;
    // SAFETY: sigset_t is plain data that sigemptyset/sigaddset initialise.
    unsafe {
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        check(libc::posix_spawnattr_setsigmask(&mut attr.0, &none))?;
        let mut pipe: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut pipe);
        libc::sigaddset(&mut pipe, libc::SIGPIPE);
        check(libc::posix_spawnattr_setsigdefault(&mut attr.0, &pipe))?;
        check(libc::posix_spawnattr_setflags(
            &mut attr.0,
            (libc::POSIX_SPAWN_SETSIGMASK | libc::POSIX_SPAWN_SETSIGDEF) as libc::c_short,
        ))?;
    }

    let mut pid: libc::pid_t = 0;
    // SAFETY: every pointer is to a live, NUL-terminated array or an initialised object; glibc
    // reports the exec's failure as the return value (the child's exit code 127 otherwise).
    check(unsafe {
        libc::posix_spawn(
            &mut pid,
            prog.as_ptr(),
            &actions.0,
            &attr.0,
            argv.as_mut_ptr(),
            envp.as_mut_ptr(),
        )
    })
    .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", program.to_string_lossy())))?;
    drop(moved);
    Ok(Spawned { pid, reaped: None })
}

/// The helpers' zygote (`taskbox-init --zygote`, see the helper's `zygote` module): one
/// `taskbox-init` that paid for its loading once and forks each long-lived sandbox's helper on
/// request, with `CLONE_PARENT`, so that this process is the helper's parent as it is of a
/// spawned one ([`Spawned`] waits, kills and reads its rusage alike). It ends when it is dropped
/// (its socket closes) or this process dies.
#[derive(Debug)]
pub(crate) struct Zygote {
    /// The helper it runs (a zygote of another helper binary is not asked).
    program: std::path::PathBuf,
    sock: OwnedFd,
    process: Spawned,
}

/// Why the zygote did not give a helper.
#[derive(Debug)]
pub(crate) enum ZygoteError {
    /// It could not fork one (the host's process limit): a spawn would fail alike.
    Refused(String),
    /// It is gone: the request never reached it, so no helper has the request's descriptors.
    /// Another zygote (or a spawn) may start this helper.
    Gone(String),
    /// It took the request and gave no answer (it died, or hangs): a helper it may have forked
    /// holds the request's descriptors and has read its plan, so no other may start on them.
    /// The create fails; the next one starts another zygote.
    Lost(String),
}

/// Room for a helper's label (`- NAME`) in the zygote's arguments, at least.
const LABEL_ROOM: usize = 96;

/// How long the zygote may take to answer: a fork, a few hundred microseconds.
const ZYGOTE_ANSWER: std::time::Duration = std::time::Duration::from_secs(5);

impl Zygote {
    /// Starts the zygote of `program` and waits until it is ready: an error when it ends or
    /// stays silent instead (a helper that cannot be a zygote). `name` is its label for `ps`
    /// (the backend's state directory: which supervisor's zygote it is).
    pub(crate) fn start(program: &std::path::Path, name: &std::path::Path) -> io::Result<Zygote> {
        use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
        use std::os::fd::AsFd;
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )?;
        // The name, padded: the helpers it forks write their own labels over it.
        let mut label = name.as_os_str().to_os_string();
        label.push(" ".repeat(LABEL_ROOM.saturating_sub(label.len())));
        let process = spawn(
            program.as_os_str(),
            &[OsStr::new(ZYGOTE_ARG), &label],
            Stream::Null,
            Stream::Null,
            Stream::Inherit,
            &[(theirs.as_fd(), ZYGOTE_FD)],
        )?;
        drop(theirs);
        let mut zygote = Zygote {
            program: program.to_path_buf(),
            sock: ours,
            process,
        };
        match zygote.answer()? {
            ZygoteReply::Ready => Ok(zygote),
            other => Err(io::Error::other(format!(
                "{} answered {other:?} before it was ready",
                program.display()
            ))),
        }
    }

    /// The zygote's next message, within [`ZYGOTE_ANSWER`].
    fn answer(&mut self) -> io::Result<ZygoteReply> {
        use std::os::fd::AsFd;
        let mut buf = Vec::new();
        match control::recv_within::<ZygoteReply>(self.sock.as_fd(), &mut buf, ZYGOTE_ANSWER)
            .map_err(io::Error::other)?
        {
            control::Received::Message(reply, _) => Ok(reply),
            control::Received::Nothing => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no answer within {ZYGOTE_ANSWER:?}"),
            )),
            control::Received::Closed => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "it ended (its socket closed)",
            )),
        }
    }

    /// Whether it runs `program`.
    pub(crate) fn runs(&self, program: &std::path::Path) -> bool {
        self.program == program
    }

    /// A helper forked as [`spawn`] would start `PROGRAM - label`, with stdin and stdout on
    /// `/dev/null`, stderr on `stderr` and each `(fd, to)` of `fds` on `to`.
    pub(crate) fn spawn(
        &mut self,
        label: &str,
        stderr: BorrowedFd,
        fds: &[(BorrowedFd, RawFd)],
    ) -> Result<Spawned, ZygoteError> {
        use std::os::fd::AsFd;
        let lost = |what: &str, e: &dyn std::fmt::Display| {
            ZygoteError::Lost(format!("the helpers' zygote {what}: {e}"))
        };
        let mut raw = vec![stderr.as_raw_fd()];
        let mut targets = vec![2];
        for (fd, to) in fds {
            raw.push(fd.as_raw_fd());
            targets.push(*to);
        }
        let request = ZygoteRequest {
            label: label.to_owned(),
            targets,
        };
        control::send(self.sock.as_fd(), &request, &raw)
            .map_err(|e| ZygoteError::Gone(format!("the helpers' zygote cannot be asked: {e}")))?;
        match self.answer() {
            Ok(ZygoteReply::Forked { pid }) => Ok(Spawned { pid, reaped: None }),
            Ok(ZygoteReply::Failed { error }) => Err(ZygoteError::Refused(error)),
            Ok(ZygoteReply::Ready) => Err(lost("answered out of turn", &"ready")),
            Err(e) => Err(lost("did not answer", &e)),
        }
    }
}

impl Drop for Zygote {
    fn drop(&mut self) {
        // Its socket closes with this struct, which ends it; one that hangs is killed.
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// The argument that tells the helper to read its plan from [`PLAN_FD`](crate::config::PLAN_FD)
/// (followed by the sandbox's or the run's id, a label for `ps`).
pub(crate) const PLAN_ARG: &str = "-";

/// The helper's plan in a memfd, read from its start, to be placed on `PLAN_FD`: a plan file
/// on the state directory was an inode made and freed per sandbox (see `SharedFiles`). Sealed
/// against writes and resizes once written.
pub(crate) fn plan_memfd(plan: &[u8]) -> io::Result<OwnedFd> {
    use std::io::{Seek, Write};
    let fd = memfd(c"taskbox-plan", libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)?;
    let mut file = std::fs::File::from(fd);
    file.write_all(plan)?;
    file.rewind()?;
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor this function owns.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(OwnedFd::from(file))
}

/// The helper's standard error: a memfd the supervisor keeps, read when the helper fails or its
/// sandbox is lost. The helper writes nothing there unless something went wrong in it (a
/// panic's message), so it stays empty and costs no inode on the state directory.
#[derive(Debug)]
pub(crate) struct HelperLog(std::fs::File);

impl HelperLog {
    pub(crate) fn new() -> io::Result<HelperLog> {
        memfd(c"taskbox-helper-log", libc::MFD_CLOEXEC).map(|fd| HelperLog(fd.into()))
    }

    pub(crate) fn as_fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.0.as_fd()
    }

    /// The last line the helper wrote (at most 500 bytes of it), if any.
    pub(crate) fn last_words(&self) -> Option<String> {
        use std::os::unix::fs::FileExt;
        const TAIL: u64 = 4096;
        let len = self.0.metadata().ok()?.len();
        let from = len.saturating_sub(TAIL);
        let mut buf = vec![0u8; (len - from) as usize];
        let n = self.0.read_at(&mut buf, from).ok()?;
        buf.truncate(n);
        let text = String::from_utf8_lossy(&buf);
        let line = text.lines().rev().map(str::trim).find(|l| !l.is_empty())?;
        let mut end = line.len().min(500);
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        Some(line[..end].to_owned())
    }
}

fn memfd(name: &std::ffi::CStr, flags: libc::c_uint) -> io::Result<OwnedFd> {
    // SAFETY: a NUL-terminated name; the returned descriptor is new and owned here.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor no one else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsFd;

    #[test]
    fn installs_descriptors_on_their_numbers_even_when_they_cross() {
        // Two pipes whose write ends go to 3 and 4; the sources may sit on 3 or 4 themselves.
        let (r1, w1) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let (r2, w2) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let (out_r, out_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let mut child = spawn(
            OsStr::new("/bin/sh"),
            &[
                OsStr::new("-c"),
                OsStr::new("echo one >&3; echo two >&4; echo out; echo $PATH; cat"),
            ],
            Stream::Null,
            Stream::To(out_w.as_fd()),
            Stream::Null,
            &[(w2.as_fd(), 4), (w1.as_fd(), 3)],
        )
        .unwrap();
        drop((w1, w2, out_w));
        let read = |fd: OwnedFd| {
            let mut s = String::new();
            std::fs::File::from(fd).read_to_string(&mut s).unwrap();
            s
        };
        assert_eq!(read(r1), "one\n");
        assert_eq!(read(r2), "two\n");
        // The environment is empty (sh's own default PATH or none), stdin is /dev/null.
        let out = read(out_r);
        assert!(out.starts_with("out\n"), "{out:?}");
        assert!(child.wait().unwrap().success());
        // Reaped once: the status is kept, and kill does not signal a reused pid.
        assert!(child.try_wait().unwrap().unwrap().success());
        child.kill().unwrap();
    }

    #[test]
    fn a_missing_program_is_an_error_naming_it() {
        let e = spawn(
            OsStr::new("/nonexistent/taskbox-init"),
            &[],
            Stream::Null,
            Stream::Null,
            Stream::Null,
            &[],
        )
        .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/taskbox-init"), "{e}");
    }

    #[test]
    fn a_wait_with_a_timeout_wakes_at_the_end_or_gives_up() {
        let mut child = spawn(
            OsStr::new("/bin/sh"),
            &[OsStr::new("-c"), OsStr::new("sleep 0.2; exit 7")],
            Stream::Null,
            Stream::Null,
            Stream::Null,
            &[],
        )
        .unwrap();
        let t = std::time::Instant::now();
        assert_eq!(
            child
                .wait_timeout(std::time::Duration::from_millis(20))
                .unwrap(),
            None
        );
        assert!(t.elapsed() >= std::time::Duration::from_millis(20));
        let st = child
            .wait_timeout(std::time::Duration::from_secs(10))
            .unwrap()
            .unwrap();
        assert_eq!(st.code(), Some(7));
        assert!(
            t.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn kill_and_wait_report_the_signal() {
        let mut child = spawn(
            OsStr::new("/bin/sleep"),
            &[OsStr::new("60")],
            Stream::Null,
            Stream::Null,
            Stream::Null,
            &[],
        )
        .unwrap();
        assert!(child.try_wait().unwrap().is_none());
        child.kill().unwrap();
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
    }

    #[test]
    fn the_plan_memfd_reads_from_its_start_and_refuses_writes() {
        use std::io::{Read, Write};
        let fd = plan_memfd(b"{\"plan\":1}").unwrap();
        let mut f = std::fs::File::from(fd);
        let mut text = String::new();
        f.read_to_string(&mut text).unwrap();
        assert_eq!(text, "{\"plan\":1}");
        let e = f.write_all(b"more").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    }

    #[test]
    fn the_helper_log_gives_its_last_line_bounded() {
        use std::io::Write;
        let log = HelperLog::new().unwrap();
        assert_eq!(log.last_words(), None);
        let mut w = std::fs::File::from(log.as_fd().try_clone_to_owned().unwrap());
        w.write_all(b"first\nthread 'main' panicked at x.rs:1:2\n\n")
            .unwrap();
        assert_eq!(
            log.last_words().as_deref(),
            Some("thread 'main' panicked at x.rs:1:2")
        );
        w.write_all("é".repeat(400).as_bytes()).unwrap();
        let last = log.last_words().unwrap();
        assert!(last.len() <= 500 && last.starts_with('é'), "{}", last.len());
    }
}
