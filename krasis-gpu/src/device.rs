//! Finding the driver and the device, the context, streams, events, and budgeted allocations.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{self, CUdevice_attribute_enum as Attr};
use cudarc::driver::{
    result, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    DeviceRepr, DeviceSlice, SyncOnDrop, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use crate::budget::{VramBudget, VramBudgetSpec, VramCharge};
use crate::cache::{CacheStats, KernelCompiler};
use crate::error::panic_text;
use crate::kernels::KernelSource;
use crate::nvrtc::{ImageKind, Target};
use crate::GpuError;

/// What the driver says about one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    /// How many CUDA devices the driver sees.
    pub device_count: usize,
    pub name: String,
    /// Compute capability `(major, minor)`, e.g. `(9, 0)` for Hopper.
    pub compute_capability: (i32, i32),
    pub total_bytes: u64,
    /// Free device memory when it was measured (needs a context: `None` from [`probe`]).
    pub free_bytes: Option<u64>,
    /// The driver's CUDA version, e.g. `(13, 0)`.
    pub driver_version: (i32, i32),
    pub multiprocessors: i32,
    /// Theoretical DRAM bandwidth from the memory clock and bus width (bytes/s; 0 if unknown).
    pub dram_peak_bytes_per_s: u64,
}

impl DeviceInfo {
    /// `major * 10 + minor` (90 for sm_90).
    pub fn arch(&self) -> i32 {
        self.compute_capability.0 * 10 + self.compute_capability.1
    }
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use krasis_core::budget::format_bytes as fb;
        write!(
            f,
            "GPU {} of {}: {} (sm_{}, {} SMs, {}",
            self.ordinal,
            self.device_count,
            self.name,
            self.arch(),
            self.multiprocessors,
            fb(self.total_bytes)
        )?;
        if let Some(free) = self.free_bytes {
            write!(f, ", {} free", fb(free))?;
        }
        write!(f, "), driver CUDA {}.{}", self.driver_version.0, self.driver_version.1)
    }
}

/// Runs `f`, turning a panic inside cudarc (its dynamic loader panics on a missing library or
/// symbol) into an error.
fn guarded<T>(op: &'static str, f: impl FnOnce() -> Result<T, GpuError>) -> Result<T, GpuError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| Err(GpuError::Panicked { op, detail: panic_text(p) }))
}

/// Loads libcuda once, without panicking when it is absent.
fn driver_loaded() -> Result<(), GpuError> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            // SAFETY: only dlopen/dlclose of the driver library.
            if !unsafe { sys::is_culib_present() } {
                return Err("libcuda.so.1 not loadable".to_string());
            }
            catch_unwind(|| {
                // SAFETY: loads the library (present, checked above) into cudarc's static.
                unsafe { sys::culib() };
            })
            .map_err(|p| format!("libcuda.so.1 failed to load: {}", panic_text(p)))
        })
        .clone()
        .map_err(|detail| GpuError::NoDriver { detail })
}

fn init_and_count() -> Result<usize, GpuError> {
    driver_loaded()?;
    guarded("cuInit", || {
        result::init().map_err(|e| GpuError::NoDevice { detail: format!("cuInit failed: {e}") })?;
        let n = result::device::get_count().map_err(|e| GpuError::NoDevice { detail: e.to_string() })?;
        if n <= 0 {
            return Err(GpuError::NoDevice { detail: "the driver reports 0 devices".into() });
        }
        Ok(n as usize)
    })
}

fn device_info(ordinal: usize, count: usize) -> Result<DeviceInfo, GpuError> {
    if ordinal >= count {
        return Err(GpuError::BadOrdinal { ordinal, count });
    }
    guarded("device query", || {
        let d = |op, e| GpuError::driver(op, e);
        let dev = result::device::get(ordinal as i32).map_err(|e| d("cuDeviceGet", e))?;
        let name = result::device::get_name(dev).map_err(|e| d("cuDeviceGetName", e))?;
        // SAFETY: `dev` came from cuDeviceGet.
        let attr = |a| unsafe { result::device::get_attribute(dev, a) }.map_err(|e| d("cuDeviceGetAttribute", e));
        let major = attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sms = attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        // Memory clock in kHz, bus width in bits; DDR: two transfers per clock.
        let mem_khz = attr(Attr::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE).unwrap_or(0);
        let bus_bits = attr(Attr::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH).unwrap_or(0);
        let dram_peak_bytes_per_s = 2 * mem_khz.max(0) as u64 * 1000 * bus_bits.max(0) as u64 / 8;
        // SAFETY: as above.
        let total = unsafe { result::device::total_mem(dev) }.map_err(|e| d("cuDeviceTotalMem", e))?;
        let mut v = 0;
        // SAFETY: writes one int.
        unsafe { sys::cuDriverGetVersion(&mut v) }.result().map_err(|e| d("cuDriverGetVersion", e))?;
        Ok(DeviceInfo {
            ordinal,
            device_count: count,
            name,
            compute_capability: (major, minor),
            total_bytes: total as u64,
            free_bytes: None,
            driver_version: (v / 1000, (v % 1000) / 10),
            multiprocessors: sms,
            dram_peak_bytes_per_s,
        })
    })
}

/// Looks for a usable GPU (device 0) without creating a context: loads the driver, initialises
/// it and reads the device's properties. Never panics; the error is one line such as
/// "no CUDA driver found (libcuda.so.1 not loadable)".
pub fn probe() -> Result<DeviceInfo, GpuError> {
    probe_ordinal(0)
}

/// [`probe`] for device `ordinal` (`--gpu N`).
pub fn probe_ordinal(ordinal: usize) -> Result<DeviceInfo, GpuError> {
    let n = init_and_count()?;
    device_info(ordinal, n)
}

/// The VRAM budget `spec` resolves to on device `ordinal` now (`auto`: free memory minus the
/// reserve), for deciding where a model goes before loading it. Creates (and releases) the
/// device's primary context to read the free memory.
pub fn vram_budget_bytes(ordinal: usize, spec: VramBudgetSpec) -> Result<u64, GpuError> {
    let n = init_and_count()?;
    let info = device_info(ordinal, n)?;
    guarded("cuMemGetInfo", || {
        let ctx = CudaContext::new(ordinal).map_err(|e| GpuError::driver("cuDevicePrimaryCtxRetain", e))?;
        let (free, _total) = ctx.mem_get_info().map_err(|e| GpuError::driver("cuMemGetInfo", e))?;
        spec.resolve(free as u64, ordinal, &info.name)
    })
}

/// A device buffer whose bytes are charged against the device's [`VramBudget`] for as long as it
/// lives. Use it wherever cudarc takes a [`DevicePtr`]/[`DevicePtrMut`].
#[derive(Debug)]
pub struct DeviceBuffer<T> {
    // Field order matters: the memory is freed before the charge is released.
    slice: CudaSlice<T>,
    charge: VramCharge,
}

impl<T> DeviceBuffer<T> {
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }

    /// Bytes charged against the budget.
    pub fn charged_bytes(&self) -> u64 {
        self.charge.bytes()
    }

    /// The cudarc slice (for launch arguments and views).
    pub fn slice(&self) -> &CudaSlice<T> {
        &self.slice
    }

    pub fn slice_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T> DeviceSlice<T> for DeviceBuffer<T> {
    fn len(&self) -> usize {
        self.slice.len()
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }
}

impl<T> DevicePtr<T> for DeviceBuffer<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.slice.device_ptr(stream)
    }
}

impl<T> DevicePtrMut<T> for DeviceBuffer<T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.slice.device_ptr_mut(stream)
    }
}

/// Compiled kernel images not yet loaded into a context ([`GpuDevice::compile_kernels_where`]).
pub struct KernelImages(Vec<(&'static KernelSource, Option<Result<crate::cache::CompiledImage, GpuError>>)>);

/// One GPU opened for krasis: the primary context, a compute stream, the VRAM budget, and the
/// kernels loaded so far.
///
/// cudarc's automatic per-buffer event tracking is disabled: it creates two events per
/// allocation and records them around every launch, which costs in decode loops. The rule that
/// replaces it: every buffer is allocated and used on [`GpuDevice::stream`]; work on another
/// stream (e.g. a copy stream from [`GpuDevice::new_stream`]) must be ordered with explicit events
/// ([`CudaStream::record_event`] / [`CudaStream::wait`]), and a buffer must not be dropped while
/// another stream may still use it.
pub struct GpuDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    budget: Arc<VramBudget>,
    target: Target,
    compiler: KernelCompiler,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<(&'static str, &'static str), CudaFunction>>,
    /// Host-blocking calls so far (stream synchronisations, device→host copies): the decode
    /// loop's budget is one per token (the sampled id).
    host_syncs: std::sync::atomic::AtomicU64,
    /// Host→device copies so far (pageable copies can block the host while staging).
    uploads: std::sync::atomic::AtomicU64,
    /// [`GpuDevice::launch_dependent`] asks for programmatic dependent launch (sm_90 kernels).
    pdl: bool,
    /// The second compute stream of [`GpuDevice::on_side_stream`], made on first use.
    side: OnceLock<SideStream>,
}

/// A second compute stream for work that overlaps the compute stream's (a decode step's shared
/// expert beside its routed experts), ordered with two reusable events.
struct SideStream {
    stream: Arc<CudaStream>,
    fork: CudaEvent,
    join: CudaEvent,
    /// The thread ([`thread_token`]) whose launches go to the side stream now; 0: none.
    owner: std::sync::atomic::AtomicU64,
}

/// A number unique to the calling thread (never 0).
fn thread_token() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    thread_local!(static TOKEN: u64 = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    TOKEN.with(|t| *t)
}

/// The parameter array of [`GpuDevice::launch_dependent`]: a pointer to each argument value (the
/// values must outlive the launch call).
macro_rules! kernel_args {
    ($($a:expr),* $(,)?) => { [$($crate::device::kernel_arg($a)),*] };
}
pub(crate) use kernel_args;

/// One entry of [`kernel_args!`].
pub(crate) fn kernel_arg<T: DeviceRepr>(v: &T) -> *mut std::ffi::c_void {
    v as *const T as *mut std::ffi::c_void
}

impl std::fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDevice").field("info", &self.info).field("budget", &self.budget).finish()
    }
}

/// What a stream is doing ([`GpuDevice::stream_state`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamState {
    /// Everything enqueued on it is done.
    Idle,
    /// Work is still pending (or waiting on an event or a host flag).
    Busy,
    /// The driver reported an error.
    Failed(String),
}

impl std::fmt::Display for StreamState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamState::Idle => f.write_str("idle"),
            StreamState::Busy => f.write_str("busy"),
            StreamState::Failed(e) => write!(f, "error {e}"),
        }
    }
}

impl GpuDevice {
    /// Opens device `ordinal` (`--gpu N`) with the VRAM budget `budget` (`--vram-budget`). Also
    /// loads NVRTC, since every op needs kernels; fails with one line if anything is missing.
    pub fn open(ordinal: usize, budget: VramBudgetSpec) -> Result<Self, GpuError> {
        let n = init_and_count()?;
        let mut info = device_info(ordinal, n)?;
        let compiler = KernelCompiler::with_default_dir()?;
        let nv = compiler.nvrtc();
        let target = Target::choose(info.arch(), nv.supported_archs()).ok_or_else(|| GpuError::Nvrtc {
            op: "target selection",
            detail: format!(
                "NVRTC {}.{} ({}) supports none of the architectures that sm_{} can run",
                nv.version().0,
                nv.version().1,
                nv.path(),
                info.arch()
            ),
        })?;
        guarded("context creation", || {
            let ctx = CudaContext::new(ordinal).map_err(|e| GpuError::driver("cuDevicePrimaryCtxRetain", e))?;
            // SAFETY: see the type's docs: single compute stream, explicit events across streams.
            unsafe { ctx.disable_event_tracking() };
            let stream = ctx.new_stream().map_err(|e| GpuError::driver("cuStreamCreate", e))?;
            let (free, _total) = ctx.mem_get_info().map_err(|e| GpuError::driver("cuMemGetInfo", e))?;
            info.free_bytes = Some(free as u64);
            let bytes = budget.resolve(free as u64, ordinal, &info.name)?;
            Ok(GpuDevice {
                ctx,
                stream,
                info,
                budget: VramBudget::new(bytes),
                target,
                compiler,
                modules: Mutex::new(HashMap::new()),
                functions: Mutex::new(HashMap::new()),
                host_syncs: Default::default(),
                uploads: Default::default(),
                pdl: target.arch >= 90 && krasis_core::knobs::knobs().pdl,
                side: OnceLock::new(),
            })
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Launches `f` on the compute stream with `args` (one pointer per kernel parameter, as
    /// `cuLaunchKernel` takes them), as a *programmatic dependent launch* where the kernels are
    /// built for sm_90+ (`KRASIS_PDL=0` turns it off): the kernel's blocks may be scheduled while
    /// the previous kernel in the stream is still running (once all of that kernel's blocks have
    /// executed `griddepcontrol.launch_dependents`), so its launch latency and its prologue overlap
    /// the previous kernel's tail. Only the kernel-to-kernel edge is relaxed; copies and waits on the
    /// stream order as usual.
    ///
    /// `early = false` launches the ordinary way (the kernel starts after everything before it):
    /// for a kernel right after a stream wait or a copy it reads from, where only the
    /// kernel-to-kernel edge may be relaxed and the caller would rather not rely on the driver
    /// telling the two apart.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters, and the kernel must execute `KRASIS_GRID_WAIT()`
    /// (krasis_common.cuh) before it reads or writes any memory that earlier stream work writes
    /// or reads.
    pub(crate) unsafe fn launch_dependent(
        &self,
        op: &'static str,
        f: &CudaFunction,
        cfg: cudarc::driver::LaunchConfig,
        args: &mut [*mut std::ffi::c_void],
        early: bool,
    ) -> Result<(), GpuError> {
        self.ctx.bind_to_thread().map_err(|e| GpuError::driver("cuCtxSetCurrent", e))?;
        // SAFETY: zero is a valid bit pattern for the attribute struct (a tagged union).
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream().cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.pdl && early),
        };
        // SAFETY: the caller vouches for the arguments; the config and attribute live across the call.
        let r = unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()) };
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(GpuError::Driver { op, detail: format!("{r:?}") })
        }
    }

    pub fn budget(&self) -> &Arc<VramBudget> {
        &self.budget
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The compute stream: every op and every allocation runs on it (the ops launched inside
    /// [`GpuDevice::on_side_stream`] by the thread that called it run on the side stream).
    pub fn stream(&self) -> &Arc<CudaStream> {
        match self.side.get() {
            Some(side) if side.owner.load(std::sync::atomic::Ordering::Relaxed) == thread_token() => &side.stream,
            _ => &self.stream,
        }
    }

    /// What `stream` is doing now (`cuStreamQuery`). Safe from any thread (binds the context to
    /// it); enqueues nothing.
    pub fn stream_state(&self, stream: &CudaStream) -> StreamState {
        if let Err(e) = self.ctx.bind_to_thread() {
            return StreamState::Failed(format!("cuCtxSetCurrent: {e}"));
        }
        // SAFETY: a query of a live stream.
        match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
            sys::CUresult::CUDA_SUCCESS => StreamState::Idle,
            sys::CUresult::CUDA_ERROR_NOT_READY => StreamState::Busy,
            e => StreamState::Failed(format!("{e:?}")),
        }
    }

    /// The state of the compute stream and of the side stream when made ([`GpuDevice::stream_state`]).
    pub fn streams_state(&self) -> String {
        let main = self.stream_state(&self.stream);
        match self.side.get() {
            Some(side) => format!("compute stream {main}, side stream {}", self.stream_state(&side.stream)),
            None => format!("compute stream {main}"),
        }
    }

    /// The compute stream, also inside [`GpuDevice::on_side_stream`].
    pub(crate) fn main_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Whether this thread's launches go to the side stream now.
    pub(crate) fn on_side(&self) -> bool {
        !Arc::ptr_eq(self.stream(), &self.stream)
    }

    /// Runs `work` with this thread's kernel launches on a second stream that starts after
    /// everything enqueued on the compute stream so far, so they may overlap what the compute
    /// stream runs next; [`GpuDevice::join_side_stream`] orders the compute stream after them
    /// again and must come before anything reads what `work` writes. Only kernel launches move:
    /// allocations and copies stay on the compute stream (`work` must not need them); cuBLAS
    /// GEMMs run there on the [`crate::linear::GemmContext`]'s side lane, whose scratch
    /// [`crate::linear::GemmContext::reserve_side`] sized beforehand. Not reentrant.
    pub fn on_side_stream<R, E: From<GpuError>>(&self, work: impl FnOnce() -> Result<R, E>) -> Result<R, E> {
        let side = self.side()?;
        let d = |op, e| GpuError::driver(op, e);
        side.fork.record(&self.stream).map_err(|e| d("cuEventRecord", e))?;
        side.stream.wait(&side.fork).map_err(|e| d("cuStreamWaitEvent", e))?;
        struct Restore<'a>(&'a std::sync::atomic::AtomicU64);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.store(0, std::sync::atomic::Ordering::Relaxed);
            }
        }
        side.owner.store(thread_token(), std::sync::atomic::Ordering::Relaxed);
        let restore = Restore(&side.owner);
        let r = work();
        drop(restore);
        side.join.record(&side.stream).map_err(|e| d("cuEventRecord", e))?;
        r
    }

    /// The side stream of [`GpuDevice::on_side_stream`], made on first use.
    fn side(&self) -> Result<&SideStream, GpuError> {
        if self.side.get().is_none() {
            let side = SideStream {
                stream: self.new_stream()?,
                fork: self.new_event(false)?,
                join: self.new_event(false)?,
                owner: Default::default(),
            };
            let _ = self.side.set(side); // a racing thread's copy serves as well
        }
        Ok(self.side.get().expect("set above"))
    }

    /// The stream [`GpuDevice::on_side_stream`] work runs on (made on first use).
    pub(crate) fn side_stream(&self) -> Result<&Arc<CudaStream>, GpuError> {
        Ok(&self.side()?.stream)
    }

    /// Orders the compute stream after the last [`GpuDevice::on_side_stream`] work.
    pub fn join_side_stream(&self) -> Result<(), GpuError> {
        match self.side.get() {
            Some(side) => self.stream.wait(&side.join).map_err(|e| GpuError::driver("cuStreamWaitEvent", e)),
            None => Ok(()),
        }
    }

    /// The NVRTC target kernels are built for (`sm_90`, or `compute_XY` PTX when NVRTC is older
    /// than the GPU).
    pub fn target(&self) -> Target {
        self.target
    }

    /// Kernel-cache hits and misses on this device.
    pub fn kernel_cache_stats(&self) -> CacheStats {
        self.compiler.stats()
    }

    pub fn compiler(&self) -> &KernelCompiler {
        &self.compiler
    }

    /// Another non-blocking stream (e.g. for copies); order it against [`GpuDevice::stream`] with
    /// events.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>, GpuError> {
        self.ctx.new_stream().map_err(|e| GpuError::driver("cuStreamCreate", e))
    }

    /// An event; `timing` enables [`CudaEvent::elapsed_ms`] (otherwise the cheaper
    /// timing-disabled kind, for ordering only).
    pub fn new_event(&self, timing: bool) -> Result<CudaEvent, GpuError> {
        let flags =
            if timing { sys::CUevent_flags::CU_EVENT_DEFAULT } else { sys::CUevent_flags::CU_EVENT_DISABLE_TIMING };
        self.ctx.new_event(Some(flags)).map_err(|e| GpuError::driver("cuEventCreate", e))
    }

    /// `(host synchronisations, host→device uploads)` since the device was opened: the debug
    /// counters behind "no host synchronisation inside a decode step".
    pub fn sync_counters(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.host_syncs.load(Relaxed), self.uploads.load(Relaxed))
    }

    /// Counts a host-side wait for the device that does not go through the calls above (a
    /// [`crate::HostFlag`] spin).
    pub(crate) fn note_host_sync(&self) {
        self.host_syncs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Waits for all work on the compute stream (counted in [`GpuDevice::sync_counters`]).
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.host_syncs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.stream.synchronize().map_err(|e| GpuError::driver("cuStreamSynchronize", e))
    }

    /// `(free, total)` device memory now.
    pub fn mem_info(&self) -> Result<(u64, u64), GpuError> {
        let (f, t) = self.ctx.mem_get_info().map_err(|e| GpuError::driver("cuMemGetInfo", e))?;
        Ok((f as u64, t as u64))
    }

    fn charge<T>(&self, len: usize, what: &str) -> Result<VramCharge, GpuError> {
        let bytes = (len as u64).saturating_mul(std::mem::size_of::<T>() as u64);
        self.budget.charge(bytes, what)
    }

    fn map_alloc_err(&self, e: cudarc::driver::DriverError, bytes: u64, what: &str) -> GpuError {
        if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
            GpuError::OutOfMemory { requested: bytes, what: what.to_string() }
        } else {
            GpuError::driver("cuMemAllocAsync", e)
        }
    }

    /// `len` zeroed elements, charged to the budget as `what`.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
        what: &str,
    ) -> Result<DeviceBuffer<T>, GpuError> {
        let charge = self.charge::<T>(len, what)?;
        let slice = self.stream.alloc_zeros::<T>(len).map_err(|e| self.map_alloc_err(e, charge.bytes(), what))?;
        Ok(DeviceBuffer { slice, charge })
    }

    /// `len` uninitialised elements, charged to the budget as `what`.
    ///
    /// # Safety
    /// The contents are whatever the memory held; write before reading.
    pub unsafe fn alloc_uninit<T: DeviceRepr>(&self, len: usize, what: &str) -> Result<DeviceBuffer<T>, GpuError> {
        let charge = self.charge::<T>(len, what)?;
        let slice = self.stream.alloc::<T>(len).map_err(|e| self.map_alloc_err(e, charge.bytes(), what))?;
        Ok(DeviceBuffer { slice, charge })
    }

    /// A device copy of `host`, charged to the budget as `what`.
    pub fn upload<T: DeviceRepr>(&self, host: &[T], what: &str) -> Result<DeviceBuffer<T>, GpuError> {
        // SAFETY: fully overwritten by the copy below before anything can read it.
        let mut buf = unsafe { self.alloc_uninit::<T>(host.len(), what)? };
        self.copy_to_device(host, &mut buf)?;
        Ok(buf)
    }

    /// Copies `host` into the start of `dst` (counted in [`GpuDevice::sync_counters`]).
    pub fn copy_to_device<T: DeviceRepr>(&self, host: &[T], dst: &mut DeviceBuffer<T>) -> Result<(), GpuError> {
        if host.len() > dst.len() {
            return Err(GpuError::shape("upload", format!("{} host elements into {}", host.len(), dst.len())));
        }
        if !host.is_empty() {
            self.uploads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut view = dst.slice.slice_mut(..host.len());
            self.stream.memcpy_htod(host, &mut view).map_err(|e| GpuError::driver("cuMemcpyHtoDAsync", e))?;
        }
        Ok(())
    }

    /// Copies device memory into `host` (synchronises the compute stream).
    pub fn download_into<T: DeviceRepr>(&self, src: &impl DevicePtr<T>, host: &mut [T]) -> Result<(), GpuError> {
        if src.len() != host.len() {
            return Err(GpuError::shape("download", format!("{} device elements into {}", src.len(), host.len())));
        }
        if !host.is_empty() {
            self.stream.memcpy_dtoh(src, host).map_err(|e| GpuError::driver("cuMemcpyDtoHAsync", e))?;
        }
        self.synchronize()
    }

    /// Copies device memory to a new `Vec` (synchronises the compute stream).
    pub fn download<T: DeviceRepr + Default + Clone>(&self, src: &impl DevicePtr<T>) -> Result<Vec<T>, GpuError> {
        let mut v = vec![T::default(); src.len()];
        self.download_into(src, &mut v)?;
        Ok(v)
    }

    /// Records `event` on the compute stream (after everything enqueued so far).
    pub fn record(&self, event: &CudaEvent) -> Result<(), GpuError> {
        event.record(&self.stream).map_err(|e| GpuError::driver("cuEventRecord", e))
    }

    /// Waits on the host until `event` has completed (counted in
    /// [`GpuDevice::sync_counters`]): the planned hand-off points of the hybrid engine.
    pub fn wait_event(&self, event: &CudaEvent) -> Result<(), GpuError> {
        self.host_syncs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        event.synchronize().map_err(|e| GpuError::driver("cuEventSynchronize", e))
    }

    fn module(&self, kernel: &KernelSource) -> Result<Arc<CudaModule>, GpuError> {
        if let Some(m) = self.modules.lock().unwrap_or_else(|p| p.into_inner()).get(kernel.name) {
            return Ok(Arc::clone(m));
        }
        let image = self.compiler.image(kernel, self.target)?;
        self.load_image(kernel, image)
    }

    /// Loads `kernel`'s compiled `image` into this context (recompiling once if a cached image
    /// is refused by the driver) and keeps the module.
    fn load_image(
        &self,
        kernel: &KernelSource,
        image: crate::cache::CompiledImage,
    ) -> Result<Arc<CudaModule>, GpuError> {
        let load = |bytes: Vec<u8>| {
            let ptx = match self.target.kind {
                ImageKind::Cubin => Ptx::from_binary(bytes),
                ImageKind::Ptx => {
                    let mut b = bytes;
                    while b.last() == Some(&0) {
                        b.pop();
                    }
                    Ptx::from_src(String::from_utf8_lossy(&b).into_owned())
                }
            };
            self.ctx.load_module(ptx)
        };
        let module = match load(image.bytes) {
            Ok(m) => m,
            Err(e) if image.from_cache => {
                tracing::warn!(
                    "krasis-gpu: cached kernel {} was refused by the driver ({e}); recompiling",
                    kernel.name
                );
                self.compiler.evict(kernel, self.target);
                let image = self.compiler.image(kernel, self.target)?;
                load(image.bytes).map_err(|e| GpuError::driver("cuModuleLoadData", e))?
            }
            Err(e) => return Err(GpuError::driver("cuModuleLoadData", e)),
        };
        let mut map = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        Ok(Arc::clone(map.entry(kernel.name).or_insert(module)))
    }

    /// The kernel function `name` from `kernel`, compiling (or reading the disk cache) and loading
    /// the module on first use.
    pub fn function(&self, kernel: &KernelSource, name: &'static str) -> Result<CudaFunction, GpuError> {
        let key = (kernel.name, name);
        if let Some(f) = self.functions.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            return Ok(f.clone());
        }
        let m = self.module(kernel)?;
        let f = m.load_function(name).map_err(|e| GpuError::driver("cuModuleGetFunction", e))?;
        self.functions.lock().unwrap_or_else(|p| p.into_inner()).insert(key, f.clone());
        Ok(f)
    }

    /// Compiles and loads every kernel and resolves every function (e.g. at start-up, so the
    /// first forward pass does not pay for compiles).
    ///
    /// The images come first, on up to one thread per core: NVRTC programs are independent, and
    /// on a machine's first start their compiles are most of the load (one at a time they took
    /// ~25 s on the H100 box). A line says when any has to be compiled.
    pub fn warm_up_kernels(&self) -> Result<(), GpuError> {
        self.warm_up_kernels_where(&|_| true)
    }

    /// [`GpuDevice::warm_up_kernels`] for the programs `keep` accepts (the others still compile
    /// on first use, should they ever run).
    pub fn warm_up_kernels_where(&self, keep: &(dyn Fn(&KernelSource) -> bool + Sync)) -> Result<(), GpuError> {
        let images = self.compile_kernels_where(keep);
        self.load_kernels(images, keep)
    }

    /// The first half of [`GpuDevice::warm_up_kernels_where`]: the images of the programs `keep`
    /// accepts that are not loaded yet, compiled by NVRTC on up to one thread per core (or read
    /// from the disk cache). No CUDA call: a loader runs it on another thread while it uploads
    /// the weights, so a machine's first start compiles behind the copies.
    pub fn compile_kernels_where(&self, keep: &(dyn Fn(&KernelSource) -> bool + Sync)) -> KernelImages {
        let todo: Vec<&'static KernelSource> = {
            let loaded = self.modules.lock().unwrap_or_else(|p| p.into_inner());
            crate::kernels::ALL.iter().filter(|k| keep(k) && !loaded.contains_key(k.name)).collect()
        };
        let to_compile =
            todo.iter().filter(|k| self.compiler.cache_path(k, self.target).is_none_or(|p| !p.exists())).count();
        let started = std::time::Instant::now();
        if to_compile > 0 {
            tracing::info!(
                "krasis-gpu: compiling {to_compile} GPU kernel programs for {} (first start with this build here; cached for the next)",
                self.target
            );
        }
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(todo.len()).max(1);
        let next = std::sync::atomic::AtomicUsize::new(0);
        let mut images: Vec<Option<Result<crate::cache::CompiledImage, GpuError>>> = Vec::new();
        images.resize_with(todo.len(), || None);
        let slots = Mutex::new(images);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(k) = todo.get(i) else { break };
                    let image = self.compiler.image(k, self.target);
                    slots.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(image);
                });
            }
        });
        let images = slots.into_inner().unwrap_or_else(|p| p.into_inner());
        if to_compile > 0 {
            tracing::info!(
                "krasis-gpu: {to_compile} kernel programs compiled in {:.1} s on {threads} threads",
                started.elapsed().as_secs_f64()
            );
        }
        KernelImages(todo.into_iter().zip(images).collect())
    }

    /// The second half of [`GpuDevice::warm_up_kernels_where`]: loads `images` into this context
    /// (a program loaded meanwhile keeps its module) and resolves every function of the programs
    /// `keep` accepts.
    pub fn load_kernels(
        &self,
        images: KernelImages,
        keep: &(dyn Fn(&KernelSource) -> bool + Sync),
    ) -> Result<(), GpuError> {
        for (k, image) in images.0 {
            let image = image.ok_or_else(|| GpuError::Panicked {
                op: "NVRTC compile",
                detail: format!("the thread compiling {} stopped", k.name),
            })??;
            self.load_image(k, image)?;
        }
        for k in crate::kernels::ALL.iter().filter(|k| keep(k)) {
            for f in k.functions {
                self.function(k, f)?;
            }
        }
        Ok(())
    }
}
