//! What the GPU engine's forward call is doing, for the scheduler's stall report
//! ([`crate::runtime::Engine::diagnose`]): the call's kind and size, the phase the launching
//! thread is in, and the hybrid hand-off's flags, whose values say how far the stream got.
//! A few lock-and-store updates per call; read only when a step runs far past its usual time.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use krasis_gpu::HostFlag;

/// The current (or last) forward call.
#[derive(Default)]
pub(crate) struct CallWatch {
    cur: Mutex<Option<Current>>,
}

struct Current {
    what: String,
    phase: &'static str,
    since: Instant,
    phase_since: Instant,
    /// `ready` and `go` of the call's hand-offs and the last sequence number handed out before
    /// the call (hybrid).
    flags: Option<(Arc<HostFlag>, Arc<HostFlag>, u64)>,
}

impl CallWatch {
    fn with(&self, f: impl FnOnce(&mut Option<Current>)) {
        f(&mut self.cur.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// A forward call starts.
    pub fn begin(&self, what: String) {
        let now = Instant::now();
        self.with(|c| *c = Some(Current { what, phase: "starting", since: now, phase_since: now, flags: None }));
    }

    /// The launching thread moves on to `phase`.
    pub fn phase(&self, phase: &'static str) {
        self.with(|c| {
            if let Some(c) = c.as_mut() {
                (c.phase, c.phase_since) = (phase, Instant::now());
            }
        });
    }

    /// The hand-off flags of this call (hybrid), with the sequence number before its first.
    pub fn flags(&self, flags: Option<(Arc<HostFlag>, Arc<HostFlag>, u64)>) {
        self.with(|c| {
            if let Some(c) = c.as_mut() {
                c.flags = flags;
            }
        });
    }

    /// One line: the call, its phase and the flags.
    pub fn describe(&self) -> String {
        let cur = self.cur.lock().unwrap_or_else(|p| p.into_inner());
        let Some(c) = cur.as_ref() else { return "no forward call yet".into() };
        let mut s = format!(
            "last forward call: {} ({:.1} s ago), launcher {} (for {:.1} s)",
            c.what,
            c.since.elapsed().as_secs_f64(),
            c.phase,
            c.phase_since.elapsed().as_secs_f64()
        );
        if let Some((ready, go, before)) = &c.flags {
            s += &format!("; hand-offs after #{before}: ready flag {}, go flag {}", ready.load(), go.load());
        }
        s
    }
}
