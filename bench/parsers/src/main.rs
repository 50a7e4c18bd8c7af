//! Ours against the libraries: taskbox's shell reader against tree-sitter-bash, and its
//! unified-diff parser against diffy, gitpatch and unidiff, on our own test inputs, tricky and
//! hostile cases: agreement case by case, failures, speed, and binary size.
//!
//! `cargo run --release --manifest-path bench/parsers/Cargo.toml [-- --quick] [--only shell|patch|size] [--out FILE]`

mod patch;
mod probe;
mod shell;
mod sizes;
mod timing;
mod ts_bash;

use std::path::{Path, PathBuf};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--probe") {
        // A child run on one generated hostile case (see probe.rs).
        let answer = match args.get(1..4) {
            Some([kind, reader, case]) if kind == "shell" => shell::probe_main(reader, case),
            Some([kind, reader, case]) if kind == "patch" => patch::probe_main(reader, case),
            _ => serde_json::json!({"error": "usage: --probe shell|patch READER CASE"}),
        };
        println!("{answer}");
        return;
    }
    // Panics are caught and reported per case; their default message would only add noise.
    std::panic::set_hook(Box::new(|_| {}));

    let quick = args.iter().any(|a| a == "--quick");
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let out_file = args
        .iter()
        .position(|a| a == "--out")
        .and_then(|i| args.get(i + 1))
        .map(PathBuf::from);
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let want = |what: &str| only.as_deref().is_none_or(|o| o == what);

    let mut out = String::from("# Parsers: ours against the libraries\n\n");
    out.push_str(&format!(
        "Measured on {} cores; `{}` to rerun.\n\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        "cargo run --release --manifest-path bench/parsers/Cargo.toml"
    ));
    if want("shell") {
        match shell::run(&here.join("shell_corpus.txt"), quick) {
            Ok(r) => shell::print(&r, &mut out),
            Err(e) => {
                eprintln!("shell: {e}");
                std::process::exit(1);
            }
        }
    }
    if want("patch") {
        match patch::run(here, quick) {
            Ok(r) => patch::print(&r, &mut out),
            Err(e) => {
                eprintln!("patch: {e}");
                std::process::exit(1);
            }
        }
    }
    if want("size") {
        sizes::run(here, &mut out);
    }
    print!("{out}");
    if let Some(path) = out_file
        && let Err(e) = std::fs::write(&path, &out)
    {
        eprintln!("cannot write {}: {e}", path.display());
        std::process::exit(1);
    }
}
