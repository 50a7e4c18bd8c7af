//! Escape attempts: each is tried for real and must be refused. The host-view ones run on the
//! native backend; the rest run on every backend (`backend_suite!` at the end). The native
//! variants also run as an unprivileged user (scripts/test.sh runs the suite both ways).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::io::Read;
use std::net::{TcpListener, UdpSocket};
use std::os::unix::fs::symlink;
use std::time::Duration;

use taskbox_tests::{Backend, Env, PYTHON, is_root, require};

/// Runs a Python snippet in the sandbox and returns its stdout (the snippet prints its verdict).
fn py(env: &Env, code: &str) -> String {
    let r = env.run_json(&[], &[PYTHON, "-c", code]);
    assert!(
        r.exit_code().is_some(),
        "python was killed: {:#}\n{}",
        r.json,
        r.raw_stderr
    );
    format!("{}{}", r.stdout(), r.stderr())
}

#[test]
fn host_shared_places_receive_nothing() {
    let env = Env::new();
    let name = format!("taskbox-shared-{}", std::process::id());
    let r = env.sh(&format!(
        "for d in /dev/shm /var/tmp \"$HOME\"; do echo x > \"$d/{name}\" || echo FAIL $d; done; true"
    ));
    r.ok();
    for d in ["/dev/shm".into(), "/var/tmp".into(), env.home()] {
        assert!(!d.join(&name).exists(), "{} reached the host", d.display());
    }
}

/// Run by root, `taskbox run`'s command is an id of the sandbox's own range: uid 0 inside,
/// an unprivileged host id outside, to which a host file only root may read (and that no deny
/// list names) is unreadable. Rootless, the command is the caller and there is nothing to try.
#[test]
fn a_root_run_commands_are_not_the_hosts_root() {
    if !is_root() {
        eprintln!("rootless: the command is the caller's own uid");
        return;
    }
    let dir = std::path::PathBuf::from(format!("/opt/taskbox-run-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "root only\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let env = Env::new();
    let r = env.sh(&format!(
        "id -u; cat /proc/self/uid_map; cat {} 2>/dev/null || echo refused; echo x > made && stat -c %u made",
        secret.display()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let out = r.stdout();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.first(), Some(&"0"), "{out}");
    let map: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!((map[0], map[2]), ("0", "65536"), "{out}");
    assert!(map[1].parse::<u64>().unwrap() >= 0x6000_0000, "{out}");
    assert_eq!(&lines[2..], ["refused", "0"], "{out}");
}

#[test]
fn deny_read_paths_are_unreadable_directly_via_symlinks_and_via_proc_self_root() {
    let env = Env::new();
    let shadow = std::fs::read("/etc/shadow").unwrap_or_default();
    require(
        !shadow.is_empty() || !is_root(),
        "/etc/shadow is empty on this host",
    );
    symlink("/etc/shadow", env.ws().join("shadow-link")).unwrap();
    symlink("/etc", env.ws().join("etc-link")).unwrap();
    for path in [
        "/etc/shadow",
        "shadow-link",
        "etc-link/shadow",
        "/proc/self/root/etc/shadow",
        "/proc/1/root/etc/shadow",
        "/etc/gshadow",
    ] {
        let r = env.sh(&format!("cat {path} 2>/dev/null | head -c 100; true"));
        assert_eq!(r.stdout(), "", "{path} was readable");
    }
}

/// The empty file bound over masked files is one per state directory, shared by every run: a
/// run that could write it would change what the next run finds there. Every way in fails.
#[test]
fn the_shared_mask_file_cannot_be_written_from_a_sandbox() {
    let env = Env::new();
    let tries = "for f in /etc/shadow /etc/gshadow; do \
                   (echo PLANTED > $f) 2>/dev/null && echo wrote $f; \
                   (echo PLANTED >> $f) 2>/dev/null && echo appended $f; \
                   truncate -s 9 $f 2>/dev/null && echo truncated $f; \
                   chmod 666 $f 2>/dev/null && echo chmodded $f; \
                   mount -o remount,rw,bind $f 2>/dev/null && echo remounted $f; \
                   umount $f 2>/dev/null && echo unmounted $f; \
                 done; cat /etc/shadow; true";
    let r = env.sh(tries);
    assert_eq!(r.stdout(), "", "a masked file gave way: {}", r.stdout());
    let shared = env.state().join("runs/.empty");
    let md = std::fs::metadata(&shared).unwrap();
    assert_eq!(md.len(), 0, "{} holds bytes", shared.display());
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&md.permissions()) & 0o777,
        0o444
    );
    // The next run finds the mask as empty as the first did.
    let r = env.sh("wc -c < /etc/shadow");
    assert_eq!(r.stdout().trim(), "0", "{}", r.stdout());
}

#[test]
fn home_is_hidden_except_toolchains_and_credential_stores_stay_hidden() {
    let env = Env::new();
    let home = env.home();
    std::fs::create_dir_all(home.join(".ssh")).unwrap();
    std::fs::write(home.join(".ssh/id_ed25519"), "PRIVATE KEY").unwrap();
    std::fs::create_dir_all(home.join(".aws")).unwrap();
    std::fs::write(home.join(".aws/credentials"), "AWSSECRET").unwrap();
    std::fs::write(home.join(".netrc"), "machine x password NETRCSECRET").unwrap();
    std::fs::write(home.join(".git-credentials"), "https://u:GITSECRET@x").unwrap();
    std::fs::write(home.join("notes.txt"), "PERSONAL").unwrap();
    std::fs::create_dir_all(home.join(".cargo/bin")).unwrap();
    std::fs::write(home.join(".cargo/bin/tool"), "TOOLCHAIN").unwrap();
    std::fs::write(home.join(".cargo/credentials.toml"), "CARGOTOKEN").unwrap();
    let script = "cat ~/.ssh/id_ed25519 ~/.aws/credentials ~/.netrc ~/.git-credentials \
                  ~/notes.txt ~/.cargo/credentials.toml ~/.cargo/bin/tool 2>/dev/null; true";
    let r = env.sh(script);
    let out = r.stdout();
    assert!(out.contains("TOOLCHAIN"), "toolchain dir hidden: {out}");
    for secret in [
        "PRIVATE KEY",
        "AWSSECRET",
        "NETRCSECRET",
        "GITSECRET",
        "PERSONAL",
        "CARGOTOKEN",
    ] {
        assert!(
            !out.contains(secret),
            "{secret} readable with the default policy"
        );
    }
    // A policy that opens the home directory still hides the credential stores.
    let policy = env.policy("open-home", "[filesystem]\nhome = \"read-only\"\n");
    let r = env.sh_with(&["--policy", policy.to_str().unwrap()], script);
    let out = r.stdout();
    assert!(
        out.contains("PERSONAL"),
        "read-only home not visible: {out}"
    );
    for secret in [
        "PRIVATE KEY",
        "AWSSECRET",
        "NETRCSECRET",
        "GITSECRET",
        "CARGOTOKEN",
    ] {
        assert!(
            !out.contains(secret),
            "{secret} readable with home = read-only"
        );
    }
}

#[test]
fn setuid_binaries_grant_nothing() {
    let env = Env::new();
    let suid = "/usr/local/lib/taskbox-test/suid-cat";
    if is_root() && !std::path::Path::new(suid).exists() {
        std::fs::create_dir_all("/usr/local/lib/taskbox-test").unwrap();
        std::fs::copy("/bin/cat", suid).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(suid, std::fs::Permissions::from_mode(0o4755)).unwrap();
    }
    if !require(
        std::path::Path::new(suid).exists(),
        "no setuid-root test binary (scripts/test.sh creates /usr/local/lib/taskbox-test/suid-cat)",
    ) {
        return;
    }
    let r = env.sh(&format!("{suid} /proc/self/status"));
    r.ok();
    let status = r.stdout();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_default()
            .to_string()
    };
    assert!(field("CapEff:").ends_with("0000000000000000"), "{status}");
    assert!(field("CapPrm:").ends_with("0000000000000000"), "{status}");
    assert!(field("NoNewPrivs:").ends_with('1'), "{status}");
    if !is_root() {
        // The effective uid stays the caller's.
        let uid = field("Uid:");
        assert!(
            !uid.split_whitespace().nth(2).unwrap_or("0").eq("0"),
            "{uid}"
        );
    }
}

/// Every entry under `dir` (not following links) with its mode and owner, as `lstat` gives them.
fn tree_modes(dir: &std::path::Path) -> Vec<(std::path::PathBuf, u32, u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            if m.is_dir() {
                stack.push(e.path());
            }
            out.push((e.path(), m.mode(), m.uid(), m.gid()));
        }
    }
    out.sort();
    out
}

#[test]
fn write_through_leaves_no_setuid_or_setgid_file_on_the_host() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    // The owner's own setuid file, already there: it keeps its bit, its copies get none.
    let own = env.ws().join("own-setuid");
    std::fs::copy("/bin/sh", &own).unwrap();
    std::fs::set_permissions(&own, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let script = format!(
        "cp /bin/sh x; chmod 4755 x; chmod u+s x; chmod g+s x; chmod 6777 x
         install -m 4755 /bin/sh installed
         {PYTHON} -c 'import os; os.close(os.open(\"py-open\", os.O_CREAT | os.O_WRONLY, 0o4755))'
         {PYTHON} -c 'import os; os.close(os.open(\"py-open-sgid\", os.O_CREAT | os.O_WRONLY, 0o2755))'
         {PYTHON} -c 'import os; os.mknod(\"py-mknod\", 0o104755)'
         {PYTHON} -c 'import os; os.mkdir(\"py-dir\", 0o2755)'
         mkdir -m 2755 sgid-dir
         cp -p own-setuid copied
         tar -cf /tmp/t.tar own-setuid && mkdir untarred && tar -xpf /tmp/t.tar -C untarred
         ls -l; true"
    );
    let r = env.sh_with(&["--write-through"], &script);
    r.ok();
    // The command ran: what it chmod'ed is there without those bits; what it asked to create
    // with them (open, mknod, mkdir with the mode, tar's extraction) was refused.
    for name in ["x", "installed", "copied", "untarred"] {
        assert!(
            env.ws().join(name).exists(),
            "{name} missing: {}",
            r.stdout()
        );
    }
    let leaks: Vec<_> = tree_modes(&env.ws())
        .into_iter()
        .filter(|(p, mode, _, _)| mode & 0o6000 != 0 && *p != own)
        .collect();
    assert!(
        leaks.is_empty(),
        "setuid or setgid files on the host: {leaks:?}"
    );
    assert!(
        r.stderr().contains("Operation not permitted"),
        "{}",
        r.stderr()
    );
    let mode = std::fs::metadata(&own).unwrap().permissions().mode();
    assert_eq!(mode & 0o7777, 0o4755, "the owner's own file changed");
    // Each refusal is reported: the chmods, install's, python's open and mknod and mkdir, mkdir
    // -m, cp -p and tar -xp (at least one call each; tools retry or fall back).
    let violations = r.json["violations"].as_array().cloned().unwrap_or_default();
    let setid: Vec<_> = violations
        .iter()
        .filter(|v| {
            v["detail"]
                .as_str()
                .unwrap_or("")
                .contains("setuid or setgid mode")
        })
        .collect();
    assert_eq!(setid.len(), 1, "{violations:#?}");
    assert_eq!(setid[0]["kind"], "filesystem");
    let detail = setid[0]["detail"].as_str().unwrap();
    let count: u32 = detail
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(count >= 12, "{detail}");
    for call in ["chmod", "mknod", "mkdir"] {
        assert!(detail.contains(call), "{call} not named: {detail}");
    }
    // Without setid bits asked for, nothing is reported.
    let clean = env.sh_with(&["--write-through"], "chmod 755 x; mkdir -p d; touch d/f");
    clean.ok();
    assert_eq!(
        clean.json["violations"],
        serde_json::json!([]),
        "{:?}",
        clean.json
    );
}

#[test]
fn write_through_leaves_files_owned_by_the_workspaces_owner() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let env = Env::new();
    env.write("mine.txt", "mine\n");
    std::fs::set_permissions(
        env.ws().join("mine.txt"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    // As root, the workspace belongs to an unprivileged user (and one file to root); rootless,
    // to the caller, who cannot give it away.
    let owner = if is_root() {
        let owner = (54321, 54321);
        for (p, _, _, _) in tree_modes(&env.ws()) {
            std::os::unix::fs::lchown(&p, Some(owner.0), Some(owner.1)).unwrap();
        }
        std::os::unix::fs::lchown(env.ws(), Some(owner.0), Some(owner.1)).unwrap();
        env.write("roots.txt", "root\n");
        owner
    } else {
        let m = std::fs::metadata(env.ws()).unwrap();
        (m.uid(), m.gid())
    };
    let r = env.sh_with(
        &["--write-through"],
        "echo new > new.txt; mkdir -p d/e; touch d/e/f; ln -s new.txt link; \
         mv new.txt moved.txt; cp /bin/true d/tool; cat mine.txt; echo more >> mine.txt; \
         (echo x >> roots.txt) 2>/dev/null; true",
    );
    r.ok();
    for (p, _, uid, gid) in tree_modes(&env.ws()) {
        if is_root() && p == env.ws().join("roots.txt") {
            // Root's own file keeps its owner, and the command could not write it.
            assert_eq!((uid, gid), (0, 0));
            assert_eq!(std::fs::read_to_string(&p).unwrap(), "root\n");
            continue;
        }
        assert_eq!((uid, gid), owner, "{} is owned by {uid}:{gid}", p.display());
    }
    assert!(env.ws().join("d/e/f").exists() && env.ws().join("moved.txt").exists());
    // The owner's rights hold: its private file is readable and writable.
    assert_eq!(r.stdout(), "mine\n", "{}", r.stderr());
    assert_eq!(
        std::fs::read_to_string(env.ws().join("mine.txt")).unwrap(),
        "mine\nmore\n"
    );
}

fn limits_policy(env: &Env, memory: &str, pids: u64) -> String {
    env.policy(
        "limits",
        &format!("[limits]\nmemory = \"{memory}\"\npids = {pids}\ntimeout = \"20s\"\n"),
    )
    .to_str()
    .unwrap()
    .to_string()
}

#[test]
fn a_sandboxed_process_cannot_read_the_supervisors_pipes_or_fds() {
    let env = Env::new();
    let r = env.sh("ls /proc/self/fd | wc -l");
    r.ok();
    let n: u32 = r.stdout().trim().parse().unwrap();
    // 0, 1, 2 and the directory ls is reading.
    assert!(n <= 4, "{n} descriptors leaked into the sandbox");
}

// The escapes every backend must refuse, tried on each (native host view, native with an
// image root, docker). The ones above are about the host view itself.
taskbox_tests::backend_suite! {
    fn writes_outside_the_workspace_and_tmp_are_refused(env: Env) {
        for target in [
            "/etc/taskbox-escape",
            "/usr/taskbox-escape",
            "/taskbox-escape",
        ] {
            let r = env.sh(&format!("echo x > {target}"));
            assert_ne!(r.exit_code(), Some(0), "wrote {target}: {:#}", r.json);
            assert!(
                !std::path::Path::new(target).exists(),
                "{target} reached the host"
            );
        }
        // Beside the workspace lies the sandbox's private /tmp (the scratch dir is under /tmp):
        // a write there may succeed, but must not reach the host.
        let parent = env.dir.path().join("escape.txt");
        let _ = env.sh(&format!("echo x > {}", parent.display()));
        assert!(
            !parent.exists(),
            "a write beside the workspace reached the host"
        );
        // /tmp is writable but private.
        let r = env.sh("echo x > /tmp/taskbox-private && cat /tmp/taskbox-private");
        r.ok();
        assert!(!std::path::Path::new("/tmp/taskbox-private").exists());
    }
    fn the_host_workspace_cannot_be_modified_without_write_through(env: Env) {
        env.write("src/main.rs", "fn main() {}\n");
        let r = env.sh("echo hacked > src/main.rs; rm -rf src; echo new > x; ls");
        r.ok();
        assert_eq!(
            std::fs::read_to_string(env.ws().join("src/main.rs")).unwrap(),
            "fn main() {}\n"
        );
        assert!(!env.ws().join("x").exists());
    }
    fn git_hooks_and_config_are_read_only(env: Env) {
        env.write(".git/hooks/README", "hooks\n");
        env.write(".git/config", "[core]\n");
        let r = env.sh("echo evil > .git/hooks/pre-commit");
        assert_ne!(r.exit_code(), Some(0), "{:#}", r.json);
        let r = env.sh("echo '[core] hooksPath=/tmp' >> .git/config");
        assert_ne!(r.exit_code(), Some(0), "{:#}", r.json);
        let r = env.sh("echo ok > .git/description && cat .git/description");
        r.ok();
    }
    fn network_to_the_hosts_loopback_is_unreachable(env: Env) {
        let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
        tcp.set_nonblocking(true).unwrap();
        let port = tcp.local_addr().unwrap().port();
        let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
        udp.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let uport = udp.local_addr().unwrap().port();
        let tcp6 = TcpListener::bind("[::1]:0").ok();
        let port6 = tcp6.as_ref().map(|l| l.local_addr().unwrap().port());
        let code = format!(
            r#"
import socket
def tcp(fam, addr):
    s = socket.socket(fam, socket.SOCK_STREAM); s.settimeout(2)
    try:
        s.connect(addr); print("CONNECTED", addr)
    except OSError as e: print("refused", addr, e.errno)
tcp(socket.AF_INET, ("127.0.0.1", {port}))
if {port6} > 0: tcp(socket.AF_INET6, ("::1", {port6}))
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try: u.sendto(b"escape", ("127.0.0.1", {uport})); print("udp sent locally")
except OSError as e: print("udp refused", e.errno)
try:
    r = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); print("RAW OPENED")
except OSError as e: print("raw refused", e.errno)
try:
    socket.getaddrinfo("example.com", 443); print("DNS RESOLVED")
except OSError as e: print("dns failed", e)
try:
    d = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); d.settimeout(1)
    d.sendto(b"\x00"*12, ("8.8.8.8", 53)); d.recv(512); print("DNS ANSWERED")
except OSError as e: print("dns udp failed", e)
"#,
            port6 = port6.unwrap_or(0)
        );
        let out = py(&env, &code);
        assert!(!out.contains("CONNECTED"), "{out}");
        assert!(!out.contains("RAW OPENED"), "{out}");
        assert!(!out.contains("DNS RESOLVED"), "{out}");
        assert!(!out.contains("DNS ANSWERED"), "{out}");
        assert!(out.contains("refused ('127.0.0.1'"), "{out}");
        assert!(
            tcp.accept().is_err(),
            "the host listener accepted a connection"
        );
        let mut buf = [0u8; 16];
        assert!(
            udp.recv_from(&mut buf).is_err(),
            "a datagram reached the host"
        );
    }
    fn host_processes_are_invisible_and_unsignalable(env: Env) {
        let mut victim = std::process::Command::new("sleep")
            .arg("300")
            .spawn()
            .unwrap();
        let pid = victim.id();
        let r = env.sh(&format!(
            "ls /proc | grep -c '^[0-9]' ; kill -9 {pid} 2>&1; test -e /proc/{pid} && echo VISIBLE; true"
        ));
        let out = r.stdout();
        let visible: u32 = out
            .lines()
            .next()
            .unwrap_or("999")
            .trim()
            .parse()
            .unwrap_or(999);
        assert!(visible < 10, "the sandbox sees {visible} processes");
        assert!(!out.contains("VISIBLE"), "{out}");
        let code = format!(
            r#"
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
rc = libc.ptrace(16, {pid}, 0, 0)  # PTRACE_ATTACH
print("ptrace", rc, ctypes.get_errno())
rc = libc.syscall(310, {pid}, 0, 1, 0, 1, 0)  # process_vm_readv
print("vm_readv", rc)
"#
        );
        let out = py(&env, &code);
        assert!(out.contains("ptrace -1"), "{out}");
        assert!(out.contains("vm_readv -1"), "{out}");
        assert!(
            victim.try_wait().unwrap().is_none(),
            "the host process was killed"
        );
        victim.kill().unwrap();
        victim.wait().unwrap();
    }
    fn mount_unshare_io_uring_keyctl_and_bpf_are_refused(env: Env) {
        let code = r#"
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def sc(name, nr, *args):
    rc = libc.syscall(nr, *args)
    print(name, rc, ctypes.get_errno())
sc("mount", 165, b"none", b"/tmp", b"tmpfs", 0, 0)
sc("unshare_user", 272, 0x10000000)
sc("unshare_ns", 272, 0x00020000)
sc("io_uring_setup", 425, 8, ctypes.create_string_buffer(256))
sc("keyctl", 250, 0, 0, 0, 0, 0)
sc("add_key", 248, b"user", b"x", b"y", 1, -4)
sc("bpf", 321, 0, 0, 0)
sc("perf_event_open", 298, 0, 0, -1, -1, 0)
sc("userfaultfd", 323, 0)
sc("pivot_root", 155, b"/tmp", b"/tmp")
sc("fsopen", 430, b"tmpfs", 0)
sc("open_tree", 428, -100, b"/", 0)
sc("clone_newuser", 56, 0x10000000 | 17, 0, 0, 0, 0)
"#;
        let out = py(&env, code);
        for line in out.lines().filter(|l| !l.is_empty()) {
            let parts: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(parts.len(), 3, "unexpected line {line:?} in {out}");
            assert_eq!(parts[1], "-1", "{} was not refused: {out}", parts[0]);
        }
        assert_eq!(out.lines().filter(|l| !l.is_empty()).count(), 13, "{out}");
        let r = env.sh("unshare -U true 2>&1 && echo UNSHARED; mount -t tmpfs none /tmp 2>&1 && echo MOUNTED; true");
        assert!(!r.stdout().contains("UNSHARED"), "{}", r.stdout());
        assert!(!r.stdout().contains("MOUNTED"), "{}", r.stdout());
    }
    fn tiocsti_is_refused_also_with_high_bits_set(env: Env) {
        let code = r#"
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
c = ctypes.c_char(b"x")
for name, req in (("plain", 0x5412), ("high", 0x5412 | (1 << 32)), ("linux", 0x541C)):
    rc = libc.syscall(16, 0, ctypes.c_ulong(req), ctypes.byref(c))
    print(name, rc, ctypes.get_errno())
"#;
        let out = py(&env, code);
        for name in ["plain", "high", "linux"] {
            // EPERM (1) from seccomp, not ENOTTY (25) from the kernel: the filter saw the request.
            assert!(out.contains(&format!("{name} -1 1\n")), "{name}: {out}");
        }
    }
    fn fork_bomb_is_held_by_the_pids_limit(env: Env) {
        let policy = limits_policy(&env, "1GiB", 64);
        let marker = format!("forkbomb{}", std::process::id());
        let r = env.run_json(
            &["--policy", &policy, "--timeout", "5s"],
            &[
                "/bin/bash",
                "-c",
                &format!("exec -a {marker} bash -c 'b(){{ b | b & }}; b; sleep 3; echo survived'"),
            ],
        );
        // Held: the host is fine, the run ended on its own terms, nothing is left behind.
        assert!(
            r.exit_code().is_some() || r.json["timed_out"] == true,
            "{:#}",
            r.json
        );
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            taskbox_tests::host_processes_with(&marker).is_empty(),
            "fork bomb processes survived"
        );
        let stderr = r.stderr();
        assert!(
            stderr.contains("fork") || stderr.contains("Resource temporarily unavailable"),
            "the limit never bit: {stderr}"
        );
    }
    fn memory_bomb_is_held_and_reported(env: Env) {
        let policy = limits_policy(&env, "256MiB", 256);
        let r = env.run_json(
            &["--policy", &policy],
            &[
                PYTHON,
                "-c",
                "x = []\nwhile True: x.append(bytearray(16 << 20))",
            ],
        );
        assert_ne!(r.exit_code(), Some(0), "{:#}", r.json);
        let limits = r.json["enforcement"]["limits"].as_str().unwrap();
        if limits.starts_with("cgroup") {
            assert_eq!(r.json["resources"]["oom_killed"], true, "{:#}", r.json);
            assert_eq!(r.json["signal"], 9);
            let v = r.json["violations"].as_array().unwrap();
            assert!(v.iter().any(|v| v["kind"] == "limit"), "{v:?}");
            let peak = r.json["resources"]["max_rss_bytes"].as_u64().unwrap();
            assert!(peak <= 300 << 20, "peak {peak}");
        } else {
            // The address-space rlimit: the allocation fails inside the command.
            assert!(r.stderr().contains("MemoryError"), "{:#}", r.json);
        }
    }
    fn a_setuid_file_the_sandbox_makes_is_out_of_other_users_reach(env: Env) {
        // A state directory others may enter, as /var/lib/taskbox and home directories often
        // are: the directories below it that hold layers must not be.
        use std::os::unix::fs::PermissionsExt;
        for d in [env.dir.path().to_path_buf(), env.state()] {
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        std::fs::copy("/bin/cat", env.ws().join("payload")).unwrap();
        let state = env.state();
        // While the sandbox lives: find its setuid file on the host, check that the way to it
        // is closed to others, and (as root) try to run it as another user.
        let watcher = std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while std::time::Instant::now() < deadline {
                if let Some(found) = find_setuid(&state, "made-setuid") {
                    return Some(another_user_tries(&state, &found));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            None
        });
        let r = env.sh("cp payload made-setuid && chmod 4755 made-setuid && ls -ln made-setuid && sleep 6");
        let verdict = watcher.join().unwrap();
        r.ok();
        assert!(r.stdout().starts_with("-rws"), "{}", r.stdout());
        if env.backend != Backend::Docker {
            // The native backend's layers live on the sandbox's disk, mounted only in its own
            // namespace: no host path leads to them at all.
            assert_eq!(
                verdict.map(|(path, ..)| path),
                None,
                "the sandbox's setuid file is reachable on the host"
            );
            return;
        }
        let (path, closed, run) =
            verdict.expect("the sandbox's setuid file was not found in its layer under the state directory");
        assert!(closed, "every directory on the way to {} lets others through", path.display());
        if let Some(status) = run {
            let euid = status
                .lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(str::to_owned));
            assert!(
                euid.is_none() || euid.as_deref() == Some("65534"),
                "another user ran the sandbox's setuid file with its owner's ids:\n{status}"
            );
        }
    }
    fn no_host_daemon_socket_is_reachable(env: Env) {
        let r = env.sh(
            "for s in /run/docker.sock /var/run/docker.sock /run/dbus/system_bus_socket /var/run/dbus/system_bus_socket; do \
             test -S $s && echo SOCKET $s; done; ls /run | wc -l; true",
        );
        r.ok();
        assert!(!r.stdout().contains("SOCKET"), "{}", r.stdout());
        let mut leftover = String::new();
        let _ =
            std::fs::File::open("/proc/self/status").and_then(|mut f| f.read_to_string(&mut leftover));
    }
}

/// The first regular file called `name` with the setuid bit under `dir`.
fn find_setuid(dir: &std::path::Path, name: &str) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(meta) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            if meta.is_dir() {
                stack.push(e.path());
            } else if meta.is_file()
                && e.file_name() == name
                && meta.permissions().mode() & 0o4000 != 0
            {
                return Some(e.path());
            }
        }
    }
    None
}

/// For a file under `state`: whether a directory between them is closed to others (no search
/// permission for them), and, as root, what the file printed of `/proc/self/status` when user
/// `nobody` (65534) ran it (`None` when not root).
fn another_user_tries(
    state: &std::path::Path,
    file: &std::path::Path,
) -> (std::path::PathBuf, bool, Option<String>) {
    use std::os::unix::fs::PermissionsExt;
    let closed = file
        .ancestors()
        .skip(1)
        .take_while(|a| *a != state)
        .any(|a| std::fs::metadata(a).is_ok_and(|m| m.permissions().mode() & 0o001 == 0));
    let run = is_root().then(|| {
        let out = std::process::Command::new("runuser")
            .args(["-u", "nobody", "--"])
            .arg(file)
            .arg("/proc/self/status")
            .output()
            .expect("spawn runuser");
        String::from_utf8_lossy(&out.stdout).into_owned()
    });
    (file.to_path_buf(), closed, run)
}

/// Finds every Unix socket the sandbox can see (all of its file system but /proc and /sys),
/// tries to connect to each with every socket type, and lists `dirs`. Prints JSON.
const SOCKET_PROBE: &str = r#"
import json, os, socket, stat, subprocess, sys
# find takes the type from the directory entry; a mask mounted on the name is seen by lstat.
listed = subprocess.run(
    ["find", "/", "(", "-path", "/proc", "-o", "-path", "/sys", ")", "-prune", "-o", "-type", "s", "-print"],
    capture_output=True, text=True).stdout.split()
found = [p for p in listed if stat.S_ISSOCK(os.lstat(p).st_mode)]
connected = []
for p in found:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET):
        s = socket.socket(socket.AF_UNIX, kind)
        s.settimeout(2)
        try:
            s.connect(p)
            connected.append(p)
            break
        except OSError:
            pass
        finally:
            s.close()
listing = {}
for d in sys.argv[1:]:
    try:
        listing[d] = sorted(os.listdir(d))
    except OSError as e:
        listing[d] = "error: " + e.strerror
print(json.dumps({"found": found, "connected": connected, "listing": listing}))
"#;

/// The supervisor and every other host socket are out of a sandbox's reach: a command in a
/// default sandbox (one-shot and long-lived) finds every Unix socket it can see and connects
/// to each, and lists the supervisor's state directory. Before the masks, a sandbox of a root
/// supervisor whose state lay outside /tmp saw `taskbox.sock` there, connected, and created a
/// sandbox over the host's /etc; it also saw every trace and spill file.
#[test]
fn no_host_socket_and_no_supervisor_state_is_in_reach() {
    let env = Env::new();
    // As root: a state directory outside /tmp (as /var/lib/taskbox is) and a host service's
    // socket in another directory the host view shows. Unprivileged, the places a user can
    // write are all hidden from the sandbox anyway (home, /tmp): the state stays in the test's
    // directory and the stray socket goes in the workspace, which the sandbox does see.
    let scratch = if is_root() {
        let d = std::path::PathBuf::from(format!(
            "/var/lib/taskbox-escape-test-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&d).unwrap();
        Some(d)
    } else {
        None
    };
    struct Cleanup(Option<std::path::PathBuf>);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            if let Some(d) = &self.0 {
                let _ = std::fs::remove_dir_all(d);
            }
        }
    }
    let _cleanup = Cleanup(scratch.clone());
    let state = scratch
        .as_ref()
        .map_or_else(|| env.state(), |d| d.join("state"));
    let stray_dir = scratch
        .as_ref()
        .map_or_else(|| env.ws().join("svc"), |d| d.join("svc"));
    std::fs::create_dir_all(&stray_dir).unwrap();
    let stray = stray_dir.join("service.sock");
    let _service = std::os::unix::net::UnixListener::bind(&stray).unwrap();
    let in_ws = env.ws().join("dev.sock");
    let _dev = std::os::unix::net::UnixListener::bind(&in_ws).unwrap();

    let socket = state.join("taskbox.sock");
    std::fs::create_dir_all(&state).unwrap();
    let mut sup = std::process::Command::new(taskbox_tests::taskbox())
        .args(["serve", "--socket"])
        .arg(&socket)
        .arg("--state-dir")
        .arg(&state)
        .env("HOME", env.home())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Stopped as a service manager stops it (SIGTERM: it destroys its sandboxes, cgroups and
    // all), then killed if it is still there: a SIGKILL alone left the sandbox's cgroups on the
    // host, with no later supervisor of this state directory to sweep them.
    struct Stop<'a>(&'a mut std::process::Child);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            taskbox_tests::stop_gently(self.0, Duration::from_secs(10));
        }
    }
    let _stop = Stop(&mut sup);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the supervisor did not come up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let state_s = state.to_str().unwrap();
    let check = |out: &str, how: &str| {
        let v = no_socket_reached(out, how, &[&socket, &stray, &in_ws]);
        let listing = &v["listing"][state_s];
        assert!(
            listing.as_array().is_some_and(|l| l.is_empty()) || listing.is_string(),
            "{how}: the state directory shows {listing}"
        );
    };

    // A one-shot run with the supervisor's state directory.
    let out = env
        .command()
        .env("TASKBOX_STATE_DIR", &state)
        .args(["run", "--", PYTHON, "-c", SOCKET_PROBE, state_s])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    check(&String::from_utf8_lossy(&out.stdout), "taskbox run");

    // A sandbox of the supervisor itself.
    let (status, info) = taskbox_tests::http::call(
        &socket,
        "POST",
        "/v1/sandboxes",
        Some(&serde_json::json!({"workspace": env.ws()})),
    );
    assert_eq!(status, 201, "{info}");
    let id = info["id"].as_str().unwrap();
    let (status, r) = taskbox_tests::http::call(
        &socket,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(
            &serde_json::json!({"argv": [PYTHON, "-c", SOCKET_PROBE, state_s], "timeout_ms": 120000}),
        ),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["exit_code"], 0, "{r}");
    check(
        r["stdout"]["text"].as_str().unwrap(),
        "a supervisor's sandbox",
    );
}

/// With an image as the root (native or Docker), the host's sockets are out of sight except
/// where a host service binds one in the workspace itself: that one is masked too.
#[test]
fn a_host_socket_in_the_workspace_is_masked_with_an_image_root() {
    for backend in [
        taskbox_tests::Backend::NativeImage,
        taskbox_tests::Backend::Docker,
    ] {
        let Some(env) = Env::for_backend(backend) else {
            continue;
        };
        let _dev = std::os::unix::net::UnixListener::bind(env.ws().join("dev.sock")).unwrap();
        std::fs::create_dir_all(env.ws().join("svc")).unwrap();
        let _svc =
            std::os::unix::net::UnixListener::bind(env.ws().join("svc/service.sock")).unwrap();
        let r = env.run_json(&[], &["python3", "-c", SOCKET_PROBE, "/"]);
        assert_eq!(r.exit_code(), Some(0), "{backend:?}: {:#}", r.json);
        let inside = env.inside_ws();
        let (dev, svc) = (inside.join("dev.sock"), inside.join("svc/service.sock"));
        no_socket_reached(r.stdout(), &format!("{backend:?}"), &[&dev, &svc]);
    }
}

/// Reads [`SOCKET_PROBE`]'s answer: nothing it connected to, none of `hidden` seen as a
/// socket. Returns the answer.
fn no_socket_reached(out: &str, how: &str, hidden: &[&std::path::Path]) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_str(out.trim())
        .unwrap_or_else(|e| panic!("{how}: probe said {out:?}: {e}"));
    let connected = v["connected"].as_array().unwrap();
    assert!(connected.is_empty(), "{how}: connected to {connected:?}");
    let found: Vec<&str> = v["found"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p.as_str())
        .collect();
    for p in hidden {
        assert!(
            !found.contains(&p.to_str().unwrap()),
            "{how}: {} is visible as a socket",
            p.display()
        );
    }
    v
}
