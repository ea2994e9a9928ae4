//! `KRASIS_GPU_PROFILE=1`: where a GPU forward's device time goes, from CUDA events recorded on
//! the compute stream between the parts of each layer. Reading them needs the stream to have
//! passed them, which the step's read-back of the sampled id already guarantees, so profiling adds
//! no synchronisation of its own.

use krasis_gpu::cudarc::driver::CudaEvent;
use krasis_gpu::GpuDevice;

use crate::error::Result;

/// The parts a forward call is split into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    /// Embedding, positions, first norm.
    Start = 0,
    Attention = 1,
    Ffn = 2,
    /// Final norm, LM head and sampling.
    Head = 3,
}

const PARTS: usize = 4;

pub(crate) struct StepProfile {
    /// Events in recording order with the part that *ends* at each.
    events: Vec<(CudaEvent, Part)>,
    used: usize,
    /// Device milliseconds per part, and forward calls, since the session began.
    ms: [f64; PARTS],
    calls: u64,
    /// When the open call's first event was recorded, and the host milliseconds from there to
    /// its `Head` mark (everything enqueued, before the read-back), summed over the calls.
    opened: Option<std::time::Instant>,
    host_ms: f64,
}

impl StepProfile {
    /// `Some` when `KRASIS_GPU_PROFILE=1`.
    pub fn from_env() -> Option<StepProfile> {
        krasis_core::knobs::knobs().gpu_profile.then(|| StepProfile {
            events: Vec::new(),
            used: 0,
            ms: [0.0; PARTS],
            calls: 0,
            opened: None,
            host_ms: 0.0,
        })
    }

    /// Records an event ending `part` (the first mark of a call starts it).
    pub fn mark(&mut self, dev: &GpuDevice, part: Part) -> Result<()> {
        if self.used == 0 {
            self.opened = Some(std::time::Instant::now());
        }
        if part == Part::Head {
            if let Some(t) = self.opened.take() {
                self.host_ms += t.elapsed().as_secs_f64() * 1e3;
            }
        }
        if self.used == self.events.len() {
            self.events.push((dev.new_event(true)?, part));
        }
        let slot = &mut self.events[self.used];
        slot.1 = part;
        slot.0.record(dev.stream()).map_err(|e| crate::ModelError::Invalid(format!("cuEventRecord: {e}")))?;
        self.used += 1;
        Ok(())
    }

    /// Adds the finished call's intervals (the stream must have passed its last event).
    pub fn close_call(&mut self) -> Result<()> {
        for w in self.events[..self.used].windows(2) {
            let ms = w[0]
                .0
                .elapsed_ms(&w[1].0)
                .map_err(|e| crate::ModelError::Invalid(format!("cuEventElapsedTime: {e}")))?;
            self.ms[w[1].1 as usize] += ms as f64;
        }
        self.used = 0;
        self.calls += 1;
        Ok(())
    }

    /// One line: device ms per call for each part.
    pub fn summary(&self) -> String {
        let n = self.calls.max(1) as f64;
        format!(
            "GPU profile over {} calls, device ms per call: start {:.3}, attention {:.3}, ffn {:.3}, head+sampling {:.3}, total {:.3}; host enqueue {:.3}",
            self.calls,
            self.ms[0] / n,
            self.ms[1] / n,
            self.ms[2] / n,
            self.ms[3] / n,
            self.ms.iter().sum::<f64>() / n,
            self.host_ms / n
        )
    }
}
