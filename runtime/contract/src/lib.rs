//! taskbox-contract: the narrow API as types, the one contract every backend, decorator and
//! surface speaks.
//!
//! It owns the operations' requests and answers and the [`api::SandboxApi`] trait with its errors
//! ([`api`]), the operations as data with their names ([`op`]: `Op`, `Answer`, `OpName`, and
//! `OpHandler` for decorators written as one function over operations), the observations agents
//! see ([`result`]: `ExecResult`, changes, violations, enforcement), how an exec ended and the one
//! builder of its result ([`exec_end`]), and an exec request made concrete once, with the limits
//! every backend checks on a command before it runs ([`exec_plan`], [`exec_limits`]). It depends
//! on policies only for the resolved policy a create carries. The users an exec may name are
//! read from a sandbox's own account files by [`accounts`]. A secret's value, which never appears
//! in a log, a message or a trace, is a [`secret::SecretValue`]. What a backend's warm pool holds is counted in the fleet by
//! [`warm::WarmGauge`].

pub mod accounts;
pub mod api;
pub mod exec_end;
pub mod exec_limits;
pub mod exec_plan;
pub mod op;
pub mod result;
pub mod secret;
pub mod support;
pub mod warm;

/// The policy model, as `crate::policy` for the contract's own modules.
pub(crate) use taskbox_policy as policy;
