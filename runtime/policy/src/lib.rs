//! taskbox-policy: what a sandbox may do, as data, and the checks that need nothing but a policy.
//!
//! It owns the policy model and its TOML form (the crate root: [`Policy`], [`parse`],
//! [`resolve`], [`Policy::hash`], [`Policy::explain`]), the host patterns of its `[network]`
//! rules ([`netpattern`]), the command rules and their check ([`commands`]) over a static,
//! conservative reading of shell command lines ([`shell`]), the secrets the egress proxy presents
//! for a sandbox ([`secrets`]) and the rules over the HTTP requests of inspected hosts
//! ([`requests`]). It runs nothing and touches no
//! sandbox: the backends, the decorators and the surfaces depend on it.

pub mod commands;
mod error;
pub mod netpattern;
mod policy;
pub mod requests;
pub mod secrets;
pub mod shell;
mod units;

pub use policy::*;
