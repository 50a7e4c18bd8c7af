//! The seccomp filter installed on the command just before exec.
//!
//! A deny list, not an allow list: everything an ordinary build or test run needs stays allowed,
//! and what is refused is kernel attack surface or a way around the other layers (namespaces,
//! mounts, tracing other processes, kernel keyrings, eBPF, io_uring, module loading, clock and
//! power control, terminal injection). Refused calls fail with `EPERM`, so tools that probe for a
//! feature degrade instead of dying. `clone3` fails with `ENOSYS` instead: its flags live in
//! memory a filter cannot read, and `ENOSYS` makes libc fall back to `clone`, whose flags we check.
//!
//! Only the native syscall ABI is accepted. A call made through another ABI (i386 `int 0x80`,
//! x32) kills the process: the deny list is written in native syscall numbers and would not
//! apply to it.
//!
//! The program is seccompiler's compiled deny list behind a short hand-written prologue and a
//! binary search on the syscall number (see [`filter`]). The rules themselves are public data
//! ([`DENIED_SYSCALLS`], [`CLONE_NAMESPACE_FLAGS`], [`DENIED_SOCKET_FAMILIES`],
//! [`DENIED_IOCTLS`], [`ALLOWED_PERSONALITIES`], and `clone3` answered `ENOSYS`), so the Docker
//! backend renders the same rule set as a Docker seccomp profile.
//!
//! A second rule set ([`Rules::refuse_setid_modes`], for a command that writes to the host's own
//! directory: `--write-through`) refuses to give any file a setuid or setgid mode: the mode
//! changes ([`SETID_MODE_CALLS`]) and the creating opens ([`SETID_OPEN_CALLS`]) whose mode has
//! either bit, with `openat2` (whose mode lies in memory) answered `ENOSYS` like `clone3`. The
//! sandbox's mounts are `nosuid`, but the host's directory is not: such a file would run with
//! its owner's ids for any host user who can reach it. Image build steps never use it (dpkg sets
//! those bits in an image's layers). It is a filter of its own, whose match action is
//! `SECCOMP_RET_USER_NOTIF`: the process that holds its listener ([`install`] returns it; the
//! sandbox's pid 1 takes it) answers each such call with `EPERM` and counts it
//! ([`answer_setid_refusals`]), so the refusals are reported, not only made. Without anyone
//! listening the kernel answers `ENOSYS`: still refused.

use std::collections::BTreeMap;

pub use taskbox_protocol::seccomp_rules::*;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch, sock_filter,
};

/// Why the filter could not be built or installed.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// A rule or the filter as a whole was rejected by the compiler.
    #[error("cannot build the seccomp filter: {0}")]
    Build(#[from] seccompiler::BackendError),
    /// `prctl(PR_SET_NO_NEW_PRIVS)` or `seccomp(SECCOMP_SET_MODE_FILTER)` failed.
    #[error("cannot install the seccomp filter: {0}")]
    Install(#[from] seccompiler::Error),
    /// The setid filter, with its listener, could not be installed.
    #[error("cannot install the setid filter with a listener (Linux 5.0 and later): {0}")]
    Listener(std::io::Error),
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
compile_error!("the seccomp filter is written for x86_64 and aarch64 only");

#[cfg(target_arch = "x86_64")]
const TARGET_ARCH: TargetArch = TargetArch::x86_64;
#[cfg(target_arch = "aarch64")]
const TARGET_ARCH: TargetArch = TargetArch::aarch64;

// AUDIT_ARCH_* from <linux/audit.h>: ELF machine | 64-bit | little-endian.
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH_NATIVE: u32 = 62 | 0x8000_0000 | 0x4000_0000;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH_NATIVE: u32 = 183 | 0x8000_0000 | 0x4000_0000;

/// On x86_64 the x32 ABI reports the native audit arch and marks its syscall numbers with this
/// bit. No native syscall number (on any architecture) has it set.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

// Classic BPF opcodes (<linux/bpf_common.h>); libc has the parts with another integer type.
/// BPF_LD | BPF_W | BPF_ABS
const BPF_LD_W_ABS: u16 = 0x20;
/// BPF_JMP | BPF_JEQ | BPF_K
const BPF_JMP_JEQ_K: u16 = 0x15;
/// BPF_JMP | BPF_JGE | BPF_K
const BPF_JMP_JGE_K: u16 = 0x35;
/// BPF_RET | BPF_K
const BPF_RET_K: u16 = 0x06;

// Offsets in `struct seccomp_data { int nr; __u32 arch; __u64 ip; __u64 args[6]; }`.
const SECCOMP_DATA_NR: u32 = 0;
const SECCOMP_DATA_ARCH: u32 = 4;

/// What a refused call returns.
const DENY: SeccompAction = SeccompAction::Errno(libc::EPERM as u32);

/// Which rule sets the filter holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rules {
    /// The deny list (the policy's `security.seccomp`).
    pub deny_list: bool,
    /// Refuse setuid and setgid modes (`--write-through`).
    pub refuse_setid_modes: bool,
}

impl Rules {
    /// Whether there is anything to install.
    pub fn any(&self) -> bool {
        self.deny_list || self.refuse_setid_modes
    }
}

fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// One condition on the low 32 bits of an argument. The kernel reads these arguments (`int` or
/// `unsigned int`, or `clone`'s flags, of which it keeps the low half) as 32-bit values, so the
/// high half must not decide: `TIOCSTI | 0xdead_0000_0000_0000` is still TIOCSTI.
fn low32(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, SeccompError> {
    Ok(SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Dword,
        op,
        value,
    )?)
}

/// A rule matching when the low 32 bits of `arg`, masked with `mask`, equal `value`.
fn masked(arg: u8, mask: u64, value: u64) -> Result<SeccompRule, SeccompError> {
    Ok(SeccompRule::new(vec![low32(
        arg,
        SeccompCmpOp::MaskedEq(mask),
        value,
    )?])?)
}

/// The rules of [`Rules::refuse_setid_modes`].
fn setid_rules() -> Result<BTreeMap<i64, Vec<SeccompRule>>, SeccompError> {
    let mut rules = BTreeMap::new();
    for &(_, nr, mode) in SETID_MODE_CALLS {
        let any_bit = SETID_MODE_BITS
            .iter()
            .map(|&bit| masked(mode, bit, bit))
            .collect::<Result<_, _>>()?;
        rules.insert(nr, any_bit);
    }
    for &(_, nr, flags, mode) in SETID_OPEN_CALLS {
        // One rule per (creating flag, bit): the conditions of a rule are AND-ed, rules OR-ed.
        let mut any = Vec::new();
        for &flag in &CREATING_OPEN_FLAGS {
            for &bit in &SETID_MODE_BITS {
                any.push(SeccompRule::new(vec![
                    low32(flags, SeccompCmpOp::MaskedEq(flag), flag)?,
                    low32(mode, SeccompCmpOp::MaskedEq(bit), bit)?,
                ])?);
            }
        }
        rules.insert(nr, any);
    }
    Ok(rules)
}

fn rules() -> Result<BTreeMap<i64, Vec<SeccompRule>>, SeccompError> {
    // An empty rule list refuses the syscall unconditionally.
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED_SYSCALLS
        .iter()
        .map(|&(_, nr)| (nr, Vec::new()))
        .collect();

    // Rules of one syscall are OR-ed: any namespace flag refuses the clone.
    let clone = CLONE_NAMESPACE_FLAGS
        .iter()
        .map(|&flag| masked(0, flag as u64, flag as u64))
        .collect::<Result<_, _>>()?;
    rules.insert(libc::SYS_clone, clone);

    let socket = DENIED_SOCKET_FAMILIES
        .iter()
        .map(|&family| masked(0, 0xffff_ffff, family as u64))
        .collect::<Result<_, _>>()?;
    rules.insert(libc::SYS_socket, socket);

    let ioctl = DENIED_IOCTLS
        .iter()
        .map(|&request| masked(1, 0xffff_ffff, request))
        .collect::<Result<_, _>>()?;
    rules.insert(libc::SYS_ioctl, ioctl);

    // Conditions of one rule are AND-ed: refused when the value is none of the allowed ones.
    let personality = ALLOWED_PERSONALITIES
        .iter()
        .map(|&value| low32(0, SeccompCmpOp::Ne, value))
        .collect::<Result<_, _>>()?;
    rules.insert(libc::SYS_personality, vec![SeccompRule::new(personality)?]);

    Ok(rules)
}

/// The compiled filter.
///
/// Layout: a hand-written prologue, then seccompiler's program (which starts with its own,
/// now redundant, architecture check, then the deny list, with "allow" as the default).
///
/// The prologue:
/// 1. kills the process unless the audit arch is the native one (i386 `int 0x80` on x86_64);
/// 2. kills the process when the syscall number has bit 30 set: x32 calls carry the native audit
///    arch, so seccompiler's arch check lets them through, and they would otherwise match no rule
///    and be allowed;
/// 3. makes `clone3` (with the deny list) and `openat2` (with the setid rules) fail with
///    `ENOSYS` (a seccompiler filter has one match action, EPERM here);
/// 4. allows, after a binary search on the number ([`dispatch`]), every call that has no rule,
///    and sends the others on to seccompiler's program.
///
/// Classic BPF jumps are relative and only go forward, so instructions placed in front of a
/// program leave every jump inside it pointing where it did: prepending is safe, appending or
/// inserting in the middle would not be.
pub fn filter(which: Rules) -> Result<BpfProgram, SeccompError> {
    let kill = u32::from(SeccompAction::KillProcess);
    let enosys = u32::from(SeccompAction::Errno(libc::ENOSYS as u32));
    let mut program = vec![
        stmt(BPF_LD_W_ABS, SECCOMP_DATA_ARCH),
        jump(BPF_JMP_JEQ_K, AUDIT_ARCH_NATIVE, 1, 0),
        stmt(BPF_RET_K, kill),
        stmt(BPF_LD_W_ABS, SECCOMP_DATA_NR),
        jump(BPF_JMP_JGE_K, X32_SYSCALL_BIT, 0, 1),
        stmt(BPF_RET_K, kill),
    ];
    let mut rules = BTreeMap::new();
    if which.deny_list {
        program.extend([
            jump(BPF_JMP_JEQ_K, CLONE3.1 as u32, 0, 1),
            stmt(BPF_RET_K, enosys),
        ]);
        rules = self::rules()?;
    }
    if which.refuse_setid_modes {
        program.extend([
            jump(BPF_JMP_JEQ_K, OPENAT2.1 as u32, 0, 1),
            stmt(BPF_RET_K, enosys),
        ]);
    }
    if rules.is_empty() {
        program.push(stmt(BPF_RET_K, u32::from(SeccompAction::Allow)));
        return Ok(program);
    }
    let ruled: Vec<u32> = rules.keys().map(|&nr| nr as u32).collect();
    let deny_list = SeccompFilter::new(rules, SeccompAction::Allow, DENY, TARGET_ARCH)?;
    let compiled: BpfProgram = deny_list.try_into()?;
    program.extend(dispatch(&ruled));
    program.extend(compiled);
    Ok(program)
}

/// BPF_JMP | BPF_JA: an unconditional jump of `k` (32 bits) instructions.
const BPF_JMP_JA: u16 = 0x05;

/// A binary search on the syscall number (in the accumulator) in front of seccompiler's
/// program: a number without rules is allowed after a few comparisons, a number with rules
/// jumps to the program that follows, which tests it as before. seccompiler's program is a
/// chain of one test per number with rules, so without this every allowed call walked all of
/// them; and the kernel, when a filter is attached, runs it for every syscall number to find
/// the ones it may allow without running it at all (`seccomp_cache_prepare`, under the
/// process's signal lock): a tenth of that work now, one create's `seccomp(2)` was 1% of the
/// creation rate's CPU. Empty (the chain alone) when a branch would jump further than a classic
/// BPF conditional jump can (255).
fn dispatch(ruled: &[u32]) -> Vec<sock_filter> {
    // The whole range of numbers as segments, each all with rules or all without.
    let mut segments: Vec<(u32, bool)> = Vec::new(); // (first number, has rules)
    // The first number no segment covers yet.
    let mut next = 0u32;
    for &nr in ruled {
        if nr > next {
            segments.push((next, false));
        }
        // A number right after one with rules joins its segment.
        if nr > next || segments.is_empty() {
            segments.push((nr, true));
        }
        next = nr.saturating_add(1);
    }
    if ruled.last() != Some(&u32::MAX) {
        segments.push((next, false));
    }
    let mut tree = Vec::new();
    if !search(&segments, &mut tree) {
        return Vec::new();
    }
    // The jumps of segments with rules go to the first instruction after the tree.
    let len = tree.len();
    for (i, insn) in tree.iter_mut().enumerate() {
        if insn.code == BPF_JMP_JA {
            insn.k = (len - i - 1) as u32;
        }
    }
    tree
}

/// Appends the search over `segments` (sorted by first number, covering from the first's on)
/// to `out`; false when a branch is too long to jump over.
fn search(segments: &[(u32, bool)], out: &mut Vec<sock_filter>) -> bool {
    match segments {
        [] => true,
        [(_, true)] => {
            out.push(stmt(BPF_JMP_JA, 0));
            true
        }
        [(_, false)] => {
            out.push(stmt(BPF_RET_K, u32::from(SeccompAction::Allow)));
            true
        }
        _ => {
            let (below, from) = segments.split_at(segments.len() / 2);
            let at = out.len();
            out.push(jump(BPF_JMP_JGE_K, from[0].0, 0, 0));
            if !search(below, out) {
                return false;
            }
            let Ok(over) = u8::try_from(out.len() - at - 1) else {
                return false;
            };
            out[at].jt = over;
            search(from, out)
        }
    }
}

/// The filter of [`Rules::refuse_setid_modes`]: seccompiler's program for [`setid_rules`], whose
/// returns of its match action are turned into `SECCOMP_RET_USER_NOTIF` (seccompiler has no such
/// action). Installed after [`filter`], which has already killed other ABIs; the kernel takes
/// the strictest answer of all filters, so a call the deny list refuses stays refused.
pub fn setid_filter() -> Result<BpfProgram, SeccompError> {
    let mark = u32::from(SETID_MARK);
    let compiled: BpfProgram = SeccompFilter::new(
        setid_rules()?,
        SeccompAction::Allow,
        SETID_MARK,
        TARGET_ARCH,
    )?
    .try_into()?;
    Ok(compiled
        .into_iter()
        .map(|mut insn| {
            if insn.code == BPF_RET_K && insn.k == mark {
                insn.k = libc::SECCOMP_RET_USER_NOTIF;
            }
            insn
        })
        .collect())
}

/// The match action [`setid_filter`] compiles with before its returns are rewritten: an errno no
/// other rule uses, so no other return can be mistaken for it.
const SETID_MARK: SeccompAction = SeccompAction::Errno(libc::EPERM as u32 | 0x0800);

/// Builds the filters and installs them on the calling thread (and so on what it execs). With
/// [`Rules::refuse_setid_modes`], returns the listener of the setid filter: whoever holds it
/// must answer its calls ([`answer_setid_refusals`]), or drop it (the calls then fail with
/// `ENOSYS`).
///
/// The caller has set `no_new_privs` (seccompiler sets it again, which is harmless). Only the
/// calling thread is filtered: the helper is single-threaded when it calls this.
pub fn install(which: Rules) -> Result<Option<std::os::fd::OwnedFd>, SeccompError> {
    let program = filter(which)?;
    seccompiler::apply_filter(&program)?;
    if !which.refuse_setid_modes {
        return Ok(None);
    }
    let program = setid_filter()?;
    let prog = libc::sock_fprog {
        len: program.len() as u16,
        filter: program.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: `prog` points at `program`, which outlives the call; the kernel copies it.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_NEW_LISTENER,
            &prog as *const libc::sock_fprog,
        )
    };
    if fd < 0 {
        return Err(SeccompError::Listener(std::io::Error::last_os_error()));
    }
    // SAFETY: the kernel just returned this descriptor to us (with close-on-exec set).
    Ok(Some(unsafe {
        <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32)
    }))
}

/// What [`answer_setid_refusals`] has refused so far.
#[derive(Debug, Default)]
pub struct SetidRefusals {
    count: std::sync::atomic::AtomicU32,
    /// Bit `i` set: the call `setid_call_names()[i]` was refused at least once.
    calls: std::sync::atomic::AtomicU64,
}

impl SetidRefusals {
    /// How many calls were refused.
    pub fn count(&self) -> u32 {
        self.count.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The names of the calls refused, in table order.
    pub fn calls(&self) -> Vec<String> {
        let bits = self.calls.load(std::sync::atomic::Ordering::SeqCst);
        setid_call_numbers()
            .enumerate()
            .filter(|(i, _)| bits & (1 << i) != 0)
            .map(|(_, (name, _))| name.to_string())
            .collect()
    }

    fn record(&self, nr: i32) {
        use std::sync::atomic::Ordering;
        self.count.fetch_add(1, Ordering::SeqCst);
        if let Some(i) = setid_call_numbers().position(|(_, n)| n == libc::c_long::from(nr)) {
            self.calls.fetch_or(1 << i, Ordering::SeqCst);
        }
    }
}

/// Every call of the setid rules, by name and number.
fn setid_call_numbers() -> impl Iterator<Item = (&'static str, libc::c_long)> {
    SETID_MODE_CALLS
        .iter()
        .map(|&(name, nr, _)| (name, nr))
        .chain(SETID_OPEN_CALLS.iter().map(|&(name, nr, _, _)| (name, nr)))
}

/// Answers every call the setid filter behind `listener` holds with `EPERM`, on a thread of its
/// own, counting them in the returned record. The thread ends when the listener fails (every
/// filtered process gone and the descriptor closed elsewhere, or an error); a call whose
/// process died before it was answered is skipped.
pub fn answer_setid_refusals(
    listener: std::os::fd::OwnedFd,
) -> std::io::Result<std::sync::Arc<SetidRefusals>> {
    use std::os::fd::AsRawFd;
    let seen = std::sync::Arc::new(SetidRefusals::default());
    let record = seen.clone();
    std::thread::Builder::new()
        .name("setid-refusals".into())
        .spawn(move || {
            loop {
                // SAFETY: plain old data; the kernel requires it zeroed.
                let mut notif: libc::seccomp_notif = unsafe { std::mem::zeroed() };
                // SAFETY: `notif` is valid for writes of its size, which the ioctl's number
                // encodes.
                let rc = unsafe {
                    libc::ioctl(
                        listener.as_raw_fd(),
                        libc::SECCOMP_IOCTL_NOTIF_RECV,
                        &mut notif,
                    )
                };
                if rc < 0 {
                    match std::io::Error::last_os_error().raw_os_error() {
                        Some(libc::EINTR) | Some(libc::ENOENT) => continue,
                        _ => return,
                    }
                }
                // Counted before the answer, so a caller that sees its EPERM is counted.
                record.record(notif.data.nr);
                let mut resp = libc::seccomp_notif_resp {
                    id: notif.id,
                    val: 0,
                    error: -libc::EPERM,
                    flags: 0,
                };
                // SAFETY: `resp` is valid for reads of its size; ENOENT (the caller died) is
                // harmless.
                unsafe {
                    libc::ioctl(
                        listener.as_raw_fd(),
                        libc::SECCOMP_IOCTL_NOTIF_SEND,
                        &mut resp,
                    );
                }
            }
        })?;
    Ok(seen)
}

#[cfg(test)]
pub(crate) mod tests {
    //! Each test forks; the child confines itself, tries one thing, and reports through its exit
    //! code (0: the call succeeded, otherwise the errno it got). No root is needed.

    use std::panic::AssertUnwindSafe;

    use super::*;

    /// Exit code of a child whose body panicked.
    const PANICKED: i32 = 200;
    /// Exit code of a child whose confinement step failed.
    pub(crate) const SETUP_FAILED: i32 = 201;

    #[derive(Debug, PartialEq, Eq)]
    pub(crate) enum Ended {
        Exited(i32),
        Signaled(i32),
    }

    /// Runs `body` in a forked child and returns how the child ended.
    pub(crate) fn in_child(body: impl FnOnce() -> i32) -> Ended {
        // SAFETY: fork has no memory-safety preconditions. The child runs only `body` and then
        // `_exit`s, so it never returns into the test harness; glibc's malloc is fork-safe, so
        // the child may allocate even though the harness has other threads.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            let code = std::panic::catch_unwind(AssertUnwindSafe(body)).unwrap_or(PANICKED);
            // SAFETY: _exit only ends the process; no destructors or atexit handlers of the
            // parent's state run in the child.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: `pid` is our child and `status` is a valid place for the kernel to write.
        let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(rc, pid, "waitpid: {}", std::io::Error::last_os_error());
        if libc::WIFEXITED(status) {
            Ended::Exited(libc::WEXITSTATUS(status))
        } else {
            Ended::Signaled(libc::WTERMSIG(status))
        }
    }

    /// Sets `no_new_privs` the way the helper does (and no core dumps for the tests that end in
    /// SIGSYS, and a new session so no terminal is reachable).
    pub(crate) fn confine_basics() -> bool {
        let no_core = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: plain syscalls with valid arguments; `no_core` outlives the setrlimit call.
        unsafe {
            libc::setsid();
            libc::setrlimit(libc::RLIMIT_CORE, &no_core) == 0
                && libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
        }
    }

    /// Runs `body` in a child under the filter.
    fn filtered(body: impl FnOnce() -> i32) -> Ended {
        in_child(|| {
            if !confine_basics() || install(DENY_LIST).is_err() {
                return SETUP_FAILED;
            }
            body()
        })
    }

    pub(crate) fn errno() -> i32 {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    /// 0 when a libc-style return value is a success, the errno otherwise.
    pub(crate) fn outcome(rc: libc::c_long) -> i32 {
        if rc == -1 { errno() } else { 0 }
    }

    /// A raw syscall with six arguments.
    fn sys(nr: libc::c_long, a: [libc::c_long; 6]) -> i32 {
        // SAFETY: every caller passes arguments that the kernel only validates (null or invalid
        // pointers it checks, invalid fds, invalid flags); no memory of ours is written.
        outcome(unsafe { libc::syscall(nr, a[0], a[1], a[2], a[3], a[4], a[5]) })
    }

    /// The filter every sandbox gets by default.
    const DENY_LIST: Rules = Rules {
        deny_list: true,
        refuse_setid_modes: false,
    };

    const REFUSED: Ended = Ended::Exited(libc::EPERM);
    const SUCCEEDED: Ended = Ended::Exited(0);
    const KILLED: Ended = Ended::Signaled(libc::SIGSYS);

    /// Runs a classic BPF program of the kinds the filters use on one call: its return value,
    /// and how many instructions it ran.
    fn run(program: &[sock_filter], nr: u32, arch: u32, args: [u64; 6]) -> (u32, usize) {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_ne_bytes());
        data[4..8].copy_from_slice(&arch.to_ne_bytes());
        for (i, a) in args.iter().enumerate() {
            data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_ne_bytes());
        }
        let (mut acc, mut pc) = (0u32, 0usize);
        for steps in 1.. {
            let insn = &program[pc];
            pc += 1;
            let cond = |taken: bool| if taken { insn.jt } else { insn.jf } as usize;
            match insn.code {
                0x20 => {
                    let at = insn.k as usize;
                    acc = u32::from_ne_bytes(data[at..at + 4].try_into().unwrap());
                }
                0x54 => acc &= insn.k,
                0x05 => pc += insn.k as usize,
                0x15 => pc += cond(acc == insn.k),
                0x25 => pc += cond(acc > insn.k),
                0x35 => pc += cond(acc >= insn.k),
                0x45 => pc += cond(acc & insn.k != 0),
                0x06 => return (insn.k, steps),
                other => panic!("instruction {other:#x} at {}", pc - 1),
            }
        }
        unreachable!()
    }

    #[test]
    fn the_search_in_front_of_the_deny_list_changes_no_answer() {
        let with = filter(DENY_LIST).unwrap();
        let ruled: Vec<u32> = rules().unwrap().keys().map(|&nr| nr as u32).collect();
        let search = dispatch(&ruled);
        assert!(!search.is_empty(), "the search fits in classic BPF's jumps");
        // The same filter without the search: the prologue, then seccompiler's chain.
        let at = with
            .windows(search.len())
            .position(|w| {
                w.iter()
                    .zip(&search)
                    .all(|(a, b)| (a.code, a.jt, a.jf, a.k) == (b.code, b.jt, b.jf, b.k))
            })
            .unwrap();
        let mut without = with[..at].to_vec();
        without.extend_from_slice(&with[at + search.len()..]);
        let mut argsets: Vec<[u64; 6]> = vec![[0; 6], [u64::MAX; 6]];
        for flag in CLONE_NAMESPACE_FLAGS {
            argsets.push([flag as u64, 0, 0, 0, 0, 0]);
        }
        for family in DENIED_SOCKET_FAMILIES {
            argsets.push([family as u64, 1, 0, 0, 0, 0]);
        }
        for request in DENIED_IOCTLS {
            argsets.push([0, request, 0, 0, 0, 0]);
            argsets.push([0, request | 0xdead_0000_0000_0000, 0, 0, 0, 0]);
        }
        for value in ALLOWED_PERSONALITIES {
            argsets.push([value, 0, 0, 0, 0, 0]);
        }
        let (mut allowed, mut steps_with, mut steps_without) = (0, 0, 0);
        for nr in (0..1100u32).chain([X32_SYSCALL_BIT, X32_SYSCALL_BIT + 1, u32::MAX]) {
            for arch in [AUDIT_ARCH_NATIVE, 0x4000_0003] {
                for args in &argsets {
                    let (a, n) = run(&with, nr, arch, *args);
                    let (b, m) = run(&without, nr, arch, *args);
                    assert_eq!(a, b, "syscall {nr}, arch {arch:#x}, args {args:x?}");
                    if a == u32::from(SeccompAction::Allow) && !ruled.contains(&nr) {
                        allowed += 1;
                        steps_with += n;
                        steps_without += m;
                    }
                }
            }
        }
        assert!(allowed > 1000, "{allowed}");
        eprintln!(
            "{allowed} allowed calls: {steps_with} instructions with the search, {steps_without} \
             without; the search is {} instructions",
            search.len()
        );
        // A call without rules is allowed after a few comparisons, not the whole chain.
        assert!(
            steps_with * 4 < steps_without,
            "{steps_with} instructions against {steps_without}"
        );
    }

    #[test]
    fn filter_compiles_to_a_loadable_size() {
        let program = filter(DENY_LIST).expect("filter builds");
        assert!(program.len() < 4096, "{} instructions", program.len());
    }

    #[test]
    fn denied_syscalls_return_eperm() {
        use libc::*;
        let none = -1 as c_long;
        let mut table: Vec<(&str, c_long, [c_long; 6])> = vec![
            (
                "ptrace",
                SYS_ptrace,
                [PTRACE_TRACEME as c_long, 0, 0, 0, 0, 0],
            ),
            ("process_vm_readv", SYS_process_vm_readv, [0; 6]),
            ("process_vm_writev", SYS_process_vm_writev, [0; 6]),
            ("pidfd_getfd", SYS_pidfd_getfd, [none, none, 0, 0, 0, 0]),
            (
                "process_madvise",
                SYS_process_madvise,
                [none, 0, 0, 0, 0, 0],
            ),
            ("io_uring_setup", SYS_io_uring_setup, [1, 0, 0, 0, 0, 0]),
            ("io_uring_enter", SYS_io_uring_enter, [none, 0, 0, 0, 0, 0]),
            (
                "io_uring_register",
                SYS_io_uring_register,
                [none, 0, 0, 0, 0, 0],
            ),
            ("keyctl", SYS_keyctl, [none, 0, 0, 0, 0, 0]),
            ("add_key", SYS_add_key, [0; 6]),
            ("request_key", SYS_request_key, [0; 6]),
            ("bpf", SYS_bpf, [none, 0, 0, 0, 0, 0]),
            (
                "perf_event_open",
                SYS_perf_event_open,
                [0, 0, none, none, 0, 0],
            ),
            ("userfaultfd", SYS_userfaultfd, [0; 6]),
            (
                "unshare",
                SYS_unshare,
                [CLONE_NEWUSER as c_long, 0, 0, 0, 0, 0],
            ),
            ("setns", SYS_setns, [none, 0, 0, 0, 0, 0]),
            ("mount", SYS_mount, [0; 6]),
            ("umount2", SYS_umount2, [0; 6]),
            ("fsopen", SYS_fsopen, [0; 6]),
            ("fsconfig", SYS_fsconfig, [none, 0, 0, 0, 0, 0]),
            ("fsmount", SYS_fsmount, [none, 0, 0, 0, 0, 0]),
            ("fspick", SYS_fspick, [none, 0, 0, 0, 0, 0]),
            ("move_mount", SYS_move_mount, [none, 0, none, 0, 0, 0]),
            ("open_tree", SYS_open_tree, [none, 0, 0, 0, 0, 0]),
            ("mount_setattr", SYS_mount_setattr, [none, 0, 0, 0, 0, 0]),
            ("pivot_root", SYS_pivot_root, [0; 6]),
            ("chroot", SYS_chroot, [0; 6]),
            ("kexec_load", SYS_kexec_load, [0, 0, 0, none, 0, 0]),
            (
                "kexec_file_load",
                SYS_kexec_file_load,
                [none, none, 0, 0, none, 0],
            ),
            ("init_module", SYS_init_module, [0; 6]),
            ("finit_module", SYS_finit_module, [none, 0, 0, 0, 0, 0]),
            ("delete_module", SYS_delete_module, [0; 6]),
            (
                "open_by_handle_at",
                SYS_open_by_handle_at,
                [none, 0, 0, 0, 0, 0],
            ),
            (
                "name_to_handle_at",
                SYS_name_to_handle_at,
                [none, 0, 0, 0, 0, 0],
            ),
            ("acct", SYS_acct, [1, 0, 0, 0, 0, 0]),
            ("swapon", SYS_swapon, [0; 6]),
            ("swapoff", SYS_swapoff, [0; 6]),
            ("reboot", SYS_reboot, [0; 6]),
            ("settimeofday", SYS_settimeofday, [0; 6]),
            ("clock_settime", SYS_clock_settime, [none, 0, 0, 0, 0, 0]),
            ("adjtimex", SYS_adjtimex, [0; 6]),
            ("clock_adjtime", SYS_clock_adjtime, [none, 0, 0, 0, 0, 0]),
            ("lookup_dcookie", SYS_lookup_dcookie, [0; 6]),
            ("quotactl", SYS_quotactl, [0; 6]),
            ("quotactl_fd", SYS_quotactl_fd, [none, 0, 0, 0, 0, 0]),
            ("vhangup", SYS_vhangup, [0; 6]),
            ("syslog", SYS_syslog, [10, 0, 0, 0, 0, 0]),
            ("nfsservctl", SYS_nfsservctl, [0; 6]),
            ("fanotify_init", SYS_fanotify_init, [none, 0, 0, 0, 0, 0]),
            (
                "personality(ADDR_NO_RANDOMIZE)",
                SYS_personality,
                [0x0040000, 0, 0, 0, 0, 0],
            ),
        ];
        #[cfg(target_arch = "x86_64")]
        table.extend([
            ("iopl", SYS_iopl, [0; 6]),
            ("ioperm", SYS_ioperm, [0; 6]),
            ("uselib", SYS_uselib, [0; 6]),
        ]);
        let mut failures = Vec::new();
        for (name, nr, args) in table {
            let ended = filtered(|| sys(nr, args));
            if ended != REFUSED {
                failures.push(format!("{name}: {ended:?}"));
            }
        }
        assert!(failures.is_empty(), "not refused with EPERM: {failures:#?}");
    }

    #[test]
    fn clone_with_any_namespace_flag_is_refused() {
        for flag in CLONE_NAMESPACE_FLAGS {
            let ended = filtered(|| {
                let flags = (flag | libc::SIGCHLD) as libc::c_long;
                // SAFETY: a fork-like clone (no CLONE_VM, null stack: the child runs on a copy of
                // our stack); a child that does get created `_exit`s at once.
                let rc = unsafe { libc::syscall(libc::SYS_clone, flags, 0, 0, 0, 0) };
                if rc == 0 {
                    // SAFETY: ends the unexpected child without touching shared state.
                    unsafe { libc::_exit(0) };
                }
                if rc > 0 {
                    // SAFETY: `rc` is our child; a null status pointer is allowed.
                    unsafe { libc::waitpid(rc as libc::pid_t, std::ptr::null_mut(), 0) };
                }
                outcome(rc)
            });
            assert_eq!(ended, REFUSED, "clone with flag {flag:#x}");
        }
    }

    #[test]
    fn clone3_is_enosys() {
        // Unfiltered, a null argument would be EINVAL or EFAULT; the filter answers first.
        let ended = filtered(|| sys(libc::SYS_clone3, [0; 6]));
        assert_eq!(ended, Ended::Exited(libc::ENOSYS));
    }

    #[test]
    fn fork_threads_and_spawn_still_work() {
        let ended = filtered(|| {
            // SAFETY: the child of this fork `_exit`s at once.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: see above.
                unsafe { libc::_exit(7) };
            }
            if pid < 0 {
                return 1;
            }
            let mut status = 0;
            // SAFETY: `pid` is our child and `status` is a valid place to write.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 7 {
                return 2;
            }
            // glibc tries clone3 first for threads and posix_spawn, then falls back to clone.
            if std::thread::spawn(|| 5).join().ok() != Some(5) {
                return 3;
            }
            let spawned = std::process::Command::new("/bin/sh")
                .args(["-c", "exit 9"])
                .status();
            match spawned {
                Ok(status) if status.code() == Some(9) => 0,
                _ => 4,
            }
        });
        assert_eq!(ended, SUCCEEDED);
    }

    #[test]
    fn dangerous_socket_families_are_refused() {
        for family in DENIED_SOCKET_FAMILIES {
            for kind in [libc::SOCK_STREAM, libc::SOCK_DGRAM, libc::SOCK_RAW] {
                let ended = filtered(|| {
                    // SAFETY: socket has no memory arguments.
                    outcome(unsafe { libc::socket(family, kind, 0) }.into())
                });
                assert_eq!(ended, REFUSED, "socket({family}, {kind})");
            }
        }
    }

    #[test]
    fn unix_and_netlink_sockets_work() {
        let ended = filtered(|| {
            // SAFETY: socket has no memory arguments.
            let unix = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) };
            // SAFETY: as above.
            let netlink =
                unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW, libc::NETLINK_ROUTE) };
            if unix < 0 || netlink < 0 { errno() } else { 0 }
        });
        assert_eq!(ended, SUCCEEDED);
    }

    #[test]
    fn terminal_injection_ioctls_are_refused_whatever_the_high_bits() {
        let requests = [
            libc::TIOCSTI,
            libc::TIOCSTI | 0xdead_0000_0000_0000,
            libc::TIOCLINUX,
            libc::TIOCLINUX | 0x1_0000_0000,
        ];
        for request in requests {
            let ended = filtered(|| {
                // /dev/null is no terminal: if the filter let the call through it would be
                // ENOTTY, never an injected keystroke.
                let Ok(null) = std::fs::File::open("/dev/null") else {
                    return SETUP_FAILED;
                };
                let byte = b'x';
                let fd = std::os::fd::AsRawFd::as_raw_fd(&null);
                sys(
                    libc::SYS_ioctl,
                    [
                        fd.into(),
                        request as libc::c_long,
                        &byte as *const u8 as libc::c_long,
                        0,
                        0,
                        0,
                    ],
                )
            });
            assert_eq!(ended, REFUSED, "ioctl request {request:#x}");
        }
    }

    #[test]
    fn x32_syscalls_kill_the_process() {
        let ended = filtered(|| sys(libc::SYS_getpid | 0x4000_0000, [0; 6]));
        assert_eq!(ended, KILLED);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn i386_syscalls_kill_the_process() {
        let ended = filtered(|| {
            let ret: i32;
            // SAFETY: `int 0x80` enters the i386 syscall table; eax=20 is i386 getpid, which
            // touches no memory. The 64-bit kernel saves and restores all other registers.
            unsafe {
                std::arch::asm!("int 0x80", inlateout("eax") 20 => ret, options(nostack));
            }
            // SAFETY: getpid has no preconditions.
            let pid = unsafe { libc::getpid() };
            if ret == pid { 0 } else { 1 }
        });
        assert_ne!(ended, SUCCEEDED, "an i386 syscall went through the filter");
        assert_eq!(ended, KILLED);
    }

    #[test]
    fn personality_query_and_default_are_allowed() {
        let ended = filtered(|| {
            // SAFETY: personality has no memory arguments.
            let current = unsafe { libc::personality(0xffff_ffff) };
            // SAFETY: as above; sets the default personality.
            let set = unsafe { libc::personality(0) };
            if current < 0 || set < 0 { errno() } else { 0 }
        });
        assert_eq!(ended, SUCCEEDED);
    }

    #[test]
    fn ordinary_work_still_works() {
        let ended = filtered(|| {
            // SAFETY: getpid has no preconditions.
            if unsafe { libc::getpid() } <= 0 {
                return 1;
            }
            match std::fs::read_to_string("/proc/self/status") {
                Ok(status) if status.contains("Seccomp:\t2") => {}
                _ => return 2,
            }
            if std::path::Path::new("/etc/hostname").exists()
                && std::fs::read("/etc/hostname").is_err()
            {
                return 3;
            }
            let mut fds = [0; 2];
            // SAFETY: `fds` has room for the two descriptors pipe writes.
            if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
                return 4;
            }
            // SAFETY: fds[1] is the pipe's write end; the buffer is 5 valid bytes.
            let written = unsafe { libc::write(fds[1], b"hello".as_ptr().cast(), 5) };
            let mut buf = [0u8; 5];
            // SAFETY: fds[0] is the pipe's read end; `buf` has room for 5 bytes.
            let read = unsafe { libc::read(fds[0], buf.as_mut_ptr().cast(), 5) };
            if written != 5 || read != 5 || &buf != b"hello" {
                return 5;
            }
            let mut pending: libc::c_int = -1;
            // SAFETY: FIONREAD writes one int to `pending`.
            if unsafe { libc::ioctl(fds[0], libc::FIONREAD, &mut pending) } != 0 || pending != 0 {
                return 6;
            }
            0
        });
        assert_eq!(ended, SUCCEEDED);
    }

    /// Runs `body` in a child under `which`, in a fresh directory holding `file` (mode 0755).
    fn in_scratch(which: Rules, body: impl FnOnce(&ScratchPaths) -> i32) -> Ended {
        let dir = tempfile::tempdir().expect("scratch directory");
        let c = |name: &str| {
            std::ffi::CString::new(dir.path().join(name).as_os_str().as_encoded_bytes())
                .expect("no NUL in a temporary path")
        };
        let paths = ScratchPaths {
            dir: c(""),
            file: c("file"),
            new: c("new"),
        };
        std::fs::write(dir.path().join("file"), b"#!/bin/sh\n").expect("scratch file");
        in_child(|| {
            if !confine_basics() {
                return SETUP_FAILED;
            }
            // The setid filter's calls are answered here, as pid 1 answers them in a sandbox.
            let _refusals = match install(which) {
                Ok(Some(listener)) => match answer_setid_refusals(listener) {
                    Ok(r) => Some(r),
                    Err(_) => return SETUP_FAILED,
                },
                Ok(None) => None,
                Err(_) => return SETUP_FAILED,
            };
            body(&paths)
        })
    }

    #[test]
    fn refused_setid_calls_are_counted_and_named_by_the_listener() {
        let dir = tempfile::tempdir().expect("scratch directory");
        let file = std::ffi::CString::new(dir.path().join("f").as_os_str().as_encoded_bytes())
            .expect("no NUL");
        let sub = std::ffi::CString::new(dir.path().join("d").as_os_str().as_encoded_bytes())
            .expect("no NUL");
        std::fs::write(dir.path().join("f"), b"x").expect("scratch file");
        let ended = in_child(|| {
            if !confine_basics() {
                return SETUP_FAILED;
            }
            let Ok(Some(listener)) = install(BOTH) else {
                return SETUP_FAILED;
            };
            let Ok(refusals) = answer_setid_refusals(listener) else {
                return SETUP_FAILED;
            };
            // SAFETY: valid NUL-terminated paths that outlive the calls; integer modes.
            let (a, b, c, d) = unsafe {
                (
                    libc::chmod(file.as_ptr(), 0o4755),
                    libc::chmod(file.as_ptr(), 0o2755),
                    libc::mkdir(sub.as_ptr(), 0o2755),
                    libc::chmod(file.as_ptr(), 0o755),
                )
            };
            if (a, b, c, d) != (-1, -1, -1, 0) {
                return 101;
            }
            let calls = refusals.calls();
            // glibc calls chmod and mkdir where they exist, fchmodat and mkdirat elsewhere.
            let expected = if cfg!(target_arch = "x86_64") {
                ["chmod", "mkdir"]
            } else {
                ["fchmodat", "mkdirat"]
            };
            if calls != expected {
                eprintln!("calls: {calls:?}");
                return 102;
            }
            refusals.count() as i32
        });
        assert_eq!(ended, Ended::Exited(3));
    }

    struct ScratchPaths {
        dir: std::ffi::CString,
        file: std::ffi::CString,
        new: std::ffi::CString,
    }

    const SETID_ONLY: Rules = Rules {
        deny_list: false,
        refuse_setid_modes: true,
    };
    const BOTH: Rules = Rules {
        deny_list: true,
        refuse_setid_modes: true,
    };

    #[test]
    fn setid_modes_are_refused_by_every_call_that_sets_a_mode() {
        use libc::*;
        /// One call that gives a file mode `m` (see the table below), made raw.
        fn call(name: &str, p: &ScratchPaths, m: c_long) -> c_long {
            let (file, new, dir) = (p.file.as_ptr(), p.new.as_ptr(), p.dir.as_ptr());
            let creat = (O_CREAT | O_WRONLY) as c_long;
            let reg = S_IFREG as c_long;
            // SAFETY: the paths are valid NUL-terminated strings that outlive the call, every
            // other argument is a plain integer, and a descriptor opened belongs to the child.
            unsafe {
                match name {
                    "fchmodat" => syscall(SYS_fchmodat, AT_FDCWD, file, m),
                    "fchmodat2" => syscall(SYS_FCHMODAT2, AT_FDCWD, file, m, 0),
                    "fchmod" => syscall(SYS_fchmod, open(file, O_RDONLY), m),
                    "openat O_CREAT" => syscall(SYS_openat, AT_FDCWD, new, creat, m),
                    "openat O_TMPFILE" => syscall(
                        SYS_openat,
                        AT_FDCWD,
                        dir,
                        (O_TMPFILE | O_WRONLY) as c_long,
                        m,
                    ),
                    "mkdirat" => syscall(SYS_mkdirat, AT_FDCWD, new, m),
                    "mknodat" => syscall(SYS_mknodat, AT_FDCWD, new, reg | m, 0),
                    #[cfg(target_arch = "x86_64")]
                    "chmod" => syscall(SYS_chmod, file, m),
                    #[cfg(target_arch = "x86_64")]
                    "creat" => syscall(SYS_creat, new, m),
                    #[cfg(target_arch = "x86_64")]
                    "open O_CREAT" => syscall(SYS_open, new, creat, m),
                    #[cfg(target_arch = "x86_64")]
                    "mkdir" => syscall(SYS_mkdir, new, m),
                    #[cfg(target_arch = "x86_64")]
                    "mknod" => syscall(SYS_mknod, new, reg | m, 0),
                    other => panic!("no call {other}"),
                }
            }
        }
        let mut calls = vec![
            "fchmodat",
            "fchmodat2",
            "fchmod",
            "openat O_CREAT",
            "openat O_TMPFILE",
            "mkdirat",
            "mknodat",
        ];
        #[cfg(target_arch = "x86_64")]
        calls.extend(["chmod", "creat", "open O_CREAT", "mkdir", "mknod"]);
        let mut failures = Vec::new();
        for name in calls {
            for rules in [SETID_ONLY, BOTH] {
                // Any setid bit, also with high bits the kernel drops, is refused.
                for mode in [0o4755, 0o2755, 0o6777, 0o4000 | 0x1_0000_0000] {
                    let ended = in_scratch(rules, |p| outcome(call(name, p, mode)));
                    if ended != REFUSED {
                        failures.push(format!("{name} {mode:#o} under {rules:?}: {ended:?}"));
                    }
                }
                // Ordinary modes still work.
                let ended = in_scratch(rules, |p| outcome(call(name, p, 0o755)));
                if ended != SUCCEEDED {
                    failures.push(format!("{name} 0755 under {rules:?}: {ended:?}"));
                }
            }
            // The default filter leaves them alone: image build steps set such bits.
            let ended = in_scratch(DENY_LIST, |p| outcome(call(name, p, 0o4755)));
            if ended != SUCCEEDED {
                failures.push(format!("{name} 04755 under the deny list alone: {ended:?}"));
            }
        }
        assert!(failures.is_empty(), "{failures:#?}");
    }

    #[test]
    fn an_open_that_creates_nothing_may_carry_any_mode_and_openat2_is_enosys() {
        let ended = in_scratch(SETID_ONLY, |p| {
            // Without O_CREAT the kernel ignores the mode, which callers may leave as garbage.
            // SAFETY: a valid path; plain integer arguments.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_openat,
                    libc::AT_FDCWD,
                    p.file.as_ptr(),
                    libc::O_RDONLY,
                    0o6777,
                )
            };
            outcome(rc)
        });
        assert_eq!(ended, SUCCEEDED);
        // Unfiltered, a null `how` would be EFAULT; the filter answers first.
        let ended = in_scratch(SETID_ONLY, |p| {
            // SAFETY: a valid path; a null `how` the kernel would only check.
            outcome(unsafe {
                libc::syscall(libc::SYS_openat2, libc::AT_FDCWD, p.new.as_ptr(), 0, 0)
            })
        });
        assert_eq!(ended, Ended::Exited(libc::ENOSYS));
        // The setid rules alone keep the ABI checks (an i386 chmod would skip every rule).
        let program = filter(SETID_ONLY).expect("filter builds");
        assert!(program.len() < 4096);
        let ended = in_scratch(SETID_ONLY, |_| sys(libc::SYS_clone3, [0; 6]));
        assert_ne!(
            ended,
            Ended::Exited(libc::ENOSYS),
            "clone3 is the deny list's"
        );
    }
}
