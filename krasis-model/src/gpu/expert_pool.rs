//! The seeds' copy-on-demand residency strategies for the hybrid engine (#9 item 4):
//! `--cache-strategy active_only | static_pin | weighted_pin | lru`. One mechanism serves all four:
//! a pool of VRAM slots, each holding one `(MoE layer, expert)` record in the GPU layout, and a
//! residency table saying which pair each slot holds.
//!
//! Per MoE call below the full-streaming prompt length (decode and short prompts; longer prompts
//! stream every layer, [`super::expert_stream`]) the router publishes its routes to the host as
//! for the CPU experts (`host_experts`); the launching thread waits for them, admits the
//! experts they touch into the pool — enqueueing copies of the missing ones from the page-locked
//! records on the streamer's copy stream, which the compute stream then waits for by event — and
//! writes the layer's id → slot map into mapped memory. The stream renumbers the routes by that
//! map and runs the GPU's MoE kernels over the pool as if it were one layer of `slots` experts:
//! the same kernels and records as the resident experts, so the logits are the resident GPU
//! experts' bit for bit. (A first version had the expert thread do the copies while the stream
//! waited on a host flag; on v2-lite it hung: the copies queued behind that wait.)
//!
//! What the strategies differ in:
//! - `active_only`: no pins, one layer's worth of slots, nothing kept between calls: each call
//!   copies exactly what it touches (no wasted transfers, no reuse).
//! - `static_pin`: `active_only` plus the heatmap's globally hottest pairs pinned for the model's
//!   life ([`super::hot_experts::choose_pinned`]).
//! - `weighted_pin`: the same, the pins shared out per layer by how concentrated its routes are
//!   ([`super::hot_experts::choose_weighted`]).
//! - `lru`: every slot a cache entry shared across layers; a miss evicts the least recently used
//!   pair that the current call does not need.
//!
//! Safety of reuse: the launcher sees layer `l`'s routes only once the stream reached layer `l`'s
//! router, after every earlier kernel (in particular the previous MoE calls reading the pool), so
//! any slot the current call does not touch may be overwritten.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};

use krasis_gpu::moe::GpuExperts;
use krasis_gpu::{DeviceBuffer, GpuDevice, MappedHost};

use super::expert_stream::ExpertStreamer;
use super::CacheStrategy;
use crate::error::{ModelError, Result};

/// Which `(MoE layer, expert)` each slot of the pool holds, and which slots may be given to
/// another pair: free ones first, then the least recently used unpinned one not touched by the
/// current call.
#[derive(Debug)]
pub struct Residency {
    /// Experts per MoE layer.
    n: usize,
    /// `[li · n + e]` → slot, or −1.
    slot_of: Vec<i32>,
    /// Slot → `li · n + e`, or `None`.
    owner: Vec<Option<usize>>,
    pinned: Vec<bool>,
    stamp: Vec<u64>,
    /// Unpinned occupied slots by last use.
    lru: BTreeSet<(u64, usize)>,
    free: Vec<usize>,
    clock: u64,
    /// Whether unpinned entries outlive the call that copied them (`lru`).
    keep: bool,
}

impl Residency {
    /// `slots` empty slots for `layers` MoE layers of `n` experts.
    pub fn new(layers: usize, n: usize, slots: usize, keep: bool) -> Self {
        Residency {
            n,
            slot_of: vec![-1; layers * n],
            owner: vec![None; slots],
            pinned: vec![false; slots],
            stamp: vec![0; slots],
            lru: BTreeSet::new(),
            free: (0..slots).rev().collect(),
            clock: 0,
            keep,
        }
    }

    pub fn slots(&self) -> usize {
        self.owner.len()
    }

    /// Pins expert `e` of MoE layer `li` into a free slot for good; returns the slot.
    pub fn pin(&mut self, li: usize, e: usize) -> std::result::Result<usize, String> {
        let key = self.key(li, e)?;
        if self.slot_of[key] >= 0 {
            return Err(format!("expert {e} of MoE layer {li} is pinned twice"));
        }
        let slot = self
            .free
            .pop()
            .ok_or_else(|| format!("no free slot of {} to pin expert {e} of MoE layer {li}", self.slots()))?;
        self.place(key, slot);
        self.pinned[slot] = true;
        Ok(slot)
    }

    fn key(&self, li: usize, e: usize) -> std::result::Result<usize, String> {
        if e >= self.n || li * self.n + e >= self.slot_of.len() {
            return Err(format!(
                "expert {e} of MoE layer {li}: the pool serves {} layers of {}",
                self.slot_of.len() / self.n.max(1),
                self.n
            ));
        }
        Ok(li * self.n + e)
    }

    fn place(&mut self, key: usize, slot: usize) {
        self.owner[slot] = Some(key);
        self.slot_of[key] = slot as i32;
        self.stamp[slot] = self.clock;
    }

    fn release(&mut self, slot: usize) {
        if let Some(key) = self.owner[slot].take() {
            self.slot_of[key] = -1;
        }
        self.lru.remove(&(self.stamp[slot], slot));
    }

    /// One call of MoE layer `li` touching the distinct experts `touched`: afterwards each has a
    /// slot. Returns the `(expert, slot)` pairs to copy in (the misses), in `touched` order. Fails,
    /// changing nothing that matters, when the unpinned slots cannot hold the call.
    pub fn admit(&mut self, li: usize, touched: &[usize]) -> std::result::Result<Vec<(usize, usize)>, String> {
        self.clock += 1;
        let now = self.clock;
        if !self.keep {
            let dynamic: Vec<usize> = self.lru.iter().map(|&(_, s)| s).collect();
            for s in dynamic {
                self.release(s);
                self.free.push(s);
            }
        }
        // Hits first, so that no miss evicts an expert this call needs.
        for &e in touched {
            let key = self.key(li, e)?;
            let slot = self.slot_of[key];
            if slot >= 0 {
                let slot = slot as usize;
                if !self.pinned[slot] {
                    self.lru.remove(&(self.stamp[slot], slot));
                    self.lru.insert((now, slot));
                }
                self.stamp[slot] = now;
            }
        }
        let mut copies = Vec::new();
        for &e in touched {
            let key = self.key(li, e)?;
            if self.slot_of[key] >= 0 {
                continue;
            }
            let slot = match self.free.pop() {
                Some(s) => s,
                None => match self.lru.first().copied() {
                    Some((stamp, s)) if stamp < now => {
                        self.release(s);
                        s
                    }
                    _ => {
                        return Err(format!(
                        "MoE layer {li}'s call touches {} experts; the pool's {} slots ({} pinned) cannot hold them",
                        touched.len(),
                        self.slots(),
                        self.pinned.iter().filter(|&&p| p).count()
                    ))
                    }
                },
            };
            self.place(key, slot);
            self.lru.insert((now, slot));
            copies.push((e, slot));
        }
        Ok(copies)
    }

    /// Forgets the pairs `copies` placed (their copies could not be enqueued): their slots become
    /// free, so no later call takes them for present.
    pub fn forget(&mut self, copies: &[(usize, usize)]) {
        for &(_, slot) in copies {
            self.release(slot);
            self.free.push(slot);
        }
    }

    /// Slot of each expert of MoE layer `li` (−1: not in the pool).
    pub fn slots_of(&self, li: usize) -> &[i32] {
        &self.slot_of[li * self.n..(li + 1) * self.n]
    }
}

/// An expert pool's size (what its calls copy is counted per session, in
/// [`crate::runtime::HandoffStats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PoolStats {
    pub slots: usize,
    pub pinned: usize,
    /// VRAM of the pool.
    pub bytes: usize,
}

/// What one [`ExpertPool::fetch`] did.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fetched {
    pub touched: usize,
    pub copied: usize,
    pub bytes: usize,
}

/// The VRAM slots of one copy-on-demand strategy (module docs).
pub struct ExpertPool {
    strategy: CacheStrategy,
    streamer: Arc<ExpertStreamer>,
    experts: Mutex<GpuExperts>,
    state: Mutex<Residency>,
    pinned: usize,
    /// Share of the heatmap's routes the pinned experts take (0 without pins).
    pinned_route_share: f64,
    /// The current call's expert → slot map: written by the launching thread once the routes are
    /// published, copied to `map_dev` by the stream after.
    map_host: MappedHost<i32>,
    map_dev: Mutex<DeviceBuffer<i32>>,
    /// Recorded on the copy stream after a call's copies; the compute stream waits for it.
    copied_event: krasis_gpu::cudarc::driver::CudaEvent,
}

impl std::fmt::Debug for ExpertPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertPool").field("strategy", &self.strategy).field("pinned", &self.pinned).finish()
    }
}

impl ExpertPool {
    /// The strategy the pool keeps its experts by.
    pub fn strategy(&self) -> CacheStrategy {
        self.strategy
    }

    /// A pool of `pins`' experts (per MoE layer of the cache, pinned for good and copied in now)
    /// plus `dynamic` slots for the calls' other experts.
    pub fn new(
        dev: &GpuDevice,
        streamer: Arc<ExpertStreamer>,
        strategy: CacheStrategy,
        pins: &[Vec<usize>],
        dynamic: usize,
        pinned_route_share: f64,
    ) -> Result<Self> {
        let (layers, n) = (streamer.moe_layers(), streamer.n_experts());
        let pinned: usize = pins.iter().map(Vec::len).sum();
        let slots = pinned + dynamic;
        if dynamic < n {
            return Err(ModelError::Invalid(format!(
                "`CachePlan::strategy` {}: {} of VRAM holds {dynamic} experts besides the pinned ones, fewer than one MoE layer's {n} (raise the pinned experts' VRAM, `CachePlan::vram`, or the VRAM budget, `GpuOptions::vram_budget`)",
                strategy.name(),
                krasis_core::budget::format_bytes((dynamic * streamer.record_bytes().unwrap_or(0)) as u64)
            )));
        }
        if slots > krasis_gpu::moe::MOE_MAX_EXPERTS {
            return Err(ModelError::Invalid(format!(
                "`CachePlan::strategy` {}: {slots} expert slots, at most {} supported (lower the pinned experts' VRAM, `CachePlan::vram`)",
                strategy.name(),
                krasis_gpu::moe::MOE_MAX_EXPERTS
            )));
        }
        let mut state = Residency::new(layers, n, slots, strategy == CacheStrategy::Lru);
        let mut experts = streamer.new_records(dev, &format!("{} expert pool", strategy.name()), slots, slots)?;
        for (li, ids) in pins.iter().enumerate() {
            for &e in ids {
                let slot = state.pin(li, e).map_err(ModelError::Invalid)?;
                streamer.copy_expert_async(dev, li, e, &mut experts, slot)?;
            }
        }
        streamer.sync_copies()?;
        Ok(ExpertPool {
            strategy,
            streamer,
            experts: Mutex::new(experts),
            state: Mutex::new(state),
            pinned,
            pinned_route_share,
            map_host: MappedHost::new(dev, n)?,
            map_dev: Mutex::new(dev.alloc_zeros::<i32>(n, "expert pool map")?),
            copied_event: dev.new_event(false)?,
        })
    }

    pub fn slots(&self) -> usize {
        self.lock_state().slots()
    }

    fn lock_state(&self) -> MutexGuard<'_, Residency> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The pool's experts, numbered by slot (the stream renumbers routes with
    /// [`ExpertPool::device_map`]).
    pub(crate) fn experts(&self) -> MutexGuard<'_, GpuExperts> {
        self.experts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Launching thread, once the routes `ids` of model layer `layer` are published: admits the
    /// experts they touch into the pool, enqueueing the missing ones' copies and making the
    /// compute stream wait for them, then writes the layer's expert → slot map for the stream.
    pub(crate) fn fetch(&self, dev: &GpuDevice, layer: usize, ids: &[i32]) -> Result<Fetched> {
        let li = self.streamer.moe_layer(layer).ok_or_else(|| {
            ModelError::Invalid(format!("expert pool: model layer {layer} is not a MoE layer of the cache"))
        })?;
        let n = self.streamer.n_experts();
        let mut seen = vec![false; n];
        let mut touched = Vec::with_capacity(n.min(ids.len()));
        for &id in ids {
            let e = usize::try_from(id).ok().filter(|&e| e < n).ok_or_else(|| {
                ModelError::Invalid(format!("expert pool: route to expert {id} of {n} at layer {layer}"))
            })?;
            if !std::mem::replace(&mut seen[e], true) {
                touched.push(e);
            }
        }
        let mut state = self.lock_state();
        let copies = state.admit(li, &touched).map_err(ModelError::Invalid)?;
        let mut bytes = 0;
        if !copies.is_empty() {
            let enqueued = (|| -> Result<()> {
                let mut experts = self.experts();
                for &(e, slot) in &copies {
                    bytes += self.streamer.copy_expert_async(dev, li, e, &mut experts, slot)?;
                }
                self.streamer.compute_waits_for_copies(dev, &self.copied_event)
            })();
            if let Err(e) = enqueued {
                state.forget(&copies);
                return Err(e);
            }
        }
        // SAFETY: the stream reads the map only after this call enqueues that read, and the previous
        // layer's read of it ended before this layer's routes were published (stream order).
        let map = unsafe { std::slice::from_raw_parts_mut(self.map_host.host_ptr(), n) };
        map.copy_from_slice(state.slots_of(li));
        Ok(Fetched { touched: touched.len(), copied: copies.len(), bytes })
    }

    /// Stream side, after [`ExpertPool::fetch`]: the expert → slot map it wrote, in device
    /// memory.
    pub(crate) fn device_map(&self, dev: &GpuDevice) -> Result<MutexGuard<'_, DeviceBuffer<i32>>> {
        let mut m = self.map_dev.lock().unwrap_or_else(|p| p.into_inner());
        let n = self.map_host.len();
        dev.copy_from_mapped(&self.map_host, n, &mut *m)?;
        Ok(m)
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats { slots: self.slots(), pinned: self.pinned, bytes: self.experts().weight_bytes() }
    }

    /// One line for the load log.
    pub fn describe(&self) -> String {
        let s = self.stats();
        let pins = if self.pinned > 0 {
            format!(", {} pinned ({:.1}% of the heatmap's routes)", self.pinned, 100.0 * self.pinned_route_share)
        } else {
            String::new()
        };
        let rest = match self.strategy {
            CacheStrategy::Lru => "the rest a cross-layer cache, least recently used out",
            _ => "the rest copied in for each call",
        };
        format!(
            "{}: {} expert slots in VRAM ({}){pins}; {rest}; decode and prompts below the full-streaming length run every routed expert on the GPU",
            self.strategy.name(),
            s.slots,
            krasis_core::budget::format_bytes(s.bytes as u64)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_keeps_what_it_copied_and_evicts_the_oldest() {
        let mut r = Residency::new(2, 4, 4, true);
        assert_eq!(r.admit(0, &[0, 1]).unwrap().len(), 2);
        assert_eq!(r.admit(1, &[2, 3]).unwrap().len(), 2);
        // Hits copy nothing and refresh the entries.
        assert_eq!(r.admit(0, &[1, 0]).unwrap(), vec![]);
        // Two misses: layer 1's pairs are now the oldest.
        let c = r.admit(0, &[2, 3]).unwrap();
        assert_eq!(c.len(), 2);
        assert!(r.slots_of(1).iter().all(|&s| s < 0), "{:?}", r.slots_of(1));
        assert!(r.slots_of(0).iter().all(|&s| s >= 0));
        // Every slot a distinct pair.
        let mut s: Vec<i32> = r.slots_of(0).to_vec();
        s.sort();
        assert_eq!(s, vec![0, 1, 2, 3]);
    }

    #[test]
    fn a_call_never_evicts_its_own_experts() {
        let mut r = Residency::new(1, 6, 3, true);
        r.admit(0, &[0, 1, 2]).unwrap();
        // 3 is a miss; 0 and 2 are needed by this call: only 1 may go.
        let c = r.admit(0, &[0, 3, 2]).unwrap();
        assert_eq!(c, vec![(3, r.slots_of(0)[3] as usize)]);
        assert!(r.slots_of(0)[1] < 0 && r.slots_of(0)[0] >= 0 && r.slots_of(0)[2] >= 0);
        // More distinct experts than slots: an error, not a silent eviction of a needed one.
        assert!(r.admit(0, &[0, 1, 2, 3]).is_err());
    }

    #[test]
    fn per_call_pools_copy_every_unpinned_expert_each_call() {
        let mut r = Residency::new(2, 4, 6, false);
        let pinned = r.pin(1, 2).unwrap();
        assert!(r.pin(1, 2).is_err(), "pinned twice");
        assert_eq!(r.admit(0, &[0, 1]).unwrap().len(), 2);
        assert_eq!(r.admit(0, &[0, 1]).unwrap().len(), 2, "nothing kept between calls");
        // The pinned expert is never copied, and stays where it was.
        let c = r.admit(1, &[2, 0, 1, 3]).unwrap();
        assert_eq!(c.iter().map(|&(e, _)| e).collect::<Vec<_>>(), vec![0, 1, 3]);
        assert_eq!(r.slots_of(1)[2], pinned as i32);
        assert!(c.iter().all(|&(_, s)| s != pinned));
        assert!(r.slots_of(0).iter().all(|&s| s < 0), "layer 0's copies were released");
    }

    #[test]
    fn forgotten_copies_are_copied_again() {
        let mut r = Residency::new(1, 4, 4, true);
        let c = r.admit(0, &[0, 1]).unwrap();
        r.forget(&c);
        assert!(r.slots_of(0).iter().all(|&s| s < 0));
        assert_eq!(r.admit(0, &[0, 1]).unwrap().len(), 2, "nothing counts as present after a failed copy");
    }

    #[test]
    fn pins_survive_any_amount_of_traffic() {
        let mut r = Residency::new(3, 8, 10, true);
        let p = r.pin(2, 7).unwrap();
        let mut rng = 7u64;
        for _ in 0..500 {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let li = (rng >> 33) as usize % 3;
            let mut touched: Vec<usize> = (0..8).filter(|e| (rng >> (e + 8)) & 1 == 1).collect();
            touched.truncate(9);
            let copies = r.admit(li, &touched).unwrap();
            assert!(copies.iter().all(|&(_, s)| s != p));
            for &e in &touched {
                assert!(r.slots_of(li)[e] >= 0);
            }
            assert_eq!(r.slots_of(2)[7], p as i32);
        }
    }
}
