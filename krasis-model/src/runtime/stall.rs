//! The scheduler's stall report: a thread that notices an engine step running far past any
//! usual step and logs what the step runs and what the engine says it is doing
//! ([`Engine::diagnose`]), so that a hang leaves its evidence in the server's log.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::Engine;

/// A step running this long is reported: the longest normal step is a whole prompt of the
/// largest measured chunk (8192 tokens, seconds on a CPU prefill), well under this.
const STALL_REPORT_AFTER: Duration = Duration::from_secs(30);
/// How often the watching thread looks (a report comes at most this late).
const STALL_CHECK_EVERY: Duration = Duration::from_secs(5);
/// A step still running is reported again after this long.
const STALL_REPEAT_EVERY: Duration = Duration::from_secs(60);

/// The step in flight, shared with the watching thread.
#[derive(Default)]
pub(crate) struct StepWatch {
    cur: Mutex<Option<Step>>,
}

/// What the scheduler is doing, kept as numbers and put in words only for a report.
#[derive(Debug)]
pub(crate) enum Phase {
    /// Opening sessions for waiting requests.
    Admitting { waiting: usize, running: usize },
    /// An engine step: the decoding rows and the prompt chunks' lengths.
    Step { decoding: usize, chunks: Vec<usize> },
    /// Taking a step's tokens (and keeping finished requests' prefixes).
    AfterStep { sequences: usize },
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Phase::Admitting { waiting, running } => {
                write!(f, "admitting {waiting} waiting request(s) beside {running} running")
            }
            Phase::Step { decoding, chunks } => {
                write!(f, "running an engine step of {decoding} decode row(s) and prompt chunks of {chunks:?} tokens")
            }
            Phase::AfterStep { sequences } => {
                write!(f, "after a step of {sequences} sequence(s): their tokens, finished requests' prefixes")
            }
        }
    }
}

struct Step {
    what: Phase,
    started: Instant,
    reported: Option<Instant>,
}

impl StepWatch {
    /// A watch over `engine`'s steps and the thread that reports stalls; the thread ends once
    /// both the watch and the engine are dropped.
    pub fn start(engine: &Arc<dyn Engine>) -> Arc<StepWatch> {
        let watch = Arc::new(StepWatch::default());
        let (w, e) = (Arc::downgrade(&watch), Arc::downgrade(engine));
        let spawned = std::thread::Builder::new().name("krasis-stall-watch".into()).spawn(move || watch_loop(w, e));
        if let Err(err) = spawned {
            tracing::warn!("no stall watch (a stalled step will not be reported): {err}");
        }
        watch
    }

    fn with<R>(&self, f: impl FnOnce(&mut Option<Step>) -> R) -> R {
        f(&mut self.cur.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The scheduler starts `what` (a phase of its loop); ends the
    /// phase before it.
    pub fn begin(&self, what: Phase) {
        let late = self.with(|c| c.replace(Step { what, started: Instant::now(), reported: None }));
        Self::returned(late);
    }

    /// The phase ended.
    pub fn end(&self) {
        let late = self.with(|c| c.take());
        Self::returned(late);
    }

    fn returned(step: Option<Step>) {
        if let Some(s) = step.filter(|s| s.reported.is_some()) {
            tracing::warn!("the scheduler is no longer {} (after {:.1} s)", s.what, s.started.elapsed().as_secs_f64());
        }
    }

    /// The report due now, if any (marks it made).
    fn due(&self, now: Instant) -> Option<String> {
        self.with(|c| {
            let s = c.as_mut()?;
            let ran = now.duration_since(s.started);
            let again = s.reported.is_none_or(|r| now.duration_since(r) >= STALL_REPEAT_EVERY);
            (ran >= STALL_REPORT_AFTER && again).then(|| {
                s.reported = Some(now);
                format!("the scheduler has been {} for {:.0} s", s.what, ran.as_secs_f64())
            })
        })
    }
}

fn watch_loop(watch: Weak<StepWatch>, engine: Weak<dyn Engine>) {
    loop {
        std::thread::sleep(STALL_CHECK_EVERY);
        let Some(w) = watch.upgrade() else { return };
        if let Some(msg) = w.due(Instant::now()) {
            // Said before asking the engine: a driver call there could wait for the stalled one.
            tracing::warn!("{msg}");
            if let Some(state) = engine.upgrade().and_then(|e| e.diagnose()) {
                tracing::warn!("the engine meanwhile: {state}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_is_reported_once_past_the_limit_then_again_after_the_repeat_time() {
        let w = StepWatch::default();
        let t0 = Instant::now();
        assert!(w.due(t0).is_none(), "no step, no report");
        w.begin(Phase::Step { decoding: 3, chunks: vec![] });
        let started = w.with(|c| c.as_ref().unwrap().started);
        assert!(w.due(started + STALL_REPORT_AFTER / 2).is_none());
        let first = w.due(started + STALL_REPORT_AFTER).expect("reported at the limit");
        assert!(first.contains("3 decode row(s)") && first.contains("for 30 s"), "{first}");
        assert!(w.due(started + STALL_REPORT_AFTER + Duration::from_secs(1)).is_none(), "not twice in a row");
        assert!(w.due(started + STALL_REPORT_AFTER + STALL_REPEAT_EVERY).is_some(), "again after the repeat time");
        w.end();
        assert!(w.due(started + STALL_REPORT_AFTER * 10).is_none(), "an ended step is not reported");
    }
}
