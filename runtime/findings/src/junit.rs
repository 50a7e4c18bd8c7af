//! JUnit XML files that a runner wrote during the exec (Maven Surefire, Gradle, pytest's
//! `--junitxml`, any runner that writes them).

use crate::{Findings, Paths};

/// The failed and errored test cases of one JUnit XML document, and its counts; a document
/// that is not JUnit XML gives nothing.
pub fn read_junit(_xml: &[u8], _paths: &Paths) -> Findings {
    Findings::default()
}
