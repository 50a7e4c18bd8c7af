//! taskbox-init: the small synchronous helper that builds a sandbox and execs a command in it.
//!
//! It links no async runtime: it forks, unshares and execs. The runtime hands it a complete
//! [`config::InitConfig`]; the helper carries it out and reports on the status pipe
//! ([`config::STATUS_FD`]) with one JSON [`config::Status`] per line.
//!
//! Process shape: the helper (H) joins the cgroups, makes the idmapped mounts of the plan (only
//! the host's root may), creates the user namespace (when not root) and the other namespaces,
//! then forks the sandbox's pid 1 (C). C builds the mount tree, pivots into
//! it, and forks the command (X). X confines itself (setsid, rlimits, no_new_privs, capabilities,
//! Landlock, seccomp) and execs. C reaps everything and reports X's status; when C exits the
//! kernel kills whatever is left in the pid namespace, so no background process outlives a run.

pub use taskbox_protocol::{config, control};
mod command;
mod idmap;
pub mod landlock_rules;
pub mod merge;
pub mod mounts;
pub mod run;
pub mod seccomp;
mod server;
pub mod sys;
pub mod zygote;

/// The helper binary's entry: `taskbox-init PLAN.json`, or `taskbox-init - [NAME]` to read the
/// plan from [`config::PLAN_FD`] (how the runtime starts it, with the sandbox's or the run's id
/// as `NAME`: only a label, so that `ps` tells the sandboxes' processes apart), or
/// `taskbox-init --zygote NAME` to fork such helpers on request ([`zygote`]). Never returns.
pub fn run_main() -> ! {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    match args.len() {
        3 | 2 if args[1] == "-" => run::run_from_plan_fd(),
        3 if args[1] == config::ZYGOTE_ARG => zygote::serve(),
        2 => run::run_from_file(std::path::Path::new(&args[1])),
        _ => {
            eprintln!(
                "usage: taskbox-init PLAN.json | taskbox-init - [NAME]  (the plan on descriptor \
                 {})\n(the sandbox set-up helper of taskbox; it is started by `taskbox run` and \
                 `taskbox serve`, not by hand)",
                config::PLAN_FD
            );
            std::process::exit(125);
        }
    }
}
