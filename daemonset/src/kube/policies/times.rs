//! How long each step of a policy pass took.

use tracing::info;

/// The steps of a pass that [`PassTimes`] times.
#[derive(Clone, Copy)]
pub(super) enum Step {
    Model,
    Compile,
    Rules,
    Datapath,
    Reconcile,
}

/// How long each step of a pass took: logged for a pass that changed the
/// rules, so that a change's latency can be taken apart (the bench reads
/// these lines).
pub(super) struct PassTimes {
    started: std::time::Instant,
    last: std::time::Instant,
    ms: [f64; 5],
}

impl PassTimes {
    pub(super) fn start() -> Self {
        let now = std::time::Instant::now();
        Self {
            started: now,
            last: now,
            ms: [0.0; 5],
        }
    }

    /// `step` ended now.
    pub(super) fn lap(&mut self, step: Step) {
        let now = std::time::Instant::now();
        self.ms[step as usize] = (now - self.last).as_secs_f64() * 1e3;
        self.last = now;
    }

    pub(super) fn log(&self, isolated: usize) {
        let [model, compile, rules, datapath, reconcile] = self.ms;
        info!(
            isolated,
            model_ms = model,
            compile_ms = compile,
            rules_ms = rules,
            datapath_ms = datapath,
            reconcile_ms = reconcile,
            total_ms = self.started.elapsed().as_secs_f64() * 1e3,
            "NetworkPolicy pass"
        );
    }
}
