//! Files as tools print them, made relative to the workspace.

/// Where the exec ran: the workspace's paths as the sandbox sees it and the working directory,
/// so a file a tool printed (relative to that directory, or absolute) can be given relative to
/// the workspace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Paths {
    /// The absolute paths at which the workspace is seen (inside the sandbox; the host's own
    /// path too where a tool may print that one), without a trailing slash.
    pub roots: Vec<String>,
    /// The exec's working directory, absolute (inside the sandbox).
    pub cwd: String,
}

impl Paths {
    /// Paths of a workspace seen at `root`, for an exec whose working directory is `cwd`.
    pub fn new(root: &str, cwd: &str) -> Paths {
        Paths {
            roots: vec![root.trim_end_matches('/').to_string()],
            cwd: cwd.to_string(),
        }
    }

    /// `file` relative to the workspace when it is inside it; otherwise as printed (an
    /// absolute path outside the workspace, or a relative one when no working directory is
    /// known).
    pub fn locate(&self, file: &str) -> String {
        let file = file.trim();
        let file = file.strip_prefix("file://").unwrap_or(file);
        let abs = if file.starts_with('/') {
            normalize(file)
        } else if self.cwd.starts_with('/') {
            normalize(&format!("{}/{}", self.cwd, file))
        } else {
            return normalize_relative(file);
        };
        for root in &self.roots {
            if root.is_empty() {
                continue;
            }
            if abs == *root {
                return ".".to_string();
            }
            if let Some(rest) = abs.strip_prefix(root.as_str())
                && let Some(rest) = rest.strip_prefix('/')
            {
                return rest.to_string();
            }
        }
        abs
    }

    /// Whether `file` (as [`Paths::locate`] gives it) is inside the workspace.
    pub fn inside(&self, located: &str) -> bool {
        !located.starts_with('/') && !located.starts_with("../") && located != ".."
    }
}

/// An absolute path without `.`, `..` and repeated slashes (`..` above `/` stays at `/`).
fn normalize(p: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    format!("/{}", parts.join("/"))
}

/// A relative path without `.` and with `..` folded where it can be.
fn normalize_relative(p: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." if parts.last().is_some_and(|l| *l != "..") => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    if parts.is_empty() {
        ".".to_string()
    } else {
        parts.join("/")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_made_relative_to_the_workspace() {
        let p = Paths::new("/workspace/", "/workspace/pkg");
        assert_eq!(p.locate("tests/test_a.py"), "pkg/tests/test_a.py");
        assert_eq!(p.locate("./src/../lib.rs"), "pkg/lib.rs");
        assert_eq!(p.locate("/workspace/src/main.rs"), "src/main.rs");
        assert_eq!(p.locate("../top.c"), "top.c");
        assert_eq!(p.locate("/usr/lib/python3/x.py"), "/usr/lib/python3/x.py");
        assert_eq!(p.locate("../../etc/passwd"), "/etc/passwd");
        assert!(!p.inside(&p.locate("/usr/lib/x.py")));
        assert!(p.inside(&p.locate("a.py")));
        let unknown = Paths::default();
        assert_eq!(unknown.locate("./a/b.py"), "a/b.py");
    }
}
