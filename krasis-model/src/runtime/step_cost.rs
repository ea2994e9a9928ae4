//! What a scheduler step's prompt tokens cost: a fixed part per step plus a part per token,
//! fitted online (least squares over the steps that ran prompt tokens, older ones decaying). The
//! scheduler sizes its measured chunks from it.
//!
//! Why two parts: a streaming hybrid prefill copies every routed expert to the GPU once per call,
//! whatever the call's length (V2-Lite on the H200: about 0.14 s). A rate alone (past prompt
//! tokens over past step seconds) fell as chunks shrank, which shrank the next chunks: beside 28
//! decoding streams the chunks sat at the 64-token floor, each paying the whole copy, and 8K-token
//! prompts waited 19–76 s for their first token (bench/logs/2026-11-29/h200-serve-s32.log).

/// Weight an earlier step keeps at each new one: the fit follows about the last 20 steps (a
/// batch that grows or a context that lengthens changes the cost within a few dozen steps).
const DECAY: f64 = 0.95;

/// Steps whose lengths spread less than this fraction of their mean cannot tell the fixed part
/// from the per-token one: the fit then falls back to the rate alone.
const MIN_SPREAD: f64 = 0.1;

/// Decayed sums over the observed `(tokens, seconds)` of prompt steps.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepCost {
    w: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    steps: usize,
}

impl StepCost {
    /// A step that ran `tokens` prompt tokens in `seconds` (its decode rows' share taken out by
    /// the caller). Empty or unmeasurable steps are ignored.
    pub fn observe(&mut self, tokens: usize, seconds: f64) {
        if tokens == 0 || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let x = tokens as f64;
        self.w = self.w * DECAY + 1.0;
        self.sx = self.sx * DECAY + x;
        self.sy = self.sy * DECAY + seconds;
        self.sxx = self.sxx * DECAY + x * x;
        self.sxy = self.sxy * DECAY + x * seconds;
        self.steps += 1;
    }

    /// `(fixed seconds per step, seconds per token)` when the steps seen differ enough in length
    /// to separate the two and the per-token part comes out positive; `None` otherwise.
    pub fn fit(&self) -> Option<(f64, f64)> {
        if self.steps < 2 {
            return None;
        }
        let (mx, my) = (self.sx / self.w, self.sy / self.w);
        let var = self.sxx / self.w - mx * mx;
        if var <= (MIN_SPREAD * mx).powi(2) {
            return None;
        }
        let per_token = (self.sxy / self.w - mx * my) / var;
        if !per_token.is_finite() || per_token <= 0.0 {
            return None;
        }
        Some(((my - per_token * mx).clamp(0.0, my), per_token))
    }

    /// The fixed part of [`StepCost::fit`] (0 when it cannot be told apart).
    pub fn fixed_seconds(&self) -> f64 {
        self.fit().map_or(0.0, |(fixed, _)| fixed)
    }

    /// The prompt tokens that `seconds` of a step's prompt time has room for: after the fixed
    /// part at the fitted rate, else at the plain rate of the steps seen; `None` before any step.
    pub fn tokens_for(&self, seconds: f64) -> Option<f64> {
        match self.fit() {
            Some((fixed, per_token)) => Some((seconds - fixed).max(0.0) / per_token),
            None if self.sy > 0.0 => Some(seconds * self.sx / self.sy),
            None => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn recovers_a_fixed_part_and_a_rate() {
        let mut c = StepCost::default();
        assert_eq!(c.tokens_for(1.0), None);
        for n in [512usize, 2000, 64, 8192, 700] {
            c.observe(n, 0.14 + n as f64 * 5e-5);
        }
        let (fixed, per_token) = c.fit().unwrap();
        assert!(close(fixed, 0.14) && close(per_token, 5e-5), "{fixed} {per_token}");
        assert!(close(c.tokens_for(0.24).unwrap(), 2000.0));
        assert_eq!(c.tokens_for(0.1), Some(0.0), "less than the fixed part leaves no room");
    }

    #[test]
    fn equal_lengths_fall_back_to_the_rate() {
        let mut c = StepCost::default();
        c.observe(1000, 1.0);
        assert!(c.fit().is_none(), "one step cannot separate the parts");
        assert!(close(c.tokens_for(2.0).unwrap(), 2000.0));
        c.observe(1000, 0.5);
        assert!(c.fit().is_none());
        assert_eq!(c.fixed_seconds(), 0.0);
        // A slope that comes out negative (noise) is not used either.
        let mut d = StepCost::default();
        d.observe(100, 1.0);
        d.observe(1000, 0.5);
        assert!(d.fit().is_none());
        assert!(d.tokens_for(1.0).unwrap() > 0.0);
    }

    #[test]
    fn ignores_empty_steps_and_follows_a_change() {
        let mut c = StepCost::default();
        c.observe(0, 1.0);
        c.observe(10, f64::NAN);
        assert_eq!(c.tokens_for(1.0), None);
        for i in 0..40 {
            let n = 200 + 300 * (i % 4);
            c.observe(n, 0.1 + n as f64 * 1e-4);
        }
        // The cost doubles: within a few dozen steps the fit is near the new one.
        for i in 0..60 {
            let n = 200 + 300 * (i % 4);
            c.observe(n, 0.2 + n as f64 * 2e-4);
        }
        let (fixed, per_token) = c.fit().unwrap();
        assert!((fixed - 0.2).abs() < 0.02 && (per_token - 2e-4).abs() < 2e-5, "{fixed} {per_token}");
    }
}
