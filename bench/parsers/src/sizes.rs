//! What each parser adds to a binary: one small program per parser (`size/*.rs`, built as
//! examples in release with symbols stripped), against a baseline that parses nothing.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use crate::timing;

const BINS: &[(&str, &str)] = &[
    ("size_none", "nothing (the baseline)"),
    ("size_ours_shell", "our shell reader"),
    ("size_tree_sitter_bash", "tree-sitter + tree-sitter-bash"),
    ("size_ours_patch", "our patch parser"),
    ("size_diffy", "diffy"),
    ("size_gitpatch", "gitpatch"),
    ("size_unidiff", "unidiff"),
];

pub fn run(here: &Path, out: &mut String) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let built = Command::new(cargo)
        .args([
            "build",
            "--release",
            "--examples",
            "--quiet",
            "--manifest-path",
        ])
        .arg(here.join("Cargo.toml"))
        .status();
    if !built.is_ok_and(|s| s.success()) {
        let _ = writeln!(out, "## Binary size\n\nthe size examples did not build\n");
        return;
    }
    let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|p| p.join("examples")))
    else {
        return;
    };
    let size = |name: &str| std::fs::metadata(dir.join(name)).map(|m| m.len()).ok();
    let base = size("size_none").unwrap_or(0);
    let _ = writeln!(
        out,
        "## Binary size\n\nA program that reads stdin and runs one parser, release, stripped; the \
         share is its size less the baseline's.\n\n| parser | binary | share |\n|---|---:|---:|"
    );
    for (bin, what) in BINS {
        match size(bin) {
            Some(n) => {
                let _ = writeln!(
                    out,
                    "| {what} | {} | {} |",
                    timing::bytes(n as usize),
                    timing::bytes(n.saturating_sub(base) as usize)
                );
            }
            None => {
                let _ = writeln!(out, "| {what} | missing | |");
            }
        }
    }
    let _ = writeln!(out);
}
