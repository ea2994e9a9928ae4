//! `--device hybrid`: routed experts on the CPU, everything else on the GPU. Not built yet: the
//! Engine API calls [`open_hybrid`] for [`DevicePolicy::Hybrid`](crate::runtime::DevicePolicy).

use crate::error::{ModelError, Result};
use crate::files::ModelFiles;
use crate::runtime::{EngineConfig, Opened};

/// Opens the hybrid engine (a stub until the hybrid path lands).
pub fn open_hybrid(_files: &ModelFiles, _config: &EngineConfig) -> Result<Opened> {
    Err(ModelError::Invalid("--device hybrid is not built yet".into()))
}
