//! The server's instructions: what the sandbox is, what is isolated, and how paths are read.
//! (The tools and the text of their results are `taskbox_tools`'s.)

use taskbox_core::api::SandboxInfo;

/// The server's instructions: what the sandbox is and what is isolated.
pub(crate) fn instructions(info: &SandboxInfo) -> String {
    let e = &info.enforcement;
    let network = match e.network.as_str() {
        "none" => "no network (loopback only)".to_string(),
        "proxy" => "network only through taskbox's egress proxy, as the policy allows".to_string(),
        other => format!("network: {other}"),
    };
    let root = if info.image == "host" {
        "the host's filesystem, read-only".to_string()
    } else {
        format!("the image {}", info.image)
    };
    format!(
        "You work in taskbox sandbox {id} on the workspace {ws}. File paths in tool arguments are \
         relative to the workspace root (absolute paths inside it work too); commands start \
         there. The workspace is an overlay: your changes stay in the sandbox, the host copy is \
         untouched, and `diff` shows everything changed so far. Files and /tmp persist across \
         calls; processes do not outlive their exec. Policy {policy} (sha256 {hash}): the root \
         filesystem is {root}; secrets and paths the policy denies are hidden; {network}; \
         processes, /tmp, IPC and the hostname are private to the sandbox; confinement: \
         landlock {landlock}, seccomp {seccomp}, resource limits by {limits}. When the policy \
         refuses something, exec reports it as a `violation (KIND): ...` line.",
        id = info.id,
        ws = info.workspace,
        policy = info.policy,
        hash = short_hash(&info.policy_hash),
        landlock = e.landlock,
        seccomp = if e.seccomp { "on" } else { "off" },
        limits = e.limits,
    )
}

fn short_hash(hash: &str) -> &str {
    let hash = hash.strip_prefix("sha256:").unwrap_or(hash);
    hash.get(..12).unwrap_or(hash)
}
