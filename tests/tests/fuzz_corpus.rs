//! Every fuzz target's body (`tests/fuzz/src/lib.rs`) over its committed corpus: the hand-made
//! seeds (hostile requests, patches, layers, traces, policies, tool calls) and every input that
//! once broke one of the promises the bodies check. A libFuzzer run (`scripts/fuzz.sh`) starts
//! from the same corpus; this keeps what it found fixed.

#[path = "../fuzz/src/lib.rs"]
mod fuzz;

use std::fs;
use std::panic::{self, AssertUnwindSafe};
use std::path::Path;

fn corpus(target: &str) -> Vec<std::path::PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<_> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("the corpus of {target} ({}): {e}", dir.display()))
        .map(|e| {
            e.unwrap_or_else(|e| panic!("list {}: {e}", dir.display()))
                .path()
        })
        .collect();
    files.sort();
    files
}

#[test]
fn every_target_keeps_its_promises_over_its_corpus() {
    let mut failed = Vec::new();
    let mut ran = 0;
    for (name, body) in fuzz::TARGETS {
        let files = corpus(name);
        assert!(!files.is_empty(), "{name} has no corpus");
        for file in files {
            let data = fs::read(&file).unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
            ran += 1;
            if let Err(p) = panic::catch_unwind(AssertUnwindSafe(|| body(&data))) {
                let why = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default();
                failed.push(format!("{name} {}: {why}", file.display()));
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {ran} inputs broke a promise:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

#[test]
fn every_fuzz_target_has_a_body_and_a_corpus() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let manifest = fs::read_to_string(root.join("Cargo.toml"))
        .unwrap_or_else(|e| panic!("read the fuzz manifest: {e}"));
    for (name, _) in fuzz::TARGETS {
        let source = root.join("fuzz_targets").join(format!("{name}.rs"));
        let text = fs::read_to_string(&source)
            .unwrap_or_else(|e| panic!("{name}: no target file {}: {e}", source.display()));
        assert!(
            text.contains(&format!("taskbox_fuzz::{name}(")),
            "{} runs another body",
            source.display()
        );
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "{name} is not a [[bin]] of the fuzz crate"
        );
    }
    let files = fs::read_dir(root.join("fuzz_targets"))
        .unwrap_or_else(|e| panic!("list the fuzz targets: {e}"))
        .count();
    assert_eq!(
        files,
        fuzz::TARGETS.len(),
        "a target file without an entry in TARGETS"
    );
}
