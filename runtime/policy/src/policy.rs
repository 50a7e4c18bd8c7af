//! Policies: what a sandbox may do.
//!
//! A policy is a TOML file (see `policies/default.toml`, whose comments explain every key). This
//! module owns its model ([`Policy`]), parsing with errors that point at the offending key
//! ([`parse`], [`PolicyError`]), finding a policy by name or path ([`resolve`]), a stable hash
//! recorded in traces ([`Policy::hash`]) and a plain-words summary for people ([`Policy::explain`]).
//!
//! Every section and key is optional; a key left out takes the value of the built-in default
//! profile, so `Policy::default()` and `policies/default.toml` are the same policy.
//!
//! Sizes (`limits.memory`, `limits.file_size`, `limits.disk`, `limits.output`) are an integer
//! number of bytes or a
//! number with a unit. `K`, `M`, `G`, `T` and `KiB`, `MiB`, `GiB`, `TiB` are powers of 1024;
//! `KB`, `MB`, `GB`, `TB` are powers of 1000; `B` is bytes. Units are case-insensitive, and a
//! space may separate number and unit (`"512MiB"`, `"1.5 GiB"`, `"2G"`). Durations
//! (`limits.timeout`) use humantime syntax: `"30s"`, `"10m"`, `"1h 30m"`.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::commands::Commands;
pub use crate::error::{POLICY_TEXT_MAX, PolicyError, ValidationError};
use crate::netpattern::normalize_name;
pub use crate::netpattern::{HostMatch, HostPattern};
pub use crate::requests::{RequestPattern, RequestRules};
pub use crate::secrets::SecretSpec;
use crate::units::{GIB, MIB, de_duration, de_size, ser_duration, ser_size};
pub use crate::units::{human_size, parse_size};

/// The port of the egress proxy's listener on `127.0.0.1` inside a sandbox (the conventional port
/// of HTTP proxies). Fixed, so that a command (and a model) can rely on it; it is the only TCP
/// port a command of a `proxy`-mode sandbox may connect to.
pub const PROXY_PORT: u16 = 3128;

/// Host paths that are always unreadable inside a sandbox, whatever the policy says. A policy's
/// `filesystem.deny_read` adds to this list. Paths that do not exist on a host are skipped.
pub const BUILTIN_DENY_READ: &[&str] = &[
    // Password hashes and their backups.
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/security/opasswd",
    // Who may become root, and how.
    "/etc/sudoers",
    "/etc/sudoers.d",
    // SSH host private keys (and the server config that names them).
    "/etc/ssh",
    // Other host secrets: TLS private keys, Kerberos keytabs, cached directory credentials,
    // saved Wi-Fi and VPN passwords.
    "/etc/ssl/private",
    "/etc/letsencrypt",
    "/etc/krb5.keytab",
    "/var/lib/sss",
    "/etc/NetworkManager/system-connections",
    "/etc/wpa_supplicant",
    "/var/lib/iwd",
    // The administrator's home.
    "/root",
    // Container engines: their sockets are root on the host, their state holds other containers.
    "/var/lib/docker",
    "/var/run/docker.sock",
    "/run/docker.sock",
    "/run/containerd",
    "/var/lib/containerd",
    "/run/podman",
    "/run/crio",
    // Orchestrator credentials and mounted service-account tokens.
    "/etc/kubernetes",
    "/var/lib/kubelet",
    "/run/secrets",
    "/var/run/secrets",
    // Sockets that reach host services despite the network namespace: the system bus, systemd,
    // snapd, and per-user runtime dirs (session bus, ssh-agent, gpg-agent, keyrings).
    "/run/dbus",
    "/var/run/dbus",
    "/run/systemd/private",
    "/run/snapd.socket",
    "/run/snapd-snap.socket",
    "/run/user",
];

/// Credential stores, relative to a home directory. They stay hidden even when the home directory
/// is visible read-only or a `filesystem.home_visible` entry contains them.
pub const CREDENTIAL_STORES: &[&str] = &[
    // Keys and agents.
    ".ssh",
    ".gnupg",
    ".password-store",
    ".local/share/keyrings",
    ".local/share/kwalletd",
    ".config/sops",
    // Cloud providers.
    ".aws",
    ".azure",
    ".config/gcloud",
    ".oci",
    ".config/doctl",
    ".s3cfg",
    ".boto",
    ".config/rclone",
    // Code hosts and git.
    ".config/gh",
    ".config/hub",
    ".git-credentials",
    ".config/git/credentials",
    ".netrc",
    ".config/github-copilot",
    // Containers and clusters.
    ".docker",
    ".kube",
    // Package registries.
    ".npmrc",
    ".yarnrc.yml",
    ".pypirc",
    ".cargo/credentials",
    ".cargo/credentials.toml",
    ".gem/credentials",
    ".m2/settings.xml",
    ".m2/settings-security.xml",
    ".gradle/gradle.properties",
    ".huggingface/token",
    ".cache/huggingface/token",
    // Infrastructure tools and databases.
    ".terraform.d/credentials.tfrc.json",
    ".vault-token",
    ".pgpass",
    ".my.cnf",
    // Password managers.
    ".config/op",
    // Browser profiles (cookies, saved passwords).
    ".mozilla",
    ".config/google-chrome",
    ".config/chromium",
    // Shell and REPL histories, which often hold pasted tokens.
    ".bash_history",
    ".zsh_history",
    ".python_history",
    ".psql_history",
    ".mysql_history",
];

/// The profiles compiled into taskbox, by name.
const BUILTIN_PROFILES: &[(&str, &str)] = &[
    ("default", include_str!("../../../policies/default.toml")),
    (
        "read-only",
        include_str!("../../../policies/read-only.toml"),
    ),
    (
        "package-registries",
        include_str!("../../../policies/package-registries.toml"),
    ),
    (
        "build-server",
        include_str!("../../../policies/build-server.toml"),
    ),
    (
        "trusted-host-network",
        include_str!("../../../policies/trusted-host-network.toml"),
    ),
];

/// The description of the built-in default profile.
const DEFAULT_DESCRIPTION: &str =
    "build and test the workspace offline; changes stay in the sandbox until reviewed";

/// What a sandbox may do.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Policy {
    /// One line saying what the policy is for. Not inherited from the default profile: a file
    /// without one has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    pub filesystem: Filesystem,
    pub network: Network,
    pub limits: Limits,
    pub env: Env,
    pub security: Security,
    /// Rules over the commands an exec runs (see [`crate::commands`]). Left out of the
    /// serialised form (and so of the hash) when it is the default: no rules.
    #[serde(skip_serializing_if = "Commands::is_default")]
    pub commands: Commands,
    /// Credentials the egress proxy presents for the sandbox, by name (see [`crate::secrets`]
    /// and `docs/secrets.md`); only where to find each value, never the value. Left out of the
    /// serialised form (and so of the hash) when empty.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub secrets: BTreeMap<String, SecretSpec>,
}

impl Default for Policy {
    /// The built-in default profile (`policies/default.toml`).
    fn default() -> Self {
        Policy {
            description: Some(DEFAULT_DESCRIPTION.to_owned()),
            filesystem: Filesystem::default(),
            network: Network::default(),
            limits: Limits::default(),
            env: Env::default(),
            security: Security::default(),
            commands: Commands::default(),
            secrets: BTreeMap::new(),
        }
    }
}

/// What the sandbox sees of the filesystem.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Filesystem {
    pub workspace: WorkspaceMode,
    pub home: HomeMode,
    /// Home-relative directories (`~/.cargo`) kept visible read-only when `home` is hidden.
    pub home_visible: Vec<String>,
    /// Absolute host paths made unreadable, in addition to [`BUILTIN_DENY_READ`].
    pub deny_read: Vec<String>,
    /// Workspace-relative paths kept read-only even when the workspace is writable.
    pub protected: Vec<String>,
    /// Whether the sandbox's root (an image's) can be written: `read-only` (the default), or
    /// `writable`, an upper layer of the sandbox's own over the image, thrown away with the
    /// sandbox and never part of its changes or diff (those are the workspace's). Left out of
    /// the serialised form (and the hash) when read-only.
    #[serde(skip_serializing_if = "RootMode::is_read_only")]
    pub root: RootMode,
}

/// Whether the sandbox's root can be written (`filesystem.root`).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum RootMode {
    /// The image's root as it is: nothing outside the workspace, `/tmp` and the sandbox's own
    /// scratch directories can be written.
    #[default]
    ReadOnly,
    /// Writes anywhere in the root land in an upper layer of the sandbox's own (package
    /// installs, new users in `/etc/passwd`), as in a container; needs an image.
    Writable,
}

impl RootMode {
    pub fn is_read_only(&self) -> bool {
        *self == RootMode::ReadOnly
    }
}

impl Default for Filesystem {
    fn default() -> Self {
        Filesystem {
            workspace: WorkspaceMode::Overlay,
            home: HomeMode::Hidden,
            home_visible: strings(&["~/.cargo", "~/.rustup", "~/.local/bin"]),
            deny_read: Vec::new(),
            protected: strings(&[".git/hooks", ".git/config"]),
            root: RootMode::ReadOnly,
        }
    }
}

/// How the workspace is mounted.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum WorkspaceMode {
    /// Writes go to the sandbox's upper layer; the host copy stays pristine.
    #[default]
    Overlay,
    /// Nothing in the workspace can be changed.
    ReadOnly,
}

/// What the sandbox sees of home directories.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum HomeMode {
    /// Home directories are replaced by an empty tmpfs, except `home_visible`.
    #[default]
    Hidden,
    /// Home directories are visible read-only (credential stores still hidden).
    ReadOnly,
}

/// Network access. `allow`, `deny` and `hosts` only apply with `mode = "proxy"`; the rules are
/// documented in [`crate::netpattern`] and `docs/egress.md`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Network {
    pub mode: NetworkMode,
    /// Hosts the egress proxy lets through. Empty: none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<HostPattern>,
    /// Hosts the egress proxy refuses even when `allow` matches them (deny wins).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<HostPattern>,
    /// For tests: names the proxy resolves to these addresses instead of asking DNS. The addresses
    /// count as named by the policy, so they may be loopback or private (see `docs/egress.md`).
    #[serde(
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "de_hosts"
    )]
    pub hosts: BTreeMap<String, Vec<IpAddr>>,
    /// Rules over the HTTP requests to some hosts, which the proxy then inspects (see
    /// [`crate::requests`] and `docs/secrets.md`). Fixed when a sandbox is created.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub requests: Vec<RequestRules>,
}

impl Default for Network {
    fn default() -> Self {
        Network {
            mode: NetworkMode::None,
            allow: Vec::new(),
            deny: Vec::new(),
            hosts: BTreeMap::new(),
            requests: Vec::new(),
        }
    }
}

impl Network {
    fn validate(&self) -> Result<(), ValidationError> {
        if self.mode != NetworkMode::Proxy {
            let mode = self.mode.as_str();
            for (key, empty) in [
                ("network.allow", self.allow.is_empty()),
                ("network.deny", self.deny.is_empty()),
                ("network.hosts", self.hosts.is_empty()),
                ("network.requests", self.requests.is_empty()),
            ] {
                if !empty {
                    return Err(ValidationError::new(
                        key,
                        format!(
                            "only applies with mode = \"proxy\", and mode is \"{mode}\"; \
                             set mode = \"proxy\" or remove the rules"
                        ),
                    ));
                }
            }
        }
        for (index, pattern) in self.allow.iter().enumerate() {
            if pattern.is_catch_all() {
                return Err(ValidationError::new(
                    format!("network.allow[{index}]"),
                    format!(
                        "\"{pattern}\" would allow every host; list the hosts (or use mode = \"host\")"
                    ),
                ));
            }
        }
        for name in self.hosts.keys() {
            let key = format!("network.hosts.{name}");
            match normalize_name(name) {
                Ok(normal) if normal == *name => {}
                Ok(normal) => {
                    return Err(ValidationError::new(
                        key,
                        format!("write the name as {normal:?} (lowercase, no trailing dot)"),
                    ));
                }
                Err(reason) => return Err(ValidationError::new(key, reason)),
            }
            if self.hosts.get(name).is_some_and(Vec::is_empty) {
                return Err(ValidationError::new(key, "lists no address"));
            }
        }
        for (index, entry) in self.requests.iter().enumerate() {
            let key = format!("network.requests[{index}]");
            crate::secrets::check_inspected_hosts(
                &format!("{key}.hosts"),
                &entry.hosts,
                "a request rule",
            )?;
            if entry.allow.is_empty() && entry.deny.is_empty() {
                return Err(ValidationError::new(
                    key,
                    "has neither allow nor deny: say which requests it lets through or refuses",
                ));
            }
            if let Some(reason) = &entry.deny_reason {
                if reason.trim().is_empty() || reason.chars().any(char::is_control) {
                    return Err(ValidationError::new(
                        format!("{key}.deny_reason"),
                        "must be one line of text",
                    ));
                }
                if reason.len() > MAX_DENY_REASON {
                    return Err(ValidationError::new(
                        format!("{key}.deny_reason"),
                        format!("is longer than {MAX_DENY_REASON} bytes"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The longest `deny_reason` of a request rule: one line for a model to read.
pub const MAX_DENY_REASON: usize = 500;

impl Network {
    /// Rules for `mode = "proxy"` from pattern strings and a hosts map (an API request that
    /// changes a live sandbox's rules), checked as a policy file's `[network]` is: an error names
    /// the key (`network.allow[1]`) and the pattern.
    pub fn proxy_rules(
        allow: &[String],
        deny: &[String],
        hosts: &BTreeMap<String, Vec<String>>,
    ) -> Result<Network, ValidationError> {
        let value = serde_json::json!({
            "mode": "proxy", "allow": allow, "deny": deny, "hosts": hosts,
        });
        let network: Network = serde_path_to_error::deserialize(value).map_err(|err| {
            let key = format!("network.{}", dotted_path(err.path()));
            let (key, reason) = explain_de_error(key, &err.inner().to_string());
            ValidationError::new(key, reason)
        })?;
        network.validate()?;
        Ok(network)
    }

    /// The `Network` part of [`Policy::explain`] for `mode = "proxy"`.
    fn explain_proxy(&self, line: &mut impl FnMut(String)) {
        let list = |patterns: &[HostPattern]| {
            patterns
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        line(
            "  - Only through taskbox's egress proxy (HTTP, HTTPS via CONNECT, SOCKS5). Direct \
             connections, UDP and DNS fail."
                .to_owned(),
        );
        line(format!(
            "  - The proxy listens on 127.0.0.1:{} inside the sandbox and is advertised there \
             (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY, NO_PROXY, and git's, pip's, npm's and cargo's \
             own settings); every refused connection is reported as a violation of the command \
             that asked.",
            PROXY_PORT
        ));
        if self.allow.is_empty() {
            line("  - No host is allowed: every connection is refused.".to_owned());
        } else {
            line(format!(
                "  - Allowed: {}. *.NAME means subdomains of NAME, not NAME itself; a pattern \
                 without :PORT allows every port.",
                list(&self.allow)
            ));
        }
        if !self.deny.is_empty() {
            line(format!(
                "  - Refused even when allowed above: {}.",
                list(&self.deny)
            ));
        }
        line(
            "  - Names are resolved by the proxy, and every address must pass: loopback, \
             link-local, private and shared (100.64.0.0/10) addresses are refused unless an \
             allowed address pattern covers them, cloud-metadata endpoints unless one names \
             the exact address. An allowed name does not allow its addresses."
                .to_owned(),
        );
        let unlocked: Vec<String> = self
            .allow
            .iter()
            .filter(|p| matches!(&p.host, HostMatch::Net(_)))
            .map(ToString::to_string)
            .collect();
        if !unlocked.is_empty() {
            line(format!(
                "  - WARNING: these address patterns may reach this machine's or your local \
                 network's services when they cover such addresses: {}.",
                unlocked.join(", ")
            ));
        }
        if !self.hosts.is_empty() {
            let entries: Vec<String> = self
                .hosts
                .iter()
                .map(|(name, addrs)| {
                    let addrs: Vec<String> = addrs.iter().map(ToString::to_string).collect();
                    format!("{name} -> {}", addrs.join(" "))
                })
                .collect();
            line(format!(
                "  - WARNING: fixed addresses (for tests), used instead of DNS and allowed even \
                 when loopback or private: {}.",
                entries.join(", ")
            ));
        }
    }
}

fn de_hosts<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<BTreeMap<String, Vec<IpAddr>>, D::Error> {
    let raw = BTreeMap::<String, Vec<String>>::deserialize(deserializer)?;
    let mut hosts = BTreeMap::new();
    for (name, addrs) in raw {
        let mut parsed = Vec::with_capacity(addrs.len());
        for addr in &addrs {
            let ip = addr.parse::<IpAddr>().map_err(|_| {
                de::Error::custom(format!(
                    "{name:?}: invalid address {addr:?} (expected an IPv4 or IPv6 address)"
                ))
            })?;
            parsed.push(crate::netpattern::canonical_ip(ip));
        }
        hosts.insert(name, parsed);
    }
    Ok(hosts)
}

/// The smallest `limits.disk`: a file system needs room for its own metadata and a few files.
pub const MIN_DISK_BYTES: u64 = MIB;

/// How the sandbox reaches the network.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum NetworkMode {
    /// Loopback only.
    #[default]
    None,
    /// Only through taskbox's egress proxy, which applies `allow` and `deny`.
    Proxy,
    /// The host's network, unfiltered.
    Host,
}

impl NetworkMode {
    /// The name in a policy file.
    pub fn as_str(self) -> &'static str {
        match self {
            NetworkMode::None => "none",
            NetworkMode::Proxy => "proxy",
            NetworkMode::Host => "host",
        }
    }
}

/// Resource limits, parsed into numbers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Memory of the whole sandbox.
    #[serde(
        rename = "memory",
        deserialize_with = "de_size",
        serialize_with = "ser_size"
    )]
    pub memory_bytes: u64,
    /// Processes and threads.
    pub pids: u64,
    /// CPU cores, fractional allowed.
    #[serde(rename = "cpu")]
    pub cpu_cores: f64,
    /// Largest file a command may write.
    #[serde(
        rename = "file_size",
        deserialize_with = "de_size",
        serialize_with = "ser_size"
    )]
    pub file_size_bytes: u64,
    /// Everything the sandbox may write on the host or in memory-backed scratch, together: the
    /// workspace's upper layer, `/tmp`, `/var/tmp`, `/dev/shm`, the private home and the spill
    /// files of its output.
    #[serde(
        rename = "disk",
        deserialize_with = "de_size",
        serialize_with = "ser_size"
    )]
    pub disk_bytes: u64,
    /// Open file descriptors per process.
    pub open_files: u64,
    /// Default wall-clock timeout of one command.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub timeout: Duration,
    /// Output kept in memory and shown, per stream; the rest spills to a file.
    #[serde(
        rename = "output",
        deserialize_with = "de_size",
        serialize_with = "ser_size"
    )]
    pub output_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_bytes: 4 * GIB,
            pids: 1024,
            cpu_cores: 2.0,
            file_size_bytes: 8 * GIB,
            disk_bytes: 10 * GIB,
            open_files: 4096,
            timeout: Duration::from_secs(600),
            output_bytes: MIB,
        }
    }
}

/// The sandbox's environment variables.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Env {
    /// Host variables passed through; a trailing `*` is a prefix match.
    pub pass: Vec<String>,
    /// Variables set in the sandbox; they override passed-through ones.
    pub set: BTreeMap<String, String>,
}

impl Default for Env {
    fn default() -> Self {
        Env {
            pass: strings(&[
                "PATH",
                "HOME",
                "USER",
                "LOGNAME",
                "LANG",
                "LC_*",
                "TERM",
                "TZ",
                "RUST_BACKTRACE",
                "CARGO_HOME",
                "RUSTUP_HOME",
            ]),
            set: BTreeMap::new(),
        }
    }
}

/// Kernel enforcement.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Security {
    pub landlock: LandlockMode,
    pub seccomp: bool,
    /// Capabilities a command running as the sandbox's root (uid 0 inside) keeps, within the
    /// sandbox alone: on the native backend inside the sandbox's user namespace (over the
    /// sandbox's own ids), on Docker within the container. Empty by default: every command
    /// runs with none. Only the set a container's root has by default can be named, and none
    /// that reaches beyond the sandbox's own files and processes (see
    /// [`RootCapability`]). Left out of the serialised form (and the hash) when empty.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub root_capabilities: Vec<RootCapability>,
}

/// A capability `security.root_capabilities` may give the sandbox's root: the file-ownership
/// and identity ones package managers and `adduser` need, as in a container's default set.
/// `sys_admin`, `net_admin`, `net_raw`, `mknod`, `sys_ptrace` and the rest are not
/// expressible.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "snake_case")]
pub enum RootCapability {
    /// change a file's owner and group (`chown`)
    Chown,
    /// read, write and search any file of the sandbox whatever its mode
    DacOverride,
    /// act as the owner of any file (`chmod`, `utime` on others' files)
    Fowner,
    /// keep set-id bits when changing a file
    Fsetid,
    /// signal processes of other users of the sandbox
    Kill,
    /// switch to another user or group of the sandbox (`su`, `setpriv`)
    Setuid,
    Setgid,
    /// bind ports below 1024 inside the sandbox's own network
    NetBindService,
}

impl RootCapability {
    /// Every capability, in the order of the kernel's numbers.
    pub const ALL: [RootCapability; 8] = [
        RootCapability::Chown,
        RootCapability::DacOverride,
        RootCapability::Fowner,
        RootCapability::Fsetid,
        RootCapability::Kill,
        RootCapability::Setgid,
        RootCapability::Setuid,
        RootCapability::NetBindService,
    ];

    /// The kernel's number of the capability (`linux/capability.h`).
    pub fn number(self) -> u32 {
        match self {
            RootCapability::Chown => 0,
            RootCapability::DacOverride => 1,
            RootCapability::Fowner => 3,
            RootCapability::Fsetid => 4,
            RootCapability::Kill => 5,
            RootCapability::Setgid => 6,
            RootCapability::Setuid => 7,
            RootCapability::NetBindService => 10,
        }
    }

    /// The name Docker and capabilities(7) use, without `CAP_` (`CHOWN`, `DAC_OVERRIDE`).
    pub fn kernel_name(self) -> &'static str {
        match self {
            RootCapability::Chown => "CHOWN",
            RootCapability::DacOverride => "DAC_OVERRIDE",
            RootCapability::Fowner => "FOWNER",
            RootCapability::Fsetid => "FSETID",
            RootCapability::Kill => "KILL",
            RootCapability::Setgid => "SETGID",
            RootCapability::Setuid => "SETUID",
            RootCapability::NetBindService => "NET_BIND_SERVICE",
        }
    }
}

impl Default for Security {
    fn default() -> Self {
        Security {
            landlock: LandlockMode::Required,
            seccomp: true,
            root_capabilities: Vec::new(),
        }
    }
}

/// What to do when the kernel cannot enforce every Landlock rule.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum LandlockMode {
    /// Fail closed: refuse to run.
    #[default]
    Required,
    /// Degraded mode: run anyway and report the enforcement status.
    BestEffort,
}

/// Where a resolved policy came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicySource {
    /// A profile compiled into taskbox, by name.
    Builtin(&'static str),
    /// A file, given by path or found by name in `$TASKBOX_POLICY_DIR`.
    File(PathBuf),
}

impl fmt::Display for PolicySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicySource::Builtin(name) => write!(f, "built-in policy {name}"),
            PolicySource::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// Finds a policy by name or path and loads it.
///
/// An argument that contains `/` or ends in `.toml` is a path. Otherwise it is a name
/// (`[a-z0-9-]+`), looked up first as `NAME.toml` in `$TASKBOX_POLICY_DIR` (when set), then among
/// the built-in profiles.
pub fn resolve(name_or_path: &str) -> Result<(Policy, PolicySource), PolicyError> {
    resolve_in(name_or_path, policy_dir().as_deref())
}

/// The names [`resolve`] accepts: built-in profiles and `*.toml` files in `$TASKBOX_POLICY_DIR`,
/// sorted.
pub fn available_names() -> Vec<String> {
    available_in(policy_dir().as_deref())
}

fn policy_dir() -> Option<PathBuf> {
    std::env::var_os("TASKBOX_POLICY_DIR")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
}

fn resolve_in(
    name_or_path: &str,
    policy_dir: Option<&Path>,
) -> Result<(Policy, PolicySource), PolicyError> {
    if is_path(name_or_path) {
        let path = PathBuf::from(name_or_path);
        let policy = load_file(&path)?;
        return Ok((policy, PolicySource::File(path)));
    }
    if !is_valid_name(name_or_path) {
        return Err(PolicyError::InvalidName {
            name: name_or_path.to_owned(),
        });
    }
    if let Some(dir) = policy_dir {
        let path = dir.join(format!("{name_or_path}.toml"));
        match read_policy_file(&path) {
            Ok(text) => {
                let policy = parse(&text, &path.display().to_string())?;
                return Ok((policy, PolicySource::File(path)));
            }
            Err(PolicyError::Read { source, .. }) if source.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    if let Some(&(name, text)) = BUILTIN_PROFILES
        .iter()
        .find(|(name, _)| *name == name_or_path)
    {
        let policy = parse(text, &format!("built-in policy {name}"))?;
        return Ok((policy, PolicySource::Builtin(name)));
    }
    Err(PolicyError::UnknownName {
        name: name_or_path.to_owned(),
        available: available_in(policy_dir),
    })
}

fn load_file(path: &Path) -> Result<Policy, PolicyError> {
    let text = read_policy_file(path)?;
    parse(&text, &path.display().to_string())
}

/// Reads a policy file once, refusing what is not a regular file (a FIFO would block the reader,
/// a device would never end) and what is larger than [`POLICY_TEXT_MAX`].
pub fn read_policy_file(path: &Path) -> Result<String, PolicyError> {
    use std::os::unix::fs::OpenOptionsExt;
    let read_err = |source: io::Error| PolicyError::Read {
        path: path.to_owned(),
        source,
    };
    // O_NONBLOCK: opening a FIFO must not wait for a writer; the type check below refuses it.
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(read_err)?;
    let meta = file.metadata().map_err(read_err)?;
    if !meta.is_file() {
        return Err(PolicyError::NotAFile {
            path: path.to_owned(),
        });
    }
    if meta.len() > POLICY_TEXT_MAX as u64 {
        return Err(PolicyError::TooLarge {
            origin: path.display().to_string(),
            bytes: meta.len(),
        });
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    io::Read::read_to_end(
        &mut io::Read::take(&file, POLICY_TEXT_MAX as u64 + 1),
        &mut bytes,
    )
    .map_err(read_err)?;
    if bytes.len() > POLICY_TEXT_MAX {
        return Err(PolicyError::TooLarge {
            origin: path.display().to_string(),
            bytes: bytes.len() as u64,
        });
    }
    String::from_utf8(bytes).map_err(|_| PolicyError::NotText {
        origin: path.display().to_string(),
    })
}

/// Parses policy text given inline (a create request's `policy_toml`), named `origin` in errors.
pub fn parse_inline(text: &str, origin: &str) -> Result<Policy, PolicyError> {
    if text.len() > POLICY_TEXT_MAX {
        return Err(PolicyError::TooLarge {
            origin: origin.to_owned(),
            bytes: text.len() as u64,
        });
    }
    parse(text, origin)
}

/// Whether `arg` names a policy file rather than a profile (see [`resolve`]).
pub fn is_path(arg: &str) -> bool {
    arg.contains('/') || arg.ends_with(".toml")
}

/// Resolves a profile by name only (built-in or in `$TASKBOX_POLICY_DIR`): what a remote client
/// may name. A path is refused without being looked at.
pub fn resolve_profile(name: &str) -> Result<(Policy, PolicySource), PolicyError> {
    if is_path(name) {
        return Err(PolicyError::PathRefused {
            name: name.to_owned(),
        });
    }
    resolve_in(name, policy_dir().as_deref())
}

fn available_in(policy_dir: Option<&Path>) -> Vec<String> {
    let mut names: Vec<String> = BUILTIN_PROFILES
        .iter()
        .map(|(name, _)| (*name).to_owned())
        .collect();
    if let Some(entries) = policy_dir.and_then(|dir| fs::read_dir(dir).ok()) {
        for entry in entries.flatten() {
            let file_name = entry.file_name();
            let Some(stem) = file_name
                .to_str()
                .and_then(|name| name.strip_suffix(".toml"))
            else {
                continue;
            };
            if is_valid_name(stem) {
                names.push(stem.to_owned());
            }
        }
    }
    names.sort();
    names.dedup();
    names
}

fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Parses and validates a policy. `origin` names the text in error messages (usually its path).
pub fn parse(text: &str, origin: &str) -> Result<Policy, PolicyError> {
    // Parse as plain TOML first so syntax errors are reported as such, with line and column.
    if let Err(err) = text.parse::<toml::Table>() {
        let (line, column) = err
            .span()
            .map(|span| line_column(text, span.start))
            .unwrap_or((1, 1));
        return Err(PolicyError::Syntax {
            origin: origin.to_owned(),
            line,
            column,
            message: one_line(err.message()),
        });
    }
    let policy: Policy =
        serde_path_to_error::deserialize(toml::Deserializer::new(text)).map_err(|err| {
            let key = dotted_path(err.path());
            let (key, reason) = explain_de_error(key, err.inner().message());
            PolicyError::Invalid {
                origin: origin.to_owned(),
                key,
                reason,
            }
        })?;
    policy.validate().map_err(|err| err.in_origin(origin))?;
    Ok(policy)
}

/// The dotted key (`a.b[2].c`) a deserialisation error is about (also used for image files).
pub fn dotted_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Map { key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Enum { .. } | Segment::Unknown => {}
        }
    }
    out
}

/// Turns serde's wording into the policy's: the key it is about and why, in one line. Image
/// definitions (`taskbox-image`) word their errors the same way.
pub fn explain_de_error(key: String, message: &str) -> (String, String) {
    let message = one_line(message);
    if let Some(rest) = message.strip_prefix("unknown field `") {
        let (field, expected) = rest.split_once('`').unwrap_or((rest, ""));
        // The path already ends at the unknown key; fall back to the name when it is empty.
        let key = if key.is_empty() {
            field.to_owned()
        } else {
            key
        };
        let expected = expected
            .trim_start_matches(", expected one of ")
            .trim_start_matches(", expected ")
            .replace('`', "");
        let reason = if expected.is_empty() || expected.starts_with(", there are no fields") {
            "unknown key".to_owned()
        } else {
            format!("unknown key (expected one of {expected})")
        };
        return (key, reason);
    }
    if let Some(rest) = message.strip_prefix("unknown variant `") {
        let (value, expected) = rest.split_once('`').unwrap_or((rest, ""));
        let expected = expected
            .trim_start_matches(", expected one of ")
            .trim_start_matches(", expected ")
            .replace('`', "");
        return (
            key,
            format!("invalid value \"{value}\" (expected one of {expected})"),
        );
    }
    let mut reason = message.replace('`', "");
    for (from, to) in [
        ("expected u64", "expected a non-negative integer"),
        ("expected u32", "expected a non-negative integer"),
        ("expected f64", "expected a number"),
        ("expected a sequence", "expected an array"),
        ("expected a map", "expected a table"),
        ("wanted string or table", "invalid type: expected a string"),
    ] {
        reason = reason.replace(from, to);
    }
    if let Some(at) = reason.find("expected struct ") {
        reason.replace_range(at.., "expected a table");
    }
    let key = if key.is_empty() {
        "(top level)".to_owned()
    } else {
        key
    };
    (key, reason)
}

/// A multi-line parser message as one line (its lines joined by "; ").
pub fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// The 1-based line and column (in characters) of byte `offset` in `text`.
pub fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before
        .rsplit('\n')
        .next()
        .map_or(0, |last| last.chars().count())
        + 1;
    (line, column)
}

impl Policy {
    /// Checks the values the TOML types alone cannot: non-zero limits, path shapes, variable
    /// names, network rules that could not apply or would allow everything.
    pub fn validate(&self) -> Result<(), ValidationError> {
        self.filesystem.validate()?;
        self.network.validate()?;
        self.limits.validate()?;
        self.env.validate()?;
        self.commands.validate()?;
        self.validate_secrets()
    }

    fn validate_secrets(&self) -> Result<(), ValidationError> {
        let mut placeholders: BTreeMap<String, &str> = BTreeMap::new();
        for (name, spec) in &self.secrets {
            let key = format!("secrets.{name}");
            if !crate::secrets::is_secret_name(name) {
                return Err(ValidationError::new(
                    key,
                    "a secret's name uses only a-z, 0-9, '-' and '_' (64 at most), beginning \
                     with a letter or digit",
                ));
            }
            if self.network.mode != NetworkMode::Proxy {
                return Err(ValidationError::new(
                    key,
                    format!(
                        "secrets are presented by the egress proxy, and network.mode is \"{}\"; \
                         set mode = \"proxy\"",
                        self.network.mode.as_str()
                    ),
                ));
            }
            spec.validate(&key, &self.env.pass)?;
            let var = spec.placeholder_var(name);
            if let Some(other) = placeholders.insert(var.clone(), name) {
                return Err(ValidationError::new(
                    format!("{key}.placeholder_env"),
                    format!("{var} already holds the placeholder of secrets.{other}"),
                ));
            }
            if self.env.set.contains_key(&var) {
                return Err(ValidationError::new(
                    format!("{key}.placeholder_env"),
                    format!("{var} is also set by env.set; the placeholder needs it"),
                ));
            }
        }
        Ok(())
    }

    /// The secrets and request rules part of [`Policy::explain`].
    fn explain_inspection(&self, line: &mut impl FnMut(String)) {
        if !self.inspects() {
            return;
        }
        let hosts = |patterns: &[HostPattern]| {
            patterns
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        line(
            "  - Inspected hosts (below): the proxy decrypts their HTTPS with a CA made for this \
             sandbox alone (advertised by SSL_CERT_FILE and the like), checks the real server's \
             certificate, and reads every request. Other hosts stay end-to-end encrypted tunnels."
                .to_owned(),
        );
        for (name, spec) in &self.secrets {
            let how = match spec.presentation() {
                crate::secrets::Presentation::Header { name, template } => {
                    format!("as header {name}: {template}")
                }
                crate::secrets::Presentation::Basic { user } => {
                    format!("as basic authentication of user {user:?}")
                }
                crate::secrets::Presentation::Query { name } => {
                    format!("as query parameter {name}")
                }
            };
            let from = match spec.source() {
                crate::secrets::SecretSource::Env(var) => {
                    format!("the supervisor's variable {var}")
                }
                crate::secrets::SecretSource::File(path) => format!("the supervisor's file {path}"),
                crate::secrets::SecretSource::Api => "the create request".to_owned(),
            };
            line(format!(
                "  - Secret {name} (from {from}): presented to {} over HTTPS, {how}. The sandbox \
                 sees only a placeholder in {}, never the value.",
                hosts(&spec.hosts),
                spec.placeholder_var(name)
            ));
        }
        for (index, entry) in self.network.requests.iter().enumerate() {
            let list = |patterns: &[RequestPattern]| {
                patterns
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let mut text = format!("  - Requests to {}:", hosts(&entry.hosts));
            if !entry.allow.is_empty() {
                text.push_str(&format!(" only {}", list(&entry.allow)));
            }
            if !entry.deny.is_empty() {
                if !entry.allow.is_empty() {
                    text.push(';');
                }
                text.push_str(&format!(" never {}", list(&entry.deny)));
            }
            if let Some(reason) = &entry.deny_reason {
                text.push_str(&format!(" (refusals say: {reason})"));
            }
            text.push_str(&format!(" [network.requests[{index}]]."));
            line(text);
        }
    }

    /// Whether the egress proxy inspects some hosts' HTTPS (secrets or request rules): then
    /// the sandbox gets a CA of its own.
    pub fn inspects(&self) -> bool {
        self.network.mode == NetworkMode::Proxy
            && (!self.secrets.is_empty() || !self.network.requests.is_empty())
    }

    /// SHA-256 (lowercase hex) of the policy's canonical JSON: fields in declaration order, maps
    /// sorted, limits as parsed values, the description included. The built-in lists
    /// ([`BUILTIN_DENY_READ`], [`CREDENTIAL_STORES`]) are not part of it. Two files that differ only in comments, layout or how a
    /// size is spelled (`"1GiB"` vs `"1024MiB"`) have the same hash.
    pub fn hash(&self) -> String {
        // Serializing plain structs, strings and numbers to JSON cannot fail.
        let json = serde_json::to_vec(self).unwrap_or_default();
        let digest = Sha256::digest(&json);
        digest.iter().map(|byte| format!("{byte:02x}")).collect()
    }

    /// The host paths no sandbox under this policy may read: the built-in deny list and the
    /// policy's `filesystem.deny_read`.
    pub fn denied_paths(&self) -> impl Iterator<Item = PathBuf> + '_ {
        BUILTIN_DENY_READ
            .iter()
            .map(PathBuf::from)
            .chain(self.filesystem.deny_read.iter().map(PathBuf::from))
    }

    /// A plain-words summary of what a sandbox under this policy may and may not do, for a
    /// person deciding whether to trust it.
    pub fn explain(&self) -> String {
        let mut out = String::new();
        let mut line = |text: String| {
            out.push_str(&text);
            out.push('\n');
        };
        match &self.description {
            Some(description) => line(format!("Policy: {description}")),
            None => line("Policy: (no description)".to_owned()),
        }
        if self.network.mode == NetworkMode::Host {
            line(
                "WARNING: NO NETWORK ISOLATION. Sandboxes under this policy share the host's \
                 network, unfiltered and unrecorded: see Network below."
                    .to_owned(),
            );
        }
        line(format!("Hash: {}", self.hash()));

        line(String::new());
        line("Files".to_owned());
        let fs = &self.filesystem;
        match fs.workspace {
            WorkspaceMode::Overlay => line(
                "  - The workspace is writable through an overlay: changes stay inside the sandbox \
                 and reach your real files only when you export or apply them."
                    .to_owned(),
            ),
            WorkspaceMode::ReadOnly => line(
                "  - The workspace is read-only: commands cannot change any file in it.".to_owned(),
            ),
        }
        if !fs.protected.is_empty() {
            line(format!(
                "  - Always read-only in the workspace: {}.",
                fs.protected.join(", ")
            ));
        }
        line(
            "  - The rest of the host is visible read-only; nothing outside the sandbox can be \
             written. /tmp is private to the sandbox."
                .to_owned(),
        );
        match fs.home {
            HomeMode::Hidden if fs.home_visible.is_empty() => {
                line("  - Home directories are hidden (replaced by an empty directory).".to_owned())
            }
            HomeMode::Hidden => line(format!(
                "  - Home directories are hidden (replaced by an empty directory), except these, \
                 visible read-only: {}.",
                fs.home_visible.join(", ")
            )),
            HomeMode::ReadOnly => line(
                "  - Home directories are visible read-only: commands can read your files there \
                 (but not the credential stores below)."
                    .to_owned(),
            ),
        }
        let shadowed: Vec<&str> = match fs.home {
            HomeMode::Hidden => fs
                .home_visible
                .iter()
                .filter(|entry| is_credential_store(entry))
                .map(String::as_str)
                .collect(),
            HomeMode::ReadOnly => Vec::new(),
        };
        if !shadowed.is_empty() {
            line(format!(
                "  - Listed as visible but still hidden, because they are credential stores: {}.",
                shadowed.join(", ")
            ));
        }
        line(format!(
            "  - Credential stores are always hidden, even inside visible directories: {}.",
            CREDENTIAL_STORES
                .iter()
                .map(|path| format!("~/{path}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        line(format!(
            "  - Always unreadable on the host: {}.",
            BUILTIN_DENY_READ.join(", ")
        ));
        if !fs.deny_read.is_empty() {
            line(format!(
                "  - Also unreadable under this policy: {}.",
                fs.deny_read.join(", ")
            ));
        }

        line(String::new());
        line("Network".to_owned());
        match self.network.mode {
            NetworkMode::None => line(
                "  - Off: no network access at all, only loopback inside the sandbox. Nothing can \
                 be downloaded or sent out."
                    .to_owned(),
            ),
            NetworkMode::Proxy => {
                self.network.explain_proxy(&mut line);
                self.explain_inspection(&mut line);
            }
            NetworkMode::Host => {
                line(
                    "  - WARNING: the sandbox shares the host's network. Commands can reach the \
                     internet, your local network, services listening on this machine and cloud \
                     metadata endpoints, and can send your workspace anywhere."
                        .to_owned(),
                );
                line("  - Use this only for commands you would run outside a sandbox.".to_owned());
            }
        }

        line(String::new());
        line("Limits".to_owned());
        let limits = &self.limits;
        line(format!(
            "  - Memory: {} for the whole sandbox; a command that needs more is killed.",
            human_size(limits.memory_bytes)
        ));
        line(format!(
            "  - Processes and threads: at most {}.",
            limits.pids
        ));
        line(format!("  - CPU: {} cores.", limits.cpu_cores));
        line(format!(
            "  - Largest file a command may write: {}.",
            human_size(limits.file_size_bytes)
        ));
        line(format!(
            "  - Disk: {} in total for what the sandbox writes (its changes to the workspace, \
             /tmp, /var/tmp, /dev/shm, its home, saved output); past it, writes fail with \
             \"no space left on device\" and the result reports the limit.",
            human_size(limits.disk_bytes)
        ));
        line(format!(
            "  - Open files per process: at most {}.",
            limits.open_files
        ));
        line(format!(
            "  - Time: a command is killed with all its processes after {}, unless the caller \
             sets another timeout.",
            humantime::format_duration(limits.timeout)
        ));
        line(format!(
            "  - Output: {} per stream is shown (head and tail); the full stream is saved to a \
             file in the sandbox.",
            human_size(limits.output_bytes)
        ));

        line(String::new());
        line("Environment".to_owned());
        if self.env.pass.is_empty() {
            line("  - No host environment variables are passed in.".to_owned());
        } else {
            line(format!(
                "  - Only these host variables are passed in (* matches a prefix): {}. All \
                 others, including tokens you may have exported, are dropped.",
                self.env.pass.join(", ")
            ));
        }
        if !self.env.set.is_empty() {
            line(format!(
                "  - Set by the policy: {}.",
                self.env.set.keys().cloned().collect::<Vec<_>>().join(", ")
            ));
        }

        line(String::new());
        line("Kernel enforcement".to_owned());
        match self.security.landlock {
            LandlockMode::Required => line(
                "  - Landlock is required: if the kernel cannot enforce every file rule, the \
                 sandbox refuses to start."
                    .to_owned(),
            ),
            LandlockMode::BestEffort => line(
                "  - WARNING: Landlock is best-effort: if the kernel cannot enforce every file \
                 rule, commands run anyway with weaker isolation (the status is reported with \
                 each result)."
                    .to_owned(),
            ),
        }
        if self.security.seccomp {
            line(
                "  - A seccomp filter blocks system calls a build never needs (such as mount, \
                 ptrace, kernel keyrings and bpf)."
                    .to_owned(),
            );
        } else {
            line(
                "  - WARNING: no seccomp filter: every system call the kernel allows an \
                 unprivileged user is available."
                    .to_owned(),
            );
        }
        line(
            "  - Always: no new privileges (setuid binaries do not elevate), all capabilities \
             dropped, own process, IPC and hostname namespaces."
                .to_owned(),
        );

        line(String::new());
        line("Commands".to_owned());
        self.commands.explain(&mut line);
        out
    }
}

impl Filesystem {
    fn validate(&self) -> Result<(), ValidationError> {
        for (index, entry) in self.home_visible.iter().enumerate() {
            let key = format!("filesystem.home_visible[{index}]");
            let Some(rest) = entry.strip_prefix("~/") else {
                return Err(ValidationError::new(
                    key,
                    format!("{entry:?} must start with \"~/\" (a directory in the home directory)"),
                ));
            };
            if rest.trim_matches('/').is_empty() {
                return Err(ValidationError::new(
                    key,
                    format!(
                        "{entry:?} would make the whole home directory visible; use home = \"read-only\" instead"
                    ),
                ));
            }
            check_path_segments(&key, entry, rest)?;
        }
        for (index, entry) in self.deny_read.iter().enumerate() {
            let key = format!("filesystem.deny_read[{index}]");
            if !entry.starts_with('/') {
                return Err(ValidationError::new(
                    key,
                    format!("{entry:?} must be an absolute host path"),
                ));
            }
            if entry.trim_matches('/').is_empty() {
                return Err(ValidationError::new(
                    key,
                    format!("{entry:?} would hide the whole host; list specific paths"),
                ));
            }
            check_path_segments(&key, entry, &entry[1..])?;
        }
        for (index, entry) in self.protected.iter().enumerate() {
            let key = format!("filesystem.protected[{index}]");
            if entry.starts_with('/') || entry.starts_with('~') {
                return Err(ValidationError::new(
                    key,
                    format!("{entry:?} must be relative to the workspace, like .git/hooks"),
                ));
            }
            if entry.contains(['*', '?', '[']) {
                return Err(ValidationError::new(
                    key,
                    format!("{entry:?}: patterns are not supported; list each path"),
                ));
            }
            check_path_segments(&key, entry, entry)?;
        }
        Ok(())
    }
}

/// Refuses empty paths, `.` and `..` components, empty components and NUL bytes in `rest` (the
/// part of `entry` after any prefix).
fn check_path_segments(key: &str, entry: &str, rest: &str) -> Result<(), ValidationError> {
    if entry.contains('\0') {
        return Err(ValidationError::new(key, "path contains a NUL byte"));
    }
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.is_empty() {
        return Err(ValidationError::new(key, "path is empty"));
    }
    for segment in rest.split('/') {
        match segment {
            ".." => {
                return Err(ValidationError::new(
                    key,
                    format!("{entry:?} must not contain \"..\""),
                ));
            }
            "" | "." => {
                return Err(ValidationError::new(
                    key,
                    format!("{entry:?} must be a plain path without empty or \".\" components"),
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

impl Limits {
    fn validate(&self) -> Result<(), ValidationError> {
        let positive = [
            ("limits.memory", self.memory_bytes),
            ("limits.pids", self.pids),
            ("limits.file_size", self.file_size_bytes),
            ("limits.disk", self.disk_bytes),
            ("limits.open_files", self.open_files),
            ("limits.output", self.output_bytes),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(ValidationError::new(key, "must be greater than zero"));
            }
        }
        // Below this a file system cannot hold its own metadata and a few files.
        if self.disk_bytes < MIN_DISK_BYTES {
            return Err(ValidationError::new(
                "limits.disk",
                format!(
                    "{}: must be at least {}",
                    human_size(self.disk_bytes),
                    human_size(MIN_DISK_BYTES)
                ),
            ));
        }
        if !self.cpu_cores.is_finite() || self.cpu_cores <= 0.0 {
            return Err(ValidationError::new(
                "limits.cpu",
                format!(
                    "{} cores: must be a number of cores greater than zero, like 2 or 0.5",
                    self.cpu_cores
                ),
            ));
        }
        if self.timeout.is_zero() {
            return Err(ValidationError::new(
                "limits.timeout",
                "must be greater than zero",
            ));
        }
        Ok(())
    }
}

impl Env {
    fn validate(&self) -> Result<(), ValidationError> {
        for (index, entry) in self.pass.iter().enumerate() {
            let key = format!("env.pass[{index}]");
            let name = entry.strip_suffix('*').unwrap_or(entry);
            if name.is_empty() {
                return Err(ValidationError::new(
                    key,
                    format!(
                        "{entry:?} would pass every host variable, secrets included; list the variables"
                    ),
                ));
            }
            if !is_env_name(name) {
                return Err(ValidationError::new(
                    key,
                    format!(
                        "{entry:?} is not a variable name (letters, digits and _, with an optional trailing *)"
                    ),
                ));
            }
        }
        for (name, value) in &self.set {
            let key = format!("env.set.{name}");
            if !is_env_name(name) {
                return Err(ValidationError::new(
                    key,
                    format!("{name:?} is not a variable name (letters, digits and _)"),
                ));
            }
            if value.contains('\0') {
                return Err(ValidationError::new(key, "value contains a NUL byte"));
            }
        }
        Ok(())
    }
}

/// Whether a `~/`-relative path is a credential store or lies inside one.
fn is_credential_store(entry: &str) -> bool {
    let Some(rest) = entry.strip_prefix("~/") else {
        return false;
    };
    let rest = rest.trim_end_matches('/');
    CREDENTIAL_STORES.iter().any(|store| {
        rest == *store
            || rest
                .strip_prefix(store)
                .is_some_and(|tail| tail.starts_with('/'))
    })
}

fn is_env_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    matches!(bytes.next(), Some(b) if b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|item| (*item).to_owned()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(text: &str) -> String {
        match parse(text, "x.toml") {
            Ok(policy) => panic!("expected an error, parsed {policy:?}"),
            Err(err) => err.to_string(),
        }
    }

    fn assert_error(text: &str, starts_with: &str) {
        let message = error(text);
        assert!(
            message.starts_with(starts_with),
            "error {message:?} should start with {starts_with:?}"
        );
        assert!(!message.contains('\n'), "error {message:?} is not one line");
    }

    #[test]
    fn shipped_profiles_parse_and_validate() {
        for (name, text) in BUILTIN_PROFILES {
            let policy = parse(text, name).unwrap_or_else(|err| panic!("{name}: {err}"));
            policy.validate().unwrap();
        }
    }

    #[test]
    fn default_profile_equals_default_policy() {
        let (policy, source) = resolve_in("default", None).unwrap();
        assert_eq!(source, PolicySource::Builtin("default"));
        assert_eq!(policy, Policy::default());
        assert_eq!(policy.limits.memory_bytes, 4 * GIB);
        assert_eq!(policy.limits.pids, 1024);
        assert_eq!(policy.limits.file_size_bytes, 8 * GIB);
        assert_eq!(policy.limits.disk_bytes, 10 * GIB);
        assert_eq!(policy.limits.timeout, Duration::from_secs(600));
        assert_eq!(policy.limits.output_bytes, MIB);
        assert_eq!(policy.network.mode, NetworkMode::None);
        assert_eq!(policy.security.landlock, LandlockMode::Required);
    }

    #[test]
    fn empty_policy_is_the_default_without_description() {
        let policy = parse("", "empty.toml").unwrap();
        assert_eq!(
            policy,
            Policy {
                description: None,
                ..Policy::default()
            }
        );
    }

    #[test]
    fn read_only_profile_is_stricter() {
        let (policy, source) = resolve_in("read-only", None).unwrap();
        assert_eq!(source, PolicySource::Builtin("read-only"));
        assert_eq!(policy.filesystem.workspace, WorkspaceMode::ReadOnly);
        assert_eq!(policy.limits.memory_bytes, 2 * GIB);
        assert_eq!(policy.limits.pids, 256);
        assert_eq!(policy.limits.timeout, Duration::from_secs(300));
    }

    #[test]
    fn package_registries_profile_allows_only_named_registries_on_web_ports() {
        let (policy, _) = resolve_in("package-registries", None).unwrap();
        assert_eq!(policy.network.mode, NetworkMode::Proxy);
        assert!(policy.network.allow.len() >= 6);
        for pattern in &policy.network.allow {
            assert!(
                matches!(pattern.host, HostMatch::Exact(_)),
                "{pattern}: only exact names, no wildcards or addresses"
            );
            assert!(
                matches!(pattern.port, Some(443) | Some(80)),
                "{pattern}: only ports 443 and 80"
            );
        }
        assert!(policy.network.deny.is_empty() && policy.network.hosts.is_empty());
        let text = policy.explain();
        assert!(
            text.contains("Only through taskbox's egress proxy"),
            "{text}"
        );
        assert!(!text.contains("WARNING"), "{text}");
    }

    #[test]
    fn build_server_profile_is_offline_and_tighter_than_the_default() {
        let (policy, _) = resolve_in("build-server", None).unwrap();
        let default = Policy::default();
        assert_eq!(policy.network.mode, NetworkMode::None);
        let (l, d) = (&policy.limits, &default.limits);
        assert!(l.memory_bytes < d.memory_bytes);
        assert!(l.pids < d.pids);
        assert!(l.cpu_cores < d.cpu_cores);
        assert!(l.file_size_bytes < d.file_size_bytes);
        assert!(l.disk_bytes < d.disk_bytes);
        assert!(l.file_size_bytes <= l.disk_bytes);
        assert!(l.open_files < d.open_files);
        assert!(l.timeout <= d.timeout);
        assert!(l.output_bytes < d.output_bytes);
        assert!(policy.env.pass.len() < default.env.pass.len());
    }

    #[test]
    fn trusted_host_network_profile_warns_first() {
        let (policy, _) = resolve_in("trusted-host-network", None).unwrap();
        assert_eq!(policy.network.mode, NetworkMode::Host);
        let text = policy.explain();
        let first_lines: Vec<&str> = text.lines().take(4).collect();
        assert!(
            first_lines.iter().any(|l| l.starts_with("WARNING")),
            "{text}"
        );
        assert!(text.contains("cloud metadata"), "{text}");
    }

    #[test]
    fn every_shipped_profile_is_listed() {
        let names = available_in(None);
        for name in [
            "default",
            "read-only",
            "package-registries",
            "build-server",
            "trusted-host-network",
        ] {
            assert!(names.iter().any(|n| n == name), "{name} in {names:?}");
        }
    }

    #[test]
    fn resolve_by_path_and_by_name_in_policy_dir() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mine.toml");
        fs::write(&path, "[limits]\nmemory = \"1GiB\"\n").unwrap();

        let (policy, source) = resolve_in(path.to_str().unwrap(), None).unwrap();
        assert_eq!(source, PolicySource::File(path.clone()));
        assert_eq!(policy.limits.memory_bytes, GIB);

        let (policy, source) = resolve_in("mine", Some(dir.path())).unwrap();
        assert_eq!(source, PolicySource::File(path));
        assert_eq!(policy.limits.memory_bytes, GIB);

        // A file in the policy dir overrides a built-in profile of the same name.
        fs::write(dir.path().join("default.toml"), "[limits]\npids = 7\n").unwrap();
        let (policy, source) = resolve_in("default", Some(dir.path())).unwrap();
        assert!(matches!(source, PolicySource::File(_)));
        assert_eq!(policy.limits.pids, 7);

        let message = resolve_in("nope", Some(dir.path()))
            .unwrap_err()
            .to_string();
        assert_eq!(
            message,
            "unknown policy \"nope\" (available: build-server, default, mine, \
             package-registries, read-only, trusted-host-network)"
        );
    }

    #[test]
    fn shipped_files_resolve_by_path_like_the_builtins() {
        // Unit tests run in the crate directory.
        for (name, _) in BUILTIN_PROFILES {
            let path = format!("../../policies/{name}.toml");
            let (from_file, source) = resolve_in(&path, None).unwrap();
            assert_eq!(source, PolicySource::File(PathBuf::from(&path)));
            let (builtin, _) = resolve_in(name, None).unwrap();
            assert_eq!(from_file, builtin);
        }
    }

    #[test]
    fn credential_stores_stay_hidden_when_listed_visible() {
        let policy = parse(
            "[filesystem]\nhome_visible = [\"~/.cargo\", \"~/.ssh\", \"~/.config/gh/\"]\n",
            "x.toml",
        )
        .unwrap();
        let text = policy.explain();
        assert!(
            text.contains(
                "still hidden, because they are credential stores: ~/.ssh, ~/.config/gh/."
            ),
            "{text}"
        );
        assert!(!is_credential_store("~/.cargo"));
        assert!(is_credential_store("~/.cargo/credentials.toml"));
        assert!(!is_credential_store("~/.sshfoo"));
    }

    #[test]
    fn unknown_name_lists_builtin_profiles() {
        let message = resolve_in("strict", None).unwrap_err().to_string();
        assert_eq!(
            message,
            "unknown policy \"strict\" (available: build-server, default, \
             package-registries, read-only, trusted-host-network)"
        );
    }

    #[test]
    fn invalid_name_is_refused() {
        let message = resolve_in("Default", None).unwrap_err().to_string();
        assert!(
            message.starts_with("invalid policy name \"Default\""),
            "{message}"
        );
    }

    #[test]
    fn missing_file_names_the_file() {
        let message = resolve_in("does/not/exist.toml", None)
            .unwrap_err()
            .to_string();
        assert_eq!(
            message,
            "cannot read policy does/not/exist.toml: No such file or directory"
        );
    }

    #[test]
    fn syntax_error_has_line_and_column() {
        let message = error("[limits]\nmemory = \n");
        assert!(message.starts_with("x.toml:2:"), "{message}");
        assert!(message.contains("invalid toml"), "{message}");
        assert!(!message.contains('\n'));
    }

    #[test]
    fn unknown_top_level_key() {
        assert_error(
            "netwrok = 1\n",
            "x.toml: netwrok: unknown key (expected one of description, filesystem, network,",
        );
    }

    #[test]
    fn unknown_nested_key() {
        assert_error(
            "[limits]\nmemroy = \"1GiB\"\n",
            "x.toml: limits.memroy: unknown key (expected one of memory, pids, cpu,",
        );
    }

    #[test]
    fn wrong_type() {
        assert_error(
            "[limits]\npids = \"many\"\n",
            "x.toml: limits.pids: invalid type",
        );
        assert_error(
            "[security]\nseccomp = \"yes\"\n",
            "x.toml: security.seccomp: invalid type",
        );
        assert_error(
            "[filesystem]\nprotected = \".git\"\n",
            "x.toml: filesystem.protected: invalid type",
        );
        assert_error("limits = 5\n", "x.toml: limits: invalid type");
    }

    #[test]
    fn bad_size() {
        assert_eq!(
            error("[limits]\nmemory = \"2 gigs\"\n"),
            "x.toml: limits.memory: invalid size \"2 gigs\": expected bytes or a number with a unit like 512MiB"
        );
        assert_error(
            "[limits]\noutput = -1\n",
            "x.toml: limits.output: invalid size -1",
        );
    }

    #[test]
    fn bad_duration() {
        assert_error(
            "[limits]\ntimeout = \"ten minutes\"\n",
            "x.toml: limits.timeout: invalid duration \"ten minutes\"",
        );
        assert_error(
            "[limits]\ntimeout = 600\n",
            "x.toml: limits.timeout: invalid type",
        );
    }

    #[test]
    fn zero_limits() {
        assert_eq!(
            error("[limits]\ntimeout = \"0s\"\n"),
            "x.toml: limits.timeout: must be greater than zero"
        );
        assert_eq!(
            error("[limits]\npids = 0\n"),
            "x.toml: limits.pids: must be greater than zero"
        );
        assert_error(
            "[limits]\nmemory = 0\n",
            "x.toml: limits.memory: must be greater",
        );
    }

    #[test]
    fn cpu_must_be_positive() {
        assert_error("[limits]\ncpu = 0\n", "x.toml: limits.cpu: 0 cores");
        assert_error("[limits]\ncpu = -1.5\n", "x.toml: limits.cpu: -1.5 cores");
        assert_error("[limits]\ncpu = nan\n", "x.toml: limits.cpu:");
        let policy = parse("[limits]\ncpu = 0.5\n", "x.toml").unwrap();
        assert_eq!(policy.limits.cpu_cores, 0.5);
        let policy = parse("[limits]\ncpu = 3\n", "x.toml").unwrap();
        assert_eq!(policy.limits.cpu_cores, 3.0);
    }

    #[test]
    fn bad_enum_value() {
        assert_eq!(
            error("[network]\nmode = \"wifi\"\n"),
            "x.toml: network.mode: invalid value \"wifi\" (expected one of none, proxy, host)"
        );
        assert_error(
            "[filesystem]\nworkspace = \"rw\"\n",
            "x.toml: filesystem.workspace: invalid value \"rw\"",
        );
    }

    #[test]
    fn enum_of_wrong_type() {
        assert_eq!(
            error("[network]\nmode = 1\n"),
            "x.toml: network.mode: invalid type: expected a string"
        );
    }

    #[test]
    fn proxy_mode_with_rules() {
        let policy = parse(
            "[network]\nmode = \"proxy\"\nallow = [\"Example.com.\", \"*.example.org:443\", \"10.1.0.0/16\"]\n\
             deny = [\"bad.example.org\", \"*:25\"]\n[network.hosts]\n\"pkg.test\" = [\"127.0.0.1\", \"::1\"]\n",
            "x.toml",
        )
        .unwrap();
        assert_eq!(policy.network.mode, NetworkMode::Proxy);
        let allow: Vec<String> = policy.network.allow.iter().map(|p| p.to_string()).collect();
        assert_eq!(allow, ["example.com", "*.example.org:443", "10.1.0.0/16"]);
        assert_eq!(policy.network.deny.len(), 2);
        assert_eq!(
            policy.network.hosts["pkg.test"],
            [
                "127.0.0.1".parse::<IpAddr>().unwrap(),
                "::1".parse().unwrap()
            ]
        );
        // Round trip through both serialisations.
        let toml_text = toml::to_string(&policy).unwrap();
        assert_eq!(parse(&toml_text, "y.toml").unwrap(), policy, "{toml_text}");
        let json = serde_json::to_string(&policy).unwrap();
        assert_eq!(serde_json::from_str::<Policy>(&json).unwrap(), policy);

        let text = policy.explain();
        assert!(
            text.contains("Allowed: example.com, *.example.org:443, 10.1.0.0/16."),
            "{text}"
        );
        assert!(
            text.contains("Refused even when allowed above: bad.example.org, *:25."),
            "{text}"
        );
        assert!(text.contains("WARNING: these address patterns"), "{text}");
        assert!(text.contains("pkg.test -> 127.0.0.1 ::1"), "{text}");
    }

    #[test]
    fn proxy_rules_from_strings_are_checked_like_a_file() {
        let hosts = BTreeMap::from([("pkg.test".to_owned(), vec!["127.0.0.1".to_owned()])]);
        let n = Network::proxy_rules(&["pkg.test:8080".into()], &["*.evil.test".into()], &hosts)
            .unwrap();
        assert_eq!(n.mode, NetworkMode::Proxy);
        assert_eq!(n.allow[0].to_string(), "pkg.test:8080");
        assert_eq!(
            n.hosts["pkg.test"],
            ["127.0.0.1".parse::<IpAddr>().unwrap()]
        );
        let err = Network::proxy_rules(
            &["ok.test".into(), "a.*.test".into()],
            &[],
            &BTreeMap::new(),
        )
        .unwrap_err()
        .to_string();
        assert!(err.starts_with("network.allow[1]: "), "{err}");
        assert!(err.contains("a.*.test"), "{err}");
        let err = Network::proxy_rules(&["*".into()], &[], &BTreeMap::new())
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("network.allow[0]: "), "{err}");
        let bad_hosts = BTreeMap::from([("x.test".to_owned(), vec!["nope".to_owned()])]);
        let err = Network::proxy_rules(&[], &[], &bad_hosts)
            .unwrap_err()
            .to_string();
        assert!(err.contains("network.hosts"), "{err}");
    }

    #[test]
    fn proxy_without_rules_allows_nothing() {
        let policy = parse("[network]\nmode = \"proxy\"\n", "x.toml").unwrap();
        assert!(policy.explain().contains("No host is allowed"));
        // No rules: the serialised form (and so the hash) of the other modes is unchanged.
        let json = serde_json::to_value(&Policy::default().network).unwrap();
        assert_eq!(json, serde_json::json!({"mode": "none"}));
    }

    #[test]
    fn malformed_patterns_name_file_key_and_pattern() {
        assert_eq!(
            error("[network]\nmode = \"proxy\"\nallow = [\"example.com\", \"a.*.example.com\"]\n"),
            "x.toml: network.allow[1]: invalid pattern \"a.*.example.com\": '*' may only be the whole \
             first label, as in *.example.com"
        );
        assert_eq!(
            error("[network]\nmode = \"proxy\"\ndeny = [\"example.com:99999\"]\n"),
            "x.toml: network.deny[0]: invalid pattern \"example.com:99999\": port 99999 is not a \
             number from 1 to 65535"
        );
        assert_error(
            "[network]\nmode = \"proxy\"\nallow = [\"10.0.0.1/8\"]\n",
            "x.toml: network.allow[0]: invalid pattern \"10.0.0.1/8\": host bits are set",
        );
        assert_error(
            "[network]\nmode = \"proxy\"\nallow = [\"https://example.com/\"]\n",
            "x.toml: network.allow[0]: invalid pattern \"https://example.com/\": give a host",
        );
        assert_error(
            "[network]\nmode = \"proxy\"\nallow = [1]\n",
            "x.toml: network.allow[0]: invalid type",
        );
        assert_error(
            "[network]\nmode = \"proxy\"\nallow = \"example.com\"\n",
            "x.toml: network.allow: invalid type",
        );
    }

    #[test]
    fn catch_all_is_refused_in_allow_only() {
        for pattern in ["*", "*:443", "0.0.0.0/0", "::/0"] {
            assert_error(
                &format!("[network]\nmode = \"proxy\"\nallow = [\"x.example\", \"{pattern}\"]\n"),
                &format!("x.toml: network.allow[1]: \"{pattern}\" would allow every host"),
            );
        }
        let policy = parse(
            "[network]\nmode = \"proxy\"\nallow = [\"x.example\"]\ndeny = [\"*\"]\n",
            "x.toml",
        )
        .unwrap();
        assert!(policy.network.deny[0].is_catch_all());
    }

    #[test]
    fn rules_need_proxy_mode() {
        assert_eq!(
            error("[network]\nallow = [\"example.com\"]\n"),
            "x.toml: network.allow: only applies with mode = \"proxy\", and mode is \"none\"; set \
             mode = \"proxy\" or remove the rules"
        );
        assert_error(
            "[network]\nmode = \"host\"\ndeny = [\"example.com\"]\n",
            "x.toml: network.deny: only applies with mode = \"proxy\", and mode is \"host\"",
        );
    }

    #[test]
    fn test_hosts_are_checked() {
        assert_eq!(
            error("[network]\nmode = \"proxy\"\n[network.hosts]\n\"a.test\" = [\"1.2.3\"]\n"),
            "x.toml: network.hosts: \"a.test\": invalid address \"1.2.3\" (expected an IPv4 or IPv6 \
             address)"
        );
        assert_error(
            "[network]\nmode = \"proxy\"\n[network.hosts]\n\"A.test\" = [\"127.0.0.1\"]\n",
            "x.toml: network.hosts.A.test: write the name as \"a.test\"",
        );
        assert_error(
            "[network]\nmode = \"proxy\"\n[network.hosts]\n\"*.test\" = [\"127.0.0.1\"]\n",
            "x.toml: network.hosts.*.test: \"*.test\" contains '*'",
        );
        assert_error(
            "[network]\nmode = \"proxy\"\n[network.hosts]\n\"a.test\" = []\n",
            "x.toml: network.hosts.a.test: lists no address",
        );
        assert_error(
            "[network]\nmode = \"proxy\"\nhosts = { \"a.test\" = \"127.0.0.1\" }\n",
            "x.toml: network.hosts.a.test: invalid type",
        );
    }

    #[test]
    fn unknown_network_key() {
        assert_error(
            "[network]\nmode = \"proxy\"\nallowed = []\n",
            "x.toml: network.allowed: unknown key (expected one of mode, allow, deny, hosts, requests)",
        );
    }

    #[test]
    fn protected_paths_must_be_plain_relative_paths() {
        assert_error(
            "[filesystem]\nprotected = [\".git/hooks\", \"*\"]\n",
            "x.toml: filesystem.protected[1]: \"*\": patterns are not supported",
        );
        assert_error(
            "[filesystem]\nprotected = [\"/etc\"]\n",
            "x.toml: filesystem.protected[0]: \"/etc\" must be relative",
        );
        assert_error(
            "[filesystem]\nprotected = [\"a/../b\"]\n",
            "x.toml: filesystem.protected[0]: \"a/../b\" must not contain \"..\"",
        );
        assert_error(
            "[filesystem]\nprotected = [\"\"]\n",
            "x.toml: filesystem.protected[0]: path is empty",
        );
    }

    #[test]
    fn home_visible_must_be_under_home() {
        assert_error(
            "[filesystem]\nhome_visible = [\".cargo\"]\n",
            "x.toml: filesystem.home_visible[0]: \".cargo\" must start with \"~/\"",
        );
        assert_error(
            "[filesystem]\nhome_visible = [\"~/../etc\"]\n",
            "x.toml: filesystem.home_visible[0]: \"~/../etc\" must not contain \"..\"",
        );
        assert_error(
            "[filesystem]\nhome_visible = [\"~/\"]\n",
            "x.toml: filesystem.home_visible[0]: \"~/\" would make the whole home directory",
        );
    }

    #[test]
    fn deny_read_must_be_absolute() {
        assert_error(
            "[filesystem]\ndeny_read = [\"etc/passwd\"]\n",
            "x.toml: filesystem.deny_read[0]: \"etc/passwd\" must be an absolute host path",
        );
        let policy = parse("[filesystem]\ndeny_read = [\"/srv/secrets\"]\n", "x.toml").unwrap();
        assert_eq!(policy.filesystem.deny_read, ["/srv/secrets"]);
    }

    #[test]
    fn env_names_are_checked() {
        assert_error(
            "[env]\npass = [\"*\"]\n",
            "x.toml: env.pass[0]: \"*\" would pass every host variable",
        );
        assert_error(
            "[env]\npass = [\"A*B\"]\n",
            "x.toml: env.pass[0]: \"A*B\" is not a variable name",
        );
        assert_error(
            "[env]\nset = { \"1X\" = \"y\" }\n",
            "x.toml: env.set.1X: \"1X\" is not a variable name",
        );
        let policy = parse("[env]\nset = { CI = \"1\" }\n", "x.toml").unwrap();
        assert_eq!(policy.env.set.get("CI").map(String::as_str), Some("1"));
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1024"), Ok(1024));
        assert_eq!(parse_size("512MiB"), Ok(512 * MIB));
        assert_eq!(parse_size("2G"), Ok(2 * GIB));
        assert_eq!(parse_size("2 gib"), Ok(2 * GIB));
        assert_eq!(parse_size("1.5GiB"), Ok(GIB + GIB / 2));
        assert_eq!(parse_size("1KB"), Ok(1000));
        assert_eq!(parse_size("3MB"), Ok(3_000_000));
        assert_eq!(parse_size("1K"), Ok(1024));
        assert_eq!(parse_size("10B"), Ok(10));
        assert!(parse_size("").is_err());
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("1.5").is_err());
        assert!(parse_size("1.GiB").is_err());
        assert!(parse_size("1PiB").is_err());
        assert!(parse_size("99999999999TiB").is_err());
        assert_eq!(human_size(4 * GIB), "4 GiB");
        assert_eq!(human_size(GIB + GIB / 2), "1.5 GiB");
        assert_eq!(human_size(512), "512 bytes");
    }

    #[test]
    fn integer_sizes_are_bytes() {
        let policy = parse("[limits]\nmemory = 1048576\n", "x.toml").unwrap();
        assert_eq!(policy.limits.memory_bytes, MIB);
    }

    #[test]
    fn explain_says_what_matters() {
        let text = Policy::default().explain();
        assert!(text.contains("Memory: 4 GiB"), "{text}");
        assert!(
            text.contains("Network\n  - Off: no network access"),
            "{text}"
        );
        assert!(text.contains("~/.ssh"), "{text}");
        assert!(text.contains("/etc/shadow"), "{text}");
        assert!(text.contains("10m"), "{text}");
        assert!(!text.contains("WARNING"), "{text}");

        let mut policy = Policy::default();
        policy.network.mode = NetworkMode::Host;
        policy.security.landlock = LandlockMode::BestEffort;
        let text = policy.explain();
        assert!(
            text.contains("WARNING: the sandbox shares the host's network"),
            "{text}"
        );
        assert!(text.contains("WARNING: Landlock is best-effort"), "{text}");
    }

    #[test]
    fn hash_is_stable_and_tracks_changes() {
        let policy = Policy::default();
        let hash = policy.hash();
        assert_eq!(hash.len(), 64);
        assert!(hash.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(hash, Policy::default().hash());

        // The spelling of a size does not matter, its value does.
        let a = parse("[limits]\nmemory = \"1GiB\"\n", "a.toml").unwrap();
        let b = parse("# comment\n[limits]\nmemory = \"1024 MiB\"\n", "b.toml").unwrap();
        assert_eq!(a.hash(), b.hash());

        let mut changed = Policy::default();
        changed.limits.pids += 1;
        assert_ne!(changed.hash(), hash);
    }

    #[test]
    fn disk_limit_parses_validates_explains_and_hashes() {
        let policy = parse("[limits]\ndisk = \"64MiB\"\n", "d.toml").unwrap();
        policy.validate().unwrap();
        assert_eq!(policy.limits.disk_bytes, 64 * MIB);
        assert_ne!(policy.hash(), Policy::default().hash());
        let text = policy.explain();
        assert!(text.contains("Disk: 64 MiB in total"), "{text}");
        for (value, why) in [
            ("0", "must be greater than zero"),
            ("\"4KiB\"", "must be at least"),
        ] {
            let message = error(&format!("[limits]\ndisk = {value}\n"));
            assert!(message.starts_with("x.toml: limits.disk: "), "{message}");
            assert!(message.contains(why), "{message}");
        }
        assert_error("[limits]\ndisk = \"lots\"\n", "x.toml:");
        assert!(error("[limits]\ndisk = \"lots\"\n").contains("disk"));
    }

    #[test]
    fn command_rules() {
        use crate::commands::Verdict;
        let policy = parse(
            "[commands]\ndefault = \"ask\"\nforbid = [\"git push\", [\"rm\", \"-rf\", \"/\"]]\n\
             ask = [\"git commit -m 'a b'\"]\nallow = [\"cargo test\"]\nask_timeout = \"90s\"\n",
            "x.toml",
        )
        .unwrap();
        let c = &policy.commands;
        assert_eq!(c.default, Verdict::Ask);
        assert_eq!(c.forbid[1].words(), ["rm", "-rf", "/"]);
        assert_eq!(c.ask[0].words(), ["git", "commit", "-m", "a b"]);
        assert_eq!(c.ask_timeout, Duration::from_secs(90));
        // Round trip through both serialisations.
        let toml_text = toml::to_string(&policy).unwrap();
        assert_eq!(parse(&toml_text, "y.toml").unwrap(), policy, "{toml_text}");
        let json = serde_json::to_string(&policy).unwrap();
        assert_eq!(serde_json::from_str::<Policy>(&json).unwrap(), policy);
        assert_ne!(policy.hash(), Policy::default().hash());

        let text = policy.explain();
        assert!(text.contains("\nCommands\n"), "{text}");
        assert!(text.contains("git push, rm -rf /"), "{text}");
        assert!(
            text.contains("Any other command: runs only after a person approves."),
            "{text}"
        );
        let text = Policy::default().explain();
        assert!(text.contains("No command rules"), "{text}");
    }

    #[test]
    fn no_command_rules_keep_the_hash() {
        // A policy that spells out the default section hashes like one without it.
        let spelled = parse(
            "[commands]\ndefault = \"allow\"\nforbid = []\nask_timeout = \"5m\"\n",
            "x.toml",
        )
        .unwrap();
        assert_eq!(spelled.hash(), parse("", "y.toml").unwrap().hash());
        let json = serde_json::to_value(&spelled).unwrap();
        assert!(json.get("commands").is_none(), "{json}");
    }

    #[test]
    fn malformed_command_rules_name_the_pattern() {
        assert_eq!(
            error("[commands]\nforbid = [\"git push\", \"git $REMOTE\"]\n"),
            "x.toml: commands.forbid[1]: invalid command prefix \"git $REMOTE\": it contains an \
             expansion or a pattern (such as $X, $(..), ~, * or {a,b}); quote it, or write the \
             prefix as a list of words"
        );
        assert_eq!(
            error("[commands]\nask = [\"git push && rm\"]\n"),
            "x.toml: commands.ask[0]: invalid command prefix \"git push && rm\": it contains the \
             shell operator \"&&\"; a prefix is one command's words"
        );
        assert_eq!(
            error("[commands]\nallow = [[\"/usr/bin/git\", \"status\"]]\n"),
            "x.toml: commands.allow[0]: invalid command prefix [\"/usr/bin/git\", \"status\"]: the \
             program is matched by its name, whatever directory it runs from: write \"git\", not \
             \"/usr/bin/git\""
        );
        assert_error(
            "[commands]\nforbid = [\"\"]\n",
            "x.toml: commands.forbid[0]: invalid command prefix \"\": it has no words",
        );
        assert_error(
            "[commands]\nforbid = [\"'git push\"]\n",
            "x.toml: commands.forbid[0]: invalid command prefix \"'git push\": a single quote is \
             not closed",
        );
        assert_error(
            "[commands]\nforbid = [[\"git\", \"\"]]\n",
            "x.toml: commands.forbid[0]: invalid command prefix [\"git\", \"\"]: word 2 is empty",
        );
        assert_error(
            "[commands]\nforbid = [1]\n",
            "x.toml: commands.forbid[0]: invalid type",
        );
        assert_error(
            "[commands]\nforbid = \"git push\"\n",
            "x.toml: commands.forbid: invalid type",
        );
        assert_eq!(
            error("[commands]\ndefault = \"deny\"\n"),
            "x.toml: commands.default: invalid value \"deny\" (expected one of allow, ask, forbid)"
        );
        assert_eq!(
            error("[commands]\nask_timeout = \"0s\"\n"),
            "x.toml: commands.ask_timeout: must be greater than zero"
        );
        assert_error(
            "[commands]\nask_timeout = \"soon\"\n",
            "x.toml: commands.ask_timeout: invalid duration \"soon\"",
        );
        assert_eq!(
            error("[commands]\ndeny = []\n"),
            "x.toml: commands.deny: unknown key (expected one of default, forbid, ask, allow, \
             ask_timeout)"
        );
    }

    #[test]
    fn serializes_back_to_the_same_policy() {
        for (name, text) in BUILTIN_PROFILES {
            let policy = parse(text, name).unwrap();
            let toml_text = toml::to_string(&policy).unwrap();
            assert_eq!(parse(&toml_text, name).unwrap(), policy, "{toml_text}");
            let json = serde_json::to_string(&policy).unwrap();
            assert_eq!(serde_json::from_str::<Policy>(&json).unwrap(), policy);
        }
    }

    #[test]
    fn policy_files_are_read_once_bounded_and_only_when_regular() {
        let dir = tempfile::tempdir().unwrap();
        // A FIFO would block a reader until someone writes; it is refused at once.
        let fifo = dir.path().join("fifo.toml");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let started = std::time::Instant::now();
        let e = resolve(fifo.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
        // A device never ends.
        let e = resolve("/dev/zero").unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        let e = resolve("/").unwrap_err().to_string();
        assert!(
            e.contains("not a regular file") || e.contains("cannot read"),
            "{e}"
        );
        // Too large to be a policy: refused by its size, nothing parsed or quoted.
        let big = dir.path().join("big.toml");
        std::fs::write(
            &big,
            format!("# {}\nsecret-line", "x".repeat(POLICY_TEXT_MAX)),
        )
        .unwrap();
        let e = resolve(big.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("at most 262144 bytes"), "{e}");
        assert!(!e.contains("secret-line"), "{e}");
        // Inline text has the same bound.
        let e = parse_inline(&"#".repeat(POLICY_TEXT_MAX + 1), "inline policy")
            .unwrap_err()
            .to_string();
        assert!(e.contains("inline policy") && e.contains("at most"), "{e}");
        // A remote client's name that looks like a path is refused without a look at the file.
        let ok = dir.path().join("ok.toml");
        std::fs::write(&ok, "[limits]\nmemory = \"1GiB\"\n").unwrap();
        assert!(resolve(ok.to_str().unwrap()).is_ok());
        let e = resolve_profile(ok.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("looks like a path"), "{e}");
        assert!(resolve_profile("default").is_ok());
    }

    const PROXY: &str = "[network]\nmode = \"proxy\"\nallow = [\"api.test\"]\n";

    #[test]
    fn secrets_and_request_rules_parse_explain_and_hash() {
        let text = format!(
            "{PROXY}[[network.requests]]\nhosts = [\"pkg.test\"]\nallow = [\"GET /simple/**\"]\n\
             deny = [\"POST\"]\ndeny_reason = \"read-only index\"\n\n[secrets.gh]\n\
             from_env = \"GH_SECRET\"\nhosts = [\"api.test\", \"*.api.test:443\"]\n\
             header = \"Authorization\"\n\n[secrets.index]\nfrom_api = true\nhosts = [\"pkg.test\"]\n\
             basic_user = \"ci\"\nplaceholder_env = \"INDEX_TOKEN\"\n"
        );
        let policy = parse(&text, "x.toml").unwrap();
        assert!(policy.inspects());
        assert_eq!(policy.secrets.len(), 2);
        assert_eq!(
            policy.secrets["gh"].placeholder_var("gh"),
            "TASKBOX_SECRET_GH"
        );
        assert_eq!(policy.network.requests[0].deny[0].to_string(), "POST");
        let explained = policy.explain();
        assert!(explained.contains("Secret gh (from the supervisor's variable GH_SECRET): presented to api.test, *.api.test:443 over HTTPS, as header Authorization: Bearer {secret}"), "{explained}");
        assert!(explained.contains("Requests to pkg.test: only GET /simple/**; never POST (refusals say: read-only index)"), "{explained}");
        // The policy holds no value: what it serialises to parses back to the same policy.
        let back = parse(&toml::to_string(&policy).unwrap(), "back.toml").unwrap();
        assert_eq!(back, policy);
        // Without secrets or rules, the hash is what it was before they existed.
        let plain = parse(PROXY, "x.toml").unwrap();
        assert!(!plain.inspects());
        assert!(!serde_json::to_string(&plain).unwrap().contains("secrets"));
        assert!(!serde_json::to_string(&plain).unwrap().contains("requests"));
    }

    #[test]
    fn bad_secrets_are_refused_naming_the_key() {
        let secret = |body: &str| format!("{PROXY}[secrets.gh]\n{body}\n");
        for (body, key_and_reason) in [
            (
                "from_env = \"T\"\nhosts = [\"*\"]\nheader = \"X-Key\"",
                "x.toml: secrets.gh.hosts[0]: \"*\" would mean every host",
            ),
            (
                "from_env = \"T\"\nhosts = [\"*:443\"]\nheader = \"X-Key\"",
                "x.toml: secrets.gh.hosts[0]: \"*:443\" would mean every host",
            ),
            (
                "from_env = \"T\"\nhosts = [\"10.0.0.0/8\"]\nheader = \"X-Key\"",
                "x.toml: secrets.gh.hosts[0]: \"10.0.0.0/8\" is an address pattern",
            ),
            (
                "from_env = \"T\"\nhosts = [\"api.test\", \"192.0.2.7:443\"]\nheader = \"X-Key\"",
                "x.toml: secrets.gh.hosts[1]: \"192.0.2.7:443\" is an address pattern",
            ),
            (
                "from_env = \"T\"\nhosts = [\"*.com\"]\nheader = \"X-Key\"",
                "x.toml: secrets.gh.hosts[0]: \"*.com\" covers a whole top-level domain",
            ),
            (
                "from_env = \"T\"\nheader = \"X-Key\"",
                "x.toml: secrets.gh.hosts: lists no host",
            ),
            (
                "from_env = \"T\"\nhosts = []\nheader = \"X-Key\"",
                "x.toml: secrets.gh.hosts: lists no host",
            ),
            (
                "hosts = [\"api.test\"]\nheader = \"X-Key\"",
                "x.toml: secrets.gh: give exactly one of from_env, from_file and from_api (it has 0)",
            ),
            (
                "from_env = \"T\"\nfrom_api = true\nhosts = [\"api.test\"]\nheader = \"X-Key\"",
                "x.toml: secrets.gh: give exactly one of from_env, from_file and from_api (it has 2)",
            ),
            (
                "from_env = \"T\"\nhosts = [\"api.test\"]",
                "x.toml: secrets.gh: give exactly one of header, basic_user and query (it has 0)",
            ),
            (
                "from_env = \"T\"\nhosts = [\"api.test\"]\nheader = \"Host\"",
                "x.toml: secrets.gh.header: \"Host\" is not a header a secret may be presented in",
            ),
            (
                "from_env = \"T\"\nhosts = [\"api.test\"]\nheader = \"X-Key\"\nformat = \"token\"",
                "x.toml: secrets.gh.format: must hold {secret} once",
            ),
            (
                "from_env = \"T\"\nhosts = [\"api.test\"]\nquery = \"key\"\nformat = \"{secret}\"",
                "x.toml: secrets.gh.format: only applies with header",
            ),
            (
                "from_file = \"keys/gh\"\nhosts = [\"api.test\"]\nheader = \"X-Key\"",
                "x.toml: secrets.gh.from_file: \"keys/gh\" must be an absolute path",
            ),
            (
                "from_env = \"HOME\"\nhosts = [\"api.test\"]\nheader = \"X-Key\"",
                "x.toml: secrets.gh.from_env: HOME is also passed into the sandbox by env.pass[1]",
            ),
            (
                "from_env = \"T\"\nhosts = [\"api.test\"]\nheader = \"X-Key\"\nplaceholder_env = \"SSL_CERT_FILE\"",
                "x.toml: secrets.gh.placeholder_env: SSL_CERT_FILE is set by taskbox",
            ),
            (
                "from_env = \"T\"\nhosts = [\"api.test\"]\nheader = \"X-Key\"\nvalue = \"x\"",
                "x.toml: secrets.gh.value: unknown key",
            ),
        ] {
            assert_error(&secret(body), key_and_reason);
        }
        assert_error(
            "[secrets.gh]\nfrom_env = \"T\"\nhosts = [\"api.test\"]\nheader = \"X-Key\"\n",
            "x.toml: secrets.gh: secrets are presented by the egress proxy, and network.mode is \"none\"",
        );
        assert_error(
            &format!(
                "{PROXY}[secrets.GH]\nfrom_env = \"T\"\nhosts = [\"api.test\"]\nheader = \"X-Key\"\n"
            ),
            "x.toml: secrets.GH: a secret's name uses only",
        );
        assert_error(
            &format!(
                "{PROXY}[secrets.a]\nfrom_env = \"T\"\nhosts = [\"api.test\"]\nheader = \"X-Key\"\n\
                 placeholder_env = \"K\"\n[secrets.b]\nfrom_env = \"U\"\nhosts = [\"api.test\"]\n\
                 header = \"X-Key\"\nplaceholder_env = \"K\"\n"
            ),
            "x.toml: secrets.b.placeholder_env: K already holds the placeholder of secrets.a",
        );
    }

    #[test]
    fn bad_request_rules_are_refused_naming_the_key() {
        let rules = |body: &str| format!("{PROXY}[[network.requests]]\n{body}\n");
        for (body, key_and_reason) in [
            (
                "hosts = [\"*\"]\nallow = [\"GET\"]",
                "x.toml: network.requests[0].hosts[0]: \"*\" would mean every host",
            ),
            (
                "hosts = [\"10.0.0.0/8\"]\nallow = [\"GET\"]",
                "x.toml: network.requests[0].hosts[0]: \"10.0.0.0/8\" is an address pattern",
            ),
            (
                "allow = [\"GET\"]",
                "x.toml: network.requests[0].hosts: lists no host",
            ),
            (
                "hosts = [\"pkg.test\"]",
                "x.toml: network.requests[0]: has neither allow nor deny",
            ),
            (
                "hosts = [\"pkg.test\"]\nallow = [\"GET /ok\", \"get /x\"]",
                "x.toml: network.requests[0].allow[1]: invalid request pattern \"get /x\": write the method in uppercase: GET",
            ),
            (
                "hosts = [\"pkg.test\"]\ndeny = [\"POST\"]\ndeny_reason = \"\"",
                "x.toml: network.requests[0].deny_reason: must be one line of text",
            ),
            (
                "hosts = [\"pkg.test\"]\ndeny = [\"POST\"]\nreason = \"x\"",
                "x.toml: network.requests[0].reason: unknown key",
            ),
        ] {
            assert_error(&rules(body), key_and_reason);
        }
        assert_error(
            "[[network.requests]]\nhosts = [\"pkg.test\"]\ndeny = [\"POST\"]\n",
            "x.toml: network.requests: only applies with mode = \"proxy\"",
        );
    }
}
