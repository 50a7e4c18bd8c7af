//! The archive for Docker: the real `docker load` takes it, and Docker's image ID is the config
//! digest.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::fs;
use std::process::Command;

use common::*;
use taskbox_core::image::ImageResolver;

fn docker(args: &[&str]) -> std::process::Output {
    Command::new("docker")
        .args(args)
        .output()
        .expect("run docker")
}

#[test]
fn docker_load_gives_the_config_digest_as_image_id() {
    if !have_busybox() {
        return;
    }
    let up = Command::new("docker")
        .args(["version", "--format", "{{.Server.Version}}"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !require(
        up,
        "the Docker daemon is not reachable (docker version failed)",
    ) {
        return;
    }
    let t = tempdir();
    let s = store(t.path(), "state");
    let built = build(&s, &images_dir().join("busybox.toml"));
    let archive = t.path().join("busybox.tar");
    let mut f = fs::File::create(&archive).unwrap();
    s.docker_archive(&built.digest, &mut f).unwrap();
    drop(f);

    let out = docker(&["load", "--input", archive.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "docker load failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tag = stdout
        .lines()
        .find_map(|l| l.strip_prefix("Loaded image: "))
        .expect("docker load names the tag")
        .trim()
        .to_owned();
    assert!(tag.starts_with("taskbox/busybox:"), "{tag}");
    let inspect = docker(&[
        "image",
        "inspect",
        "--format",
        "{{.Id}} {{.Config.User}} {{.Config.WorkingDir}}",
        &tag,
    ]);
    let info = String::from_utf8_lossy(&inspect.stdout).trim().to_owned();
    assert_eq!(
        info,
        format!("{} 1000:1000 /workspace", built.config_digest),
        "Docker's image ID must be the config digest"
    );

    // The image runs: busybox as the image's non-root user, with its passwd.
    let run = docker(&[
        "run",
        "--rm",
        "--network",
        "none",
        &built.config_digest,
        "/bin/sh",
        "-c",
        "id -u; id -un; ls /bin/sh && cat /etc/group | grep -c user",
    ]);
    let text = String::from_utf8_lossy(&run.stdout).into_owned();
    let _ = docker(&["rmi", "--force", &tag]);
    assert!(
        run.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(text, "1000\nuser\n/bin/sh\n1\n");
}
