//! What execve(2) takes, checked before an exec is sent to a sandbox.
//!
//! The API takes request bodies of up to 16 MiB, but the kernel runs a command only when each
//! argument and environment string is shorter than `MAX_ARG_STRLEN` and all of them, with their
//! pointers, fit in the argument space `fs/exec.c` derives from the stack limit. A request over
//! either is refused up front with an error that names the limit, on every backend, so no
//! oversized command ever reaches a sandbox (and the sandbox answers the next exec as before).

use crate::api::ApiError;

/// The longest argument or environment string execve copies, its terminating NUL included
/// (`MAX_ARG_STRLEN`, 32 pages of 4 KiB).
pub const MAX_ARG_STRLEN: usize = 32 * 4096;

/// The argument space every stack limit gets at least (`ARG_MAX`, 32 pages).
pub const MIN_ARG_SPACE: u64 = 128 * 1024;

/// The most argument space any stack limit gets: three quarters of `_STK_LIM` (8 MiB).
pub const MAX_ARG_SPACE: u64 = 6 * 1024 * 1024;

/// The longest working directory (`PATH_MAX`, its NUL included).
pub const PATH_MAX: usize = 4096;

/// Bytes kept aside for the program's path, which execve copies onto the same stack (the
/// resolved `PATH` candidate, at most `PATH_MAX`), and its pointer.
const PROGRAM_RESERVE: u64 = PATH_MAX as u64 + 8;

/// The argument space of a process whose soft stack limit is `stack` bytes, as `fs/exec.c`
/// (`bprm_stack_limits`) computes it: a quarter of the stack limit, at most three quarters of
/// `_STK_LIM`, at least `ARG_MAX`.
pub fn argument_space(stack: u64) -> u64 {
    (stack / 4).clamp(MIN_ARG_SPACE, MAX_ARG_SPACE)
}

/// The argument space of commands that inherit this process's own stack limit.
pub fn own_argument_space() -> u64 {
    let stack = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_STACK)
        .map(|(soft, _)| soft)
        // The usual default when it cannot be read.
        .unwrap_or(8 * 1024 * 1024);
    argument_space(stack)
}

/// The command an exec runs, as execve will see it.
pub struct Command<'a> {
    pub argv: &'a [String],
    pub env: &'a [(String, String)],
    /// The last argument is a shell command line the request gave as `shell`.
    pub shell: bool,
    /// Strings a backend adds around the argv (a wrapper's own arguments), counted in the total.
    pub extra: &'a [&'a str],
}

impl Command<'_> {
    /// Refuses what the kernel would not run: NUL bytes, a string over `MAX_ARG_STRLEN`, a total
    /// over `space` (see [`argument_space`]).
    pub fn check(&self, space: u64) -> Result<(), ApiError> {
        let longest = MAX_ARG_STRLEN - 1;
        for (i, a) in self.argv.iter().enumerate() {
            let shell_line = self.shell && i + 1 == self.argv.len();
            if a.contains('\0') {
                return Err(ApiError::invalid(if shell_line {
                    "the shell command contains a NUL byte".to_string()
                } else {
                    format!("argument {} contains a NUL byte", i + 1)
                }));
            }
            if a.len() > longest {
                let what = if shell_line {
                    "the shell command".to_string()
                } else {
                    format!("argument {}", i + 1)
                };
                return Err(ApiError::invalid(format!(
                    "{what} is {} bytes, over the kernel's limit of {longest} bytes for one \
                     argument (MAX_ARG_STRLEN); pass long text on stdin or in a file",
                    a.len()
                )));
            }
        }
        for (k, v) in self.env {
            if k.contains('\0') || v.contains('\0') {
                return Err(ApiError::invalid(format!(
                    "environment variable {} contains a NUL byte",
                    short(k)
                )));
            }
            let len = k.len() + 1 + v.len();
            if len > longest {
                return Err(ApiError::invalid(format!(
                    "environment variable {} is {len} bytes as NAME=VALUE, over the kernel's \
                     limit of {longest} bytes for one string (MAX_ARG_STRLEN)",
                    short(k)
                )));
            }
        }
        let strings = |lens: &mut dyn Iterator<Item = usize>| -> (u64, u64) {
            lens.fold((0, 0), |(bytes, n), l| (bytes + l as u64 + 1, n + 1))
        };
        let (arg_bytes, argc) = strings(
            &mut self
                .argv
                .iter()
                .map(String::len)
                .chain(self.extra.iter().map(|s| s.len())),
        );
        let (env_bytes, envc) = strings(&mut self.env.iter().map(|(k, v)| k.len() + 1 + v.len()));
        // Each string also takes a pointer on the new stack.
        let total = arg_bytes + env_bytes + (argc.max(1) + envc) * 8 + PROGRAM_RESERVE;
        if total > space {
            return Err(ApiError::invalid(format!(
                "the command's arguments and environment take {total} bytes, over the {space} \
                 bytes execve takes here (a quarter of the stack limit, at least {MIN_ARG_SPACE} \
                 and at most {MAX_ARG_SPACE}); pass long text on stdin or in a file"
            )));
        }
        Ok(())
    }
}

/// Refuses a working directory the kernel cannot enter by name: NUL bytes or over `PATH_MAX`.
pub fn check_cwd(cwd: &str) -> Result<(), ApiError> {
    if cwd.contains('\0') {
        return Err(ApiError::invalid("cwd contains a NUL byte"));
    }
    if cwd.len() >= PATH_MAX {
        return Err(ApiError::invalid(format!(
            "cwd is {} bytes, over the kernel's limit of {} bytes for a path (PATH_MAX)",
            cwd.len(),
            PATH_MAX - 1
        )));
    }
    Ok(())
}

/// The error of an exec whose working directory the command could not enter: `message` says
/// so, `errno` (from chdir) gives the code, the same on every backend and the same as a file
/// operation on that path would give.
pub fn cwd_refused(message: String, errno: i32) -> ApiError {
    match errno {
        libc::ENOENT => ApiError::NotFound(message),
        libc::ENOTDIR => ApiError::NotADirectory(message),
        libc::EACCES | libc::EPERM => ApiError::PermissionDenied(message),
        _ => ApiError::InvalidArgument(message),
    }
}

/// A name as an error quotes it: at most 64 characters.
fn short(name: &str) -> String {
    if name.chars().count() <= 64 {
        return format!("{name:?}");
    }
    let head: String = name.chars().take(64).collect();
    format!("{head:?}... ({} bytes)", name.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd<'a>(argv: &'a [String], env: &'a [(String, String)]) -> Command<'a> {
        Command {
            argv,
            env,
            shell: false,
            extra: &[],
        }
    }

    #[test]
    fn the_space_follows_the_kernel() {
        assert_eq!(argument_space(8 << 20), 2 << 20);
        assert_eq!(argument_space(64 * 1024), MIN_ARG_SPACE);
        assert_eq!(argument_space(u64::MAX), MAX_ARG_SPACE);
    }

    #[test]
    fn one_string_may_be_just_under_max_arg_strlen() {
        let ok = vec!["echo".to_string(), "a".repeat(MAX_ARG_STRLEN - 1)];
        cmd(&ok, &[]).check(2 << 20).unwrap();
        let over = vec!["echo".to_string(), "a".repeat(MAX_ARG_STRLEN)];
        let e = cmd(&over, &[]).check(2 << 20).unwrap_err();
        assert!(
            matches!(&e, ApiError::InvalidArgument(m) if m.contains("argument 2") && m.contains("131071") && m.contains("MAX_ARG_STRLEN")),
            "{e}"
        );
        let shell = Command {
            shell: true,
            ..cmd(&over, &[])
        };
        let e = shell.check(2 << 20).unwrap_err();
        assert!(
            e.to_string().contains("the shell command is 131072 bytes"),
            "{e}"
        );
        let env = vec![("BIG".to_string(), "v".repeat(MAX_ARG_STRLEN))];
        let e = cmd(&ok[..1], &env).check(2 << 20).unwrap_err();
        assert!(
            e.to_string().contains("environment variable \"BIG\""),
            "{e}"
        );
    }

    #[test]
    fn the_total_counts_strings_pointers_and_the_program() {
        // 16 arguments of 64 KiB: about 1 MiB, within 2 MiB.
        let argv: Vec<String> = std::iter::once("echo".to_string())
            .chain((0..16).map(|_| "a".repeat(64 * 1024)))
            .collect();
        cmd(&argv, &[]).check(2 << 20).unwrap();
        let e = cmd(&argv, &[]).check(1 << 20).unwrap_err();
        assert!(
            matches!(&e, ApiError::InvalidArgument(m) if m.contains("1048576 bytes execve takes")),
            "{e}"
        );
        // Many empty strings: the pointers alone.
        let argv = vec![String::new(); 300_000];
        assert!(cmd(&argv, &[]).check(2 << 20).is_err());
    }

    #[test]
    fn nul_bytes_and_long_paths_are_refused() {
        let argv = vec!["a\0b".to_string()];
        assert!(cmd(&argv, &[]).check(2 << 20).is_err());
        let env = vec![("K".to_string(), "a\0".to_string())];
        assert!(cmd(&argv[..0], &env).check(2 << 20).is_err());
        assert!(check_cwd("/a\0").is_err());
        assert!(
            check_cwd(&"/a".repeat(PATH_MAX))
                .unwrap_err()
                .to_string()
                .contains("PATH_MAX")
        );
        check_cwd("/workspace").unwrap();
    }
}
