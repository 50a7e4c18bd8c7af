//! taskbox's seccomp rules as a Docker seccomp profile (the JSON that `--security-opt
//! seccomp=...` takes), rendered from the same data as the native filter
//! ([`taskbox_protocol::seccomp_rules`]), so both backends refuse the same calls.
//!
//! The profile allows by default and refuses the deny list with `EPERM`; `clone3` gets `ENOSYS`
//! (libc then falls back to `clone`, whose flags are checked). Only the native architecture is
//! listed: a call through another ABI (i386 `int 0x80`, x32) is not in the filter's architecture
//! list and fails; the deny list is written in native numbers and would not apply to it.
//!
//! Argument rules follow the native filter's semantics, which look at the low 32 bits only
//! (the kernel reads these arguments as 32-bit values): every comparison is `SCMP_CMP_MASKED_EQ`
//! with a mask whose high half is zero, so high bits cannot dodge a rule. Docker ORs the entries
//! of one syscall and ANDs the conditions of one entry, and libseccomp allows one condition per
//! argument in an entry; the personality allowlist is therefore written as single-condition
//! entries over its bits (see [`personality_rules`]).

use serde_json::{Value, json};
use taskbox_protocol::seccomp_rules::{
    ALLOWED_PERSONALITIES, CLONE_NAMESPACE_FLAGS, CLONE3, DENIED_IOCTLS, DENIED_SOCKET_FAMILIES,
    DENIED_SYSCALLS,
};

#[cfg(target_arch = "x86_64")]
const ARCH: &str = "SCMP_ARCH_X86_64";
#[cfg(target_arch = "aarch64")]
const ARCH: &str = "SCMP_ARCH_AARCH64";

const EPERM: u32 = libc::EPERM as u32;
const ENOSYS: u32 = libc::ENOSYS as u32;
const LOW32: u64 = 0xffff_ffff;

/// One argument condition: `(arg & mask) == value`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Masked {
    pub index: u32,
    pub mask: u64,
    pub value: u64,
}

fn deny(name: &str, errno: u32, cond: Option<Masked>) -> Value {
    let mut entry = json!({
        "names": [name],
        "action": "SCMP_ACT_ERRNO",
        "errnoRet": errno,
    });
    if let Some(c) = cond {
        entry["args"] = json!([{
            "index": c.index,
            "value": c.mask,
            "valueTwo": c.value,
            "op": "SCMP_CMP_MASKED_EQ",
        }]);
    }
    entry
}

/// Single-condition rules, OR-ed, that refuse `personality(v)` exactly when the low 32 bits of
/// `v` are not in [`ALLOWED_PERSONALITIES`].
///
/// The allowed values are the query value `0xffffffff` plus every combination of a few "free"
/// bits (`0`, `0x8`, `0x20000`, `0x20008`: bits 3 and 17). So: with bit 31 clear, any bit outside
/// the free ones refuses; with bit 31 set, any clear bit refuses (only `0xffffffff` is left). A
/// unit test checks the result against the allowlist.
pub fn personality_rules() -> Vec<Masked> {
    let free = ALLOWED_PERSONALITIES
        .iter()
        .filter(|&&v| v != LOW32)
        .fold(0u64, |acc, v| acc | v);
    let top = 1u64 << 31;
    let mut rules = Vec::new();
    for bit in 0..31 {
        let b = 1u64 << bit;
        if free & b == 0 {
            rules.push(Masked {
                index: 0,
                mask: top | b,
                value: b,
            });
        }
    }
    if ALLOWED_PERSONALITIES.contains(&LOW32) {
        for bit in 0..31 {
            let b = 1u64 << bit;
            rules.push(Masked {
                index: 0,
                mask: top | b,
                value: top,
            });
        }
    } else {
        rules.push(Masked {
            index: 0,
            mask: top,
            value: top,
        });
    }
    rules
}

/// The profile, as Docker's JSON.
pub fn profile() -> Value {
    let mut syscalls: Vec<Value> = vec![json!({
        "names": DENIED_SYSCALLS.iter().map(|(name, _)| *name).collect::<Vec<_>>(),
        "action": "SCMP_ACT_ERRNO",
        "errnoRet": EPERM,
    })];
    syscalls.push(deny(CLONE3.0, ENOSYS, None));
    for flag in CLONE_NAMESPACE_FLAGS {
        let flag = flag as u64 & LOW32;
        syscalls.push(deny(
            "clone",
            EPERM,
            Some(Masked {
                index: 0,
                mask: flag,
                value: flag,
            }),
        ));
    }
    for family in DENIED_SOCKET_FAMILIES {
        syscalls.push(deny(
            "socket",
            EPERM,
            Some(Masked {
                index: 0,
                mask: LOW32,
                value: family as u64,
            }),
        ));
    }
    for request in DENIED_IOCTLS {
        syscalls.push(deny(
            "ioctl",
            EPERM,
            Some(Masked {
                index: 1,
                mask: LOW32,
                value: request & LOW32,
            }),
        ));
    }
    for rule in personality_rules() {
        syscalls.push(deny("personality", EPERM, Some(rule)));
    }
    json!({
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": [ARCH],
        "syscalls": syscalls,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(v: u64) -> bool {
        personality_rules().iter().any(|r| v & r.mask == r.value)
    }

    #[test]
    fn personality_rules_match_the_native_allowlist() {
        let mut samples: Vec<u64> = ALLOWED_PERSONALITIES.to_vec();
        for bit in 0..64 {
            samples.push(1 << bit);
            samples.push(LOW32 ^ (1 << bit));
            samples.push(0x8 | (1 << bit));
        }
        samples.extend([
            0x0040000,
            0x8004_0000,
            0xdead_beef,
            0xffff_ffff_0000_0008,
            7,
            9,
        ]);
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            samples.push(x);
            samples.push(x & 0xffff);
        }
        for v in samples {
            let native_refuses = !ALLOWED_PERSONALITIES.contains(&(v & LOW32));
            assert_eq!(refused(v), native_refuses, "personality({v:#x})");
        }
    }

    #[test]
    fn profile_lists_every_rule_of_the_native_filter() {
        let p = profile();
        assert_eq!(p["defaultAction"], "SCMP_ACT_ALLOW");
        assert_eq!(p["architectures"], json!([ARCH]));
        let entries = p["syscalls"].as_array().unwrap();
        let names: Vec<&str> = entries[0]["names"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap())
            .collect();
        for (name, _) in DENIED_SYSCALLS {
            assert!(names.contains(name), "{name}");
        }
        for must in [
            "ptrace",
            "mount",
            "unshare",
            "setns",
            "keyctl",
            "bpf",
            "io_uring_setup",
        ] {
            assert!(names.contains(&must), "{must}");
        }
        let clone3 = entries.iter().find(|e| e["names"][0] == "clone3").unwrap();
        assert_eq!(clone3["errnoRet"], ENOSYS);
        let clones = entries.iter().filter(|e| e["names"][0] == "clone").count();
        assert_eq!(clones, CLONE_NAMESPACE_FLAGS.len());
        for e in entries.iter().filter(|e| e.get("args").is_some()) {
            assert_eq!(e["args"].as_array().unwrap().len(), 1, "one condition: {e}");
            assert_eq!(e["args"][0]["op"], "SCMP_CMP_MASKED_EQ");
            assert_eq!(e["args"][0]["value"].as_u64().unwrap() >> 32, 0, "{e}");
        }
    }
}
