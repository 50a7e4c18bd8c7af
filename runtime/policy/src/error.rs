//! Why a policy could not be loaded or was refused, and the size limit on a policy's text.

use std::io;
use std::path::PathBuf;

/// The largest policy text taskbox reads: a file, or inline text in a create request. Real
/// policies are a few KiB; the bound keeps a hostile or mistaken source (`/dev/zero`, a log file)
/// from growing the reader's memory.
pub const POLICY_TEXT_MAX: usize = 256 * 1024;

/// Why a policy could not be loaded. Each message is one line naming the file and, where there is
/// one, the key.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// The policy file could not be read.
    #[error("cannot read policy {}: {}", path.display(), io_reason(source))]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The file is not valid TOML.
    #[error("{origin}:{line}:{column}: invalid toml: {message}")]
    Syntax {
        origin: String,
        line: usize,
        column: usize,
        message: String,
    },
    /// A key is unknown, has the wrong type, or has a value the policy cannot accept.
    #[error("{origin}: {key}: {reason}")]
    Invalid {
        origin: String,
        key: String,
        reason: String,
    },
    /// No policy has this name.
    #[error("unknown policy {name:?} (available: {})", available.join(", "))]
    UnknownName {
        name: String,
        available: Vec<String>,
    },
    /// The file is a FIFO, a device, a directory or a socket.
    #[error(
        "cannot read policy {}: not a regular file (a policy is a .toml file; FIFOs and devices are refused)",
        path.display()
    )]
    NotAFile { path: PathBuf },
    /// The text is larger than [`POLICY_TEXT_MAX`].
    #[error("policy {origin} is {bytes} bytes; a policy may have at most {POLICY_TEXT_MAX} bytes")]
    TooLarge { origin: String, bytes: u64 },
    /// The file is not UTF-8 text.
    #[error("policy {origin} is not UTF-8 text")]
    NotText { origin: String },
    /// A path where only a profile name is accepted (a remote client names profiles or sends
    /// the policy's text).
    #[error(
        "policy {name:?} looks like a path: the supervisor takes policies only as profile names or as inline text (policy_toml); send the file's content instead"
    )]
    PathRefused { name: String },
    /// The argument is neither a valid name nor a path.
    #[error(
        "invalid policy name {name:?}: names use only a-z, 0-9 and -; give a path to a .toml file otherwise"
    )]
    InvalidName { name: String },
}

/// A policy value that [`Policy::validate`] refuses: the dotted key and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {reason}")]
pub struct ValidationError {
    /// Dotted path of the key, e.g. `limits.memory` or `filesystem.protected[1]`.
    pub key: String,
    pub reason: String,
}

impl ValidationError {
    pub(crate) fn new(key: impl Into<String>, reason: impl Into<String>) -> Self {
        ValidationError {
            key: key.into(),
            reason: reason.into(),
        }
    }

    /// The same error, attributed to a policy file or other origin.
    pub fn in_origin(self, origin: &str) -> PolicyError {
        PolicyError::Invalid {
            origin: origin.to_owned(),
            key: self.key,
            reason: self.reason,
        }
    }
}

pub(crate) fn io_reason(err: &io::Error) -> String {
    // "No such file or directory (os error 2)" -> "No such file or directory"
    let text = err.to_string();
    match text.rfind(" (os error ") {
        Some(at) => text[..at].to_owned(),
        None => text,
    }
}
