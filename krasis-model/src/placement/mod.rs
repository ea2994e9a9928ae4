//! Placement: where an engine runs the routed experts, decided once when it opens.
//!
//! - [`device`]: which engine opens (CPU, the whole model on the GPU, or hybrid) and the
//!   defaults it takes, with the reason.
//! - [`plan`]: the per-layer, per-call-length answer the forward step asks ([`PlacementPlan`]),
//!   and the start lines that explain it.
//! - [`strategy`]: the strategies a hybrid engine chooses between (what it keeps in VRAM
//!   beside the CPU copy, what and how much a prefill streams).
//! - [`tune`]: the choice a tuning run measured and saved, which the `auto` policy takes.

pub mod device;
pub mod heatmap;
pub mod plan;
pub mod precision;
pub mod strategy;
pub mod tune;

pub use device::{choose_device, DeviceChoice, GpuFound};
pub use plan::{Beside, ExpertHome, ExpertSite, PlacementPlan, StreamRule};
pub use strategy::{CachePlan, CacheStrategy, StreamFrom, StreamSplit, HOT_MIN_KV_TOKENS, HOT_PREFILL_RESERVE_BYTES};
