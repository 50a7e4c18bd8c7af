//! Builds the in-container init/exec wrapper (src/wrap.rs) and the test probe (src/probe.rs) as
//! static, stripped executables with rustc alone (they are std-only), for `include_bytes!`.

use std::path::Path;
use std::process::Command;

fn main() {
    let out = std::env::var("OUT_DIR").unwrap_or_else(|_| ".".into());
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    for name in ["wrap", "probe"] {
        let src = format!("src/{name}.rs");
        println!("cargo:rerun-if-changed={src}");
        let dst = Path::new(&out).join(format!("taskbox-{name}"));
        let status = Command::new(&rustc)
            .args([
                "--edition",
                "2024",
                "-O",
                "-C",
                "target-feature=+crt-static",
            ])
            .args(["-C", "strip=symbols", "-C", "panic=abort", "--crate-name"])
            .arg(format!("taskbox_{name}"))
            .arg("-o")
            .arg(&dst)
            .arg(&src)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("rustc failed to build {src} ({s})"),
            Err(e) => panic!("cannot run {rustc}: {e}"),
        }
    }
}
