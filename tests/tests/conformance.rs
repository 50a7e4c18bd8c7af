//! Conformance of `taskbox run`, one suite on every backend (`backend_suite!`): exit codes,
//! signals, timeouts, output capture, stdin, environment, working directory, changes and diffs.
//! The native variant also runs as an unprivileged user (scripts/test.sh runs it both ways).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::io::Write;
use std::process::Stdio;
use std::time::{Duration, Instant};

use taskbox_tests::{Backend, Env, Run, host_processes_with, is_root};

#[test]
fn write_through_changes_the_host_workspace() {
    let env = Env::new();
    env.write("a.txt", "old\n");
    let r = env.sh_with(&["--write-through"], "echo new > a.txt");
    r.ok();
    assert_eq!(
        std::fs::read_to_string(env.ws().join("a.txt")).unwrap(),
        "new\n"
    );
}

fn huge_output_is_bounded(env: Env) {
    // 1 GiB of numbered lines; the last line is known.
    let gib: u64 = 1 << 30;
    let script = format!(
        "{py} -c \"import sys\nw=sys.stdout.buffer.write\nline=b'x'*1023+b'\\n'\nfor i in range({n}): w(line)\n\" ; echo END",
        py = taskbox_tests::PYTHON,
        n = gib / 1024
    );
    let mut cmd = env.run_command();
    cmd.arg("--json")
        .arg("--")
        .arg("/bin/sh")
        .arg("-c")
        .arg(&script)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = cmd.spawn().unwrap();
    let pid = child.id() as i32;
    // Collect taskbox's own peak RSS from wait4 before std reaps it.
    let mut status = 0;
    // SAFETY: rusage is plain old data; all-zero is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let out_handle = {
        let mut child = child;
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let t = std::thread::spawn(move || {
            let mut o = Vec::new();
            let mut e = Vec::new();
            let mut stdout = stdout;
            let mut stderr = stderr;
            let h = std::thread::spawn(move || {
                std::io::Read::read_to_end(&mut stderr, &mut e).unwrap();
                e
            });
            std::io::Read::read_to_end(&mut stdout, &mut o).unwrap();
            (o, h.join().unwrap())
        });
        std::mem::forget(child);
        t
    };
    // SAFETY: test code; waits for our own child.
    let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(rc, pid);
    let (stdout, stderr) = out_handle.join().unwrap();
    let r = Run::from_output(std::process::Output {
        status: std::os::unix::process::ExitStatusExt::from_raw(status),
        stdout,
        stderr,
    });
    r.ok();
    let out = &r.json["stdout"];
    assert_eq!(out["bytes"].as_u64().unwrap(), gib + 4);
    assert_eq!(out["truncated"], true);
    let text = out["text"].as_str().unwrap();
    assert!(text.starts_with("xxxxxxxx"), "head: {:?}", &text[..20]);
    assert!(
        text.ends_with("x\nEND\n"),
        "tail: {:?}",
        &text[text.len() - 20..]
    );
    assert!(
        text.len() < 2 * 1024 * 1024 + 200,
        "text is {} bytes",
        text.len()
    );
    let spill = out["spill_path"].as_str().unwrap();
    let md = std::fs::metadata(spill).unwrap();
    assert_eq!(md.len(), gib + 4, "spill file incomplete");
    let mut f = std::fs::File::open(spill).unwrap();
    use std::io::{Read, Seek, SeekFrom};
    f.seek(SeekFrom::End(-8)).unwrap();
    let mut end = [0u8; 8];
    f.read_exact(&mut end).unwrap();
    assert_eq!(&end, b"xxx\nEND\n");
    std::fs::remove_file(spill).unwrap();
    let peak_mib = usage.ru_maxrss as u64 / 1024;
    eprintln!("peak RSS of taskbox run while the command wrote 1 GiB: {peak_mib} MiB");
    assert!(peak_mib < 64, "peak RSS {peak_mib} MiB");
}

#[test]
fn huge_output_is_bounded_in_memory_with_head_tail_and_a_complete_spill_file() {
    huge_output_is_bounded(Env::new());
}

#[test]
fn huge_output_is_bounded_with_an_image_root() {
    if let Some(env) = Env::for_backend(Backend::NativeImage) {
        huge_output_is_bounded(env);
    }
}

// A one-shot Docker run moves the spill file out of its sandbox before the sandbox goes.
#[test]
fn huge_output_is_bounded_on_the_docker_backend() {
    if let Some(env) = Env::for_backend(Backend::Docker) {
        huge_output_is_bounded(env);
    }
}

taskbox_tests::backend_suite! {
    fn exit_codes_are_the_commands_own(env: Env) {
        for code in [0, 1, 3, 42, 255] {
            let r = env.sh(&format!("exit {code}"));
            assert_eq!(r.exit_code(), Some(code), "{:#}", r.json);
            assert_eq!(r.status, code as i32);
            assert_eq!(r.json["signal"], serde_json::Value::Null);
            assert_eq!(r.json["timed_out"], false);
        }
    }
    fn a_signal_gives_128_plus_n_and_a_null_exit_code(env: Env) {
        let r = env.sh("kill -TERM $$");
        assert_eq!(r.json["signal"], 15, "{:#}", r.json);
        assert_eq!(r.json["exit_code"], serde_json::Value::Null);
        assert_eq!(r.status, 128 + 15);
        let r = env.sh("kill -KILL $$");
        assert_eq!(r.json["signal"], 9);
        assert_eq!(r.status, 137);
    }
    fn timeout_kills_the_whole_tree_and_keeps_partial_output(env: Env) {
        let marker = format!("77{}.5", std::process::id());
        let start = Instant::now();
        let r = env.sh_with(
            &["--timeout", "1s"],
            &format!("echo before; echo err-before >&2; sleep {marker} & sleep {marker}; echo never"),
        );
        let took = start.elapsed();
        assert_eq!(r.status, 124, "{:#}", r.json);
        assert_eq!(r.json["timed_out"], true);
        assert_eq!(r.json["exit_code"], serde_json::Value::Null);
        assert_eq!(r.stdout(), "before\n");
        assert_eq!(r.stderr(), "err-before\n");
        assert!(took < Duration::from_secs(10), "took {took:?}");
        let v = r.json["violations"].as_array().unwrap();
        assert!(v.iter().any(|v| v["kind"] == "timeout"), "{v:?}");
        assert!(
            host_processes_with(&marker).is_empty(),
            "a process of the timed-out command survived"
        );
    }
    fn background_process_does_not_outlive_the_command(env: Env) {
        let marker = format!("88{}.25", std::process::id());
        let start = Instant::now();
        let r = env.sh(&format!("sleep {marker} & echo started"));
        r.ok();
        assert_eq!(r.stdout(), "started\n");
        assert!(start.elapsed() < Duration::from_secs(10));
        assert!(
            host_processes_with(&marker).is_empty(),
            "the background process survived the run"
        );
    }
    fn binary_output_is_counted_exactly_and_never_fatal(env: Env) {
        let r = env.sh("printf '\\000\\377\\376abc\\200'");
        r.ok();
        assert_eq!(r.json["stdout"]["bytes"], 7);
        assert!(r.stdout().contains("abc"));
    }
    fn stdout_and_stderr_are_separate(env: Env) {
        let r = env.sh("echo out; echo err >&2; echo out2");
        r.ok();
        assert_eq!(r.stdout(), "out\nout2\n");
        assert_eq!(r.stderr(), "err\n");
        assert_eq!(r.json["stderr"]["bytes"], 4);
    }
    fn stdin_reaches_the_command(env: Env) {
        let mut c = env.run_command();
        c.args([
            "--json",
            "--",
            "/bin/sh",
            "-c",
            "tr a-z A-Z; echo done",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let mut child = c.spawn().unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(b"hello from stdin\n")
            .unwrap();
        let r = Run::from_output(child.wait_with_output().unwrap());
        r.ok();
        assert_eq!(r.stdout(), "HELLO FROM STDIN\ndone\n");
    }
    fn environment_is_reduced_to_the_allowlist_plus_the_policys_and_requests(env: Env) {
        let mut c = env.run_command();
        c.env("TASKBOX_TEST_SECRET", "hunter2")
            .env("AWS_SECRET_ACCESS_KEY", "nope")
            .env("LANG", "C.UTF-8")
            .args(["--json", "--env", "GIVEN=yes", "--", "/usr/bin/env"]);
        let r = Run::from_output(c.output().unwrap());
        r.ok();
        let out = r.stdout();
        assert!(!out.contains("hunter2"), "{out}");
        assert!(!out.contains("AWS_SECRET"), "{out}");
        assert!(out.contains("GIVEN=yes"), "{out}");
        assert!(out.contains("LANG=C.UTF-8"), "{out}");
        assert!(out.contains("PATH="), "{out}");
    }
    fn the_fixed_environment_is_the_same_whatever_the_host_sets(env: Env) {
        // What replays on another host or backend rely on: zone, locale, build time, umask and
        // hostname do not come from the caller.
        let mut c = env.run_command();
        c.env("TZ", "America/New_York")
            .env("LANG", "de_DE.UTF-8")
            .args(["--json", "--", "/bin/sh", "-c"])
            .arg("echo TZ=$TZ LANG=$LANG SDE=$SOURCE_DATE_EPOCH; umask; cat /proc/sys/kernel/hostname");
        let r = Run::from_output(c.output().unwrap());
        r.ok();
        assert_eq!(
            r.stdout(),
            "TZ=UTC LANG=C.UTF-8 SDE=315532800\n0022\ntaskbox\n",
            "{}",
            r.raw_stderr
        );
    }
    fn cwd_defaults_to_the_workspace_and_can_be_set(env: Env) {
        std::fs::create_dir(env.ws().join("sub")).unwrap();
        let ws = env.inside_ws();
        let r = env.sh("pwd");
        r.ok();
        assert_eq!(r.stdout().trim(), ws.to_str().unwrap());
        let r = env.sh_with(&["--cwd", "sub"], "pwd");
        r.ok();
        assert_eq!(r.stdout().trim(), ws.join("sub").to_str().unwrap());
    }
    fn changes_are_reported_and_the_host_workspace_stays_untouched(env: Env) {
        env.write("keep.txt", "same\n");
        env.write("edit.txt", "one\ntwo\nthree\n");
        env.write("gone.txt", "bye\n");
        env.write("dir/inner.txt", "inner\n");
        let r = env.sh_with(
            &["--diff"],
            "echo new > added.txt && sed -i s/two/TWO/ edit.txt && rm gone.txt && rm -r dir && touch keep.txt",
        );
        r.ok();
        let changes: Vec<(String, String)> = r.json["changes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["path"].as_str().unwrap().to_string(),
                    c["kind"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let expect = |p: &str, k: &str| {
            assert!(
                changes.iter().any(|(cp, ck)| cp == p && ck == k),
                "{p} {k} missing from {changes:?}"
            )
        };
        expect("added.txt", "added");
        expect("edit.txt", "modified");
        expect("gone.txt", "deleted");
        expect("dir/inner.txt", "deleted");
        assert!(
            !changes.iter().any(|(p, _)| p == "keep.txt"),
            "an untouched file was reported: {changes:?}"
        );
        let diff = r.json["diff"].as_str().unwrap();
        assert!(diff.contains("-two\n+TWO\n"), "{diff}");
        assert!(diff.contains("+++ b/added.txt"), "{diff}");
        // The host copy is untouched.
        assert_eq!(
            std::fs::read_to_string(env.ws().join("edit.txt")).unwrap(),
            "one\ntwo\nthree\n"
        );
        assert!(env.ws().join("gone.txt").exists());
        assert!(env.ws().join("dir/inner.txt").exists());
        assert!(!env.ws().join("added.txt").exists());
    }
    fn diff_flag_prints_the_unified_diff_in_text_mode(env: Env) {
        env.write("a.txt", "alpha\n");
        let out = env
            .run_command()
            .args(["--diff", "--", "/bin/sh", "-c", "echo beta >> a.txt"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("--- a/a.txt"), "{text}");
        assert!(text.contains("+beta"), "{text}");
    }
    fn enforcement_is_reported(env: Env) {
        let r = env.sh("true");
        r.ok();
        let e = &r.json["enforcement"];
        // Containers are confined by namespaces, seccomp and the read-only root; taskbox applies
        // no Landlock ruleset inside them, and says so.
        let landlock = if env.backend == Backend::Docker { "none" } else { "full" };
        assert_eq!(e["landlock"], landlock, "{e}");
        assert_eq!(e["seccomp"], true);
        assert_eq!(e["network"], "none");
        let limits = e["limits"].as_str().unwrap();
        if is_root() {
            assert!(limits.starts_with("cgroup-"), "{limits}");
        } else {
            assert!(
                ["rlimit", "cgroup-v1", "cgroup-v2"].contains(&limits),
                "{limits}"
            );
        }
        assert!(r.json["resources"]["cpu_ms"].is_u64());
        assert!(r.json["duration_ms"].is_u64());
    }
    fn text_mode_streams_output_and_passes_the_exit_code(env: Env) {
        let out = env
            .run_command()
            .args([
                "--",
                "/bin/sh",
                "-c",
                "echo visible; echo warn >&2; exit 7",
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(7));
        assert_eq!(String::from_utf8_lossy(&out.stdout), "visible\n");
        assert!(String::from_utf8_lossy(&out.stderr).contains("warn"));
    }
}
