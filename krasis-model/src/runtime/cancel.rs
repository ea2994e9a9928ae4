//! A cheap, cloneable cancellation flag, checked between steps.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Cancels a generation from anywhere (another thread, a client disconnect): the generation
/// loop checks it between steps and stops without an error, reporting
/// [`StopReason::Cancelled`](crate::text::generate::StopReason::Cancelled). Clones share the flag.
#[derive(Clone, Debug, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    /// A token that is not cancelled.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks every holder of this token (and its clones) to stop.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether [`CancelToken::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}
