//! What reading and matching git's ignore rules may cost one pass over a sandbox's files (a
//! review of a change, a walk of the fs API), and reading an ignore file within it.
//!
//! Git's rules cost a path its length times the ignore files on its way, and building a matcher
//! costs up to two seconds per MiB of patterns. A sandbox controls both: nested `.gitignore`
//! files in a tree as deep as a path can hold made one review cost the cube of its depth
//! (seconds), and one large ignore file hard-linked into every directory it touches cost a
//! build per directory (hours). So a pass reads at most [`MAX_IGNORE_TOTAL`] of ignore files in
//! all and matches at most [`MIN_MATCH_BUDGET`] bytes of paths, plus [`MATCH_PER_PATH`] for each
//! path it looks at. Past the bound, files have no rules and paths match none: what is left
//! is shown rather than hidden, the safe side for a reviewer and for a listing. A warning is
//! logged once per pass.

use std::io::Read;

use ignore::gitignore::{Gitignore, GitignoreBuilder};

/// The largest ignore file read (git reads larger ones; a file past this is read up to its
/// last whole line before here).
pub(crate) const MAX_IGNORE_FILE: u64 = 256 << 10;
/// The most of ignore files one pass reads, all files together.
pub(crate) const MAX_IGNORE_TOTAL: u64 = 256 << 10;
/// The least path matching one pass may do, in bytes of paths.
pub(crate) const MIN_MATCH_BUDGET: u64 = 64 << 20;
/// What each path a pass looks at adds to its matching bound.
pub(crate) const MATCH_PER_PATH: u64 = 4 << 10;
/// What one match costs against the bound besides its path's length.
const MATCH_COST: u64 = 64;

/// What is left of what the rules of one pass may cost (see the module doc).
#[derive(Debug)]
pub(crate) struct IgnoreBudget {
    /// Bytes of ignore files.
    read: u64,
    /// Bytes of paths matched.
    matched: u64,
    /// Whether the pass went past it (told once).
    spent: bool,
}

impl IgnoreBudget {
    /// The budget of a pass that looks at `paths` paths (more may be added as it goes).
    pub(crate) fn new(paths: u64) -> Self {
        IgnoreBudget {
            read: MAX_IGNORE_TOTAL,
            matched: MIN_MATCH_BUDGET.max(MATCH_PER_PATH.saturating_mul(paths)),
            spent: false,
        }
    }

    /// The pass looks at one more path.
    pub(crate) fn add_path(&mut self) {
        self.matched = self.matched.saturating_add(MATCH_PER_PATH);
    }

    /// Takes the matching of a path `len` bytes long; false when it is not left.
    pub(crate) fn take_match(&mut self, len: usize) -> bool {
        match self.matched.checked_sub(len as u64 + MATCH_COST) {
            Some(rest) => {
                self.matched = rest;
                true
            }
            None => {
                self.spent();
                false
            }
        }
    }

    /// The matcher of the ignore file `file` rooted at `root` (paths given to it are stripped
    /// of `root`), read up to its last whole line within what is left of the bound (and
    /// [`MAX_IGNORE_FILE`]); lines that are not valid patterns are skipped. `None` when it has
    /// no rules, could not be read (logged at debug level, naming `what`), or nothing is left.
    pub(crate) fn read_rules(
        &mut self,
        file: impl Read,
        root: &std::path::Path,
        what: &dyn std::fmt::Display,
    ) -> Option<Gitignore> {
        let limit = self.read.min(MAX_IGNORE_FILE);
        if limit == 0 {
            self.spent();
            return None;
        }
        let mut bytes = Vec::new();
        let read = file.take(limit + 1).read_to_end(&mut bytes);
        self.read -= (bytes.len() as u64).min(self.read);
        if let Err(e) = read {
            tracing::debug!(path = %what, error = %e, "ignore file not read");
            return None;
        }
        if bytes.len() as u64 > limit {
            // Cut: a line cut short is another pattern ("*.log" would become "*"), so it goes.
            let whole = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
            bytes.truncate(whole.min(limit as usize));
        }
        let text = String::from_utf8_lossy(&bytes);
        let mut b = GitignoreBuilder::new(root);
        for line in text.lines() {
            let _ = b.add_line(None, line.strip_suffix('\r').unwrap_or(line));
        }
        b.build().ok().filter(|gi| !gi.is_empty())
    }

    /// The pass went past its bound: told once.
    fn spent(&mut self) {
        if !self.spent {
            self.spent = true;
            tracing::warn!(
                "the ignore rules of a review or walk went past their bound: the rest is shown"
            );
        }
    }
}
