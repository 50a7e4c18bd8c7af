//! Build progress, reported as events; the CLI renders them (a live line on a terminal, plain
//! lines otherwise). The library itself never prints.

/// What a build is doing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Layer `index` (1-based) of `total` starts: `what` describes it.
    StepStarted {
        index: usize,
        total: usize,
        what: String,
    },
    /// A line of output from the step's tool (mmdebstrap's stages, a run step's output).
    Output { index: usize, line: String },
    /// Layer `index` is done.
    StepDone {
        index: usize,
        cached: bool,
        layer: String,
        size: u64,
        millis: u128,
    },
}

/// Receives build events.
pub trait Progress: Send + Sync {
    fn event(&self, event: Event);
}

/// Ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct Silent;

impl Progress for Silent {
    fn event(&self, _event: Event) {}
}

/// Forwards events to a closure.
pub struct FnProgress<F: Fn(Event) + Send + Sync>(pub F);

impl<F: Fn(Event) + Send + Sync> Progress for FnProgress<F> {
    fn event(&self, event: Event) {
        (self.0)(event)
    }
}

impl<F: Fn(Event) + Send + Sync> std::fmt::Debug for FnProgress<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FnProgress")
    }
}
