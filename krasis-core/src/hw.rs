//! Hardware probe: CPUs usable by this process, physical cores and SMT, NUMA nodes, memory,
//! hugepages, frequency governors and instruction-set flags.
//!
//! Everything is read from `/proc` and `/sys` on Linux. Nothing here panics or blocks: a file
//! that is missing or unparsable just means "unknown" and falls back to a conservative value.
//! The parsers take file contents as strings so they can be tested without a real `/sys`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

const SYS_CPU: &str = "/sys/devices/system/cpu";
const SYS_NODE: &str = "/sys/devices/system/node";
const THP_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/enabled";
const HUGEPAGES_2M: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages";
const HUGEPAGES_1G: &str = "/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages";

/// Largest CPU id the cpulist parser accepts (guards against absurd ranges in corrupt input).
pub const MAX_CPU_ID: usize = 1 << 16;

/// One NUMA node as the kernel reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NumaNode {
    pub id: usize,
    /// All CPUs of the node per sysfs (not filtered by this process's affinity); empty for
    /// memory-only nodes.
    pub cpus: Vec<usize>,
    pub mem_total_bytes: Option<u64>,
}

/// Instruction-set extensions relevant to the CPU kernels (all false off x86-64).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IsaFlags {
    pub avx2: bool,
    pub fma: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512vnni: bool,
    pub avx512bf16: bool,
    /// AMX tiles supported by the CPU *and* enabled by the kernel (the `amx_tile` flag in
    /// `/proc/cpuinfo`; `is_x86_feature_detected!("amx-tile")` is not stable Rust yet).
    pub amx_tile: bool,
}

impl IsaFlags {
    /// Detects the flags of the CPU this runs on.
    #[cfg(target_arch = "x86_64")]
    pub fn detect() -> Self {
        IsaFlags {
            avx2: is_x86_feature_detected!("avx2"),
            fma: is_x86_feature_detected!("fma"),
            avx512f: is_x86_feature_detected!("avx512f"),
            avx512bw: is_x86_feature_detected!("avx512bw"),
            avx512vnni: is_x86_feature_detected!("avx512vnni"),
            avx512bf16: is_x86_feature_detected!("avx512bf16"),
            amx_tile: read_string("/proc/cpuinfo").is_some_and(|info| cpuinfo_has_flag(&info, "amx_tile")),
        }
    }

    /// Detects the flags of the CPU this runs on (none off x86-64).
    #[cfg(not(target_arch = "x86_64"))]
    pub fn detect() -> Self {
        IsaFlags::default()
    }
}

/// Where one logical CPU sits in the package/die/core hierarchy; `None` where sysfs did not say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuTopology {
    pub cpu: usize,
    pub package_id: Option<i64>,
    pub die_id: Option<i64>,
    pub core_id: Option<i64>,
}

/// Identity of a physical core; a CPU with unknown topology counts as a core of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum CoreKey {
    Known { package: Option<i64>, die: Option<i64>, core: i64 },
    Unknown(usize),
}

impl CpuTopology {
    fn core_key(&self) -> CoreKey {
        match self.core_id {
            Some(core) => CoreKey::Known { package: self.package_id, die: self.die_id, core },
            None => CoreKey::Unknown(self.cpu),
        }
    }
}

/// What the probe found about this machine.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SystemReport {
    pub cpu_model: String,
    /// Online CPUs usable by this process (`sched_getaffinity`).
    pub logical_cpus: usize,
    /// Distinct physical cores among those CPUs.
    pub physical_cores: usize,
    /// Some physical core has more than one sibling in our affinity set.
    pub smt_active: bool,
    /// Topology of each usable CPU, sorted by CPU id.
    pub cpu_topology: Vec<CpuTopology>,
    /// NUMA nodes from sysfs; one synthetic node holding every usable CPU if sysfs has none.
    pub numa_nodes: Vec<NumaNode>,
    /// `MemTotal` from `/proc/meminfo` (0 if unknown).
    pub mem_total_bytes: u64,
    /// `MemAvailable` from `/proc/meminfo` (falls back to `MemFree`, 0 if unknown).
    pub mem_available_bytes: u64,
    /// The selected transparent-hugepage mode ("always", "madvise", "never").
    pub thp_enabled: Option<String>,
    pub hugepages_2m_total: u64,
    pub hugepages_1g_total: u64,
    /// Distinct cpufreq governors across our CPUs (empty without cpufreq).
    pub governors: Vec<String>,
    pub isa: IsaFlags,
}

/// `MemAvailable` from `/proc/meminfo` now (falls back to `MemFree`; `None` if unreadable):
/// the one field of [`probe`] that changes while a process runs.
pub fn mem_available_bytes() -> Option<u64> {
    let meminfo = read_string("/proc/meminfo")?;
    parse_meminfo_bytes(&meminfo, "MemAvailable").or_else(|| parse_meminfo_bytes(&meminfo, "MemFree"))
}

/// Probes the machine. Never panics; unknown values fall back as documented on each field.
pub fn probe() -> SystemReport {
    let meminfo = read_string("/proc/meminfo").unwrap_or_default();
    let mem_total_bytes = parse_meminfo_bytes(&meminfo, "MemTotal").or_else(sysconf_mem_total).unwrap_or(0);
    let mem_available_bytes =
        parse_meminfo_bytes(&meminfo, "MemAvailable").or_else(|| parse_meminfo_bytes(&meminfo, "MemFree")).unwrap_or(0);

    let cpus = usable_cpus();
    let cpu_topology: Vec<CpuTopology> = cpus.iter().map(|&cpu| read_topology(cpu)).collect();
    let (physical_cores, smt_active) = physical_core_summary(&cpu_topology);

    let numa_nodes = read_numa_nodes().unwrap_or_else(|| {
        vec![NumaNode { id: 0, cpus: cpus.clone(), mem_total_bytes: (mem_total_bytes > 0).then_some(mem_total_bytes) }]
    });

    let governors: BTreeSet<String> = cpus
        .iter()
        .filter_map(|cpu| read_string(format!("{SYS_CPU}/cpu{cpu}/cpufreq/scaling_governor")))
        .map(|g| g.trim().to_owned())
        .filter(|g| !g.is_empty())
        .collect();

    SystemReport {
        cpu_model: read_string("/proc/cpuinfo")
            .and_then(|info| parse_cpu_model(&info))
            .unwrap_or_else(|| "unknown".to_owned()),
        logical_cpus: cpus.len(),
        physical_cores,
        smt_active,
        cpu_topology,
        numa_nodes,
        mem_total_bytes,
        mem_available_bytes,
        thp_enabled: read_string(THP_ENABLED).and_then(|s| parse_thp_mode(&s)),
        hugepages_2m_total: read_u64(HUGEPAGES_2M).unwrap_or(0),
        hugepages_1g_total: read_u64(HUGEPAGES_1G).unwrap_or(0),
        governors: governors.into_iter().collect(),
        isa: IsaFlags::detect(),
    }
}

/// Weight bytes from which 1 GiB huge pages are worth a warning when none are reserved. Below
/// it, 2 MiB pages already cover the weights within the second-level TLB's reach (1,536 entries
/// on current Intel cores, 2,048 to 3,072 on AMD Zen: 3 to 6 GiB of 2 MiB pages), so 1 GiB
/// pages would save no measurable page walks.
pub const HUGE_PAGES_1G_MATTER_BYTES: u64 = 4 << 30;

/// Weight bytes from which transparent hugepages set to "never" are worth a warning. With
/// 4 KiB pages the second-level TLB reaches only 6 to 12 MiB, so weights well past that (here
/// about ten times) pay a page walk every 4 KiB they stream; smaller ones stay mostly cached.
pub const THP_MATTERS_BYTES: u64 = 64 << 20;

impl SystemReport {
    /// Human-readable warnings (never errors), one line each: what was found and what to do.
    /// `weight_bytes` is what the run holds in weights (e.g. the resident-memory estimate's
    /// dense plus expert bytes): the page-size warnings appear only when it reaches
    /// [`THP_MATTERS_BYTES`] or [`HUGE_PAGES_1G_MATTER_BYTES`], so a small model hears nothing
    /// about huge pages.
    pub fn warnings(&self, weight_bytes: u64) -> Vec<String> {
        let mut out = Vec::new();
        if self.smt_active {
            out.push(format!(
                "SMT is on ({} logical CPUs on {} physical cores): decode runs one worker per \
                 physical core, so the siblings stay idle; disable SMT (BIOS, or \
                 `echo off > /sys/devices/system/cpu/smt/control`) to give them back to the OS",
                self.logical_cpus, self.physical_cores
            ));
        }
        if self.cpu_topology.iter().any(|t| t.core_id.is_none()) {
            out.push(
                "CPU topology unreadable (no /sys/devices/system/cpu/cpuN/topology): every \
                 logical CPU is treated as a physical core; pin workers by hand if SMT is on"
                    .to_owned(),
            );
        }
        let slow: Vec<&str> = self.governors.iter().map(String::as_str).filter(|g| *g != "performance").collect();
        if !slow.is_empty() {
            out.push(format!(
                "CPU frequency governor is {} (not \"performance\"): decode speed will vary; \
                 run `sudo cpupower frequency-set -g performance`",
                slow.join(", ")
            ));
        }
        if self.thp_enabled.as_deref() == Some("never") && weight_bytes >= THP_MATTERS_BYTES {
            out.push(
                "transparent hugepages are \"never\": large weight mappings pay TLB misses; \
                 `echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled`"
                    .to_owned(),
            );
        }
        if self.hugepages_1g_total == 0 && weight_bytes >= HUGE_PAGES_1G_MATTER_BYTES {
            out.push(
                "no 1 GiB hugepages reserved: pinned expert buffers use smaller pages; reserve \
                 some with `hugepagesz=1G hugepages=N` on the kernel command line"
                    .to_owned(),
            );
        }
        if self.numa_nodes.len() > 1 {
            out.push(format!(
                "info: {} NUMA nodes found: experts are placed per node and workers pinned to \
                 their node; run without numactl --interleave",
                self.numa_nodes.len()
            ));
        }
        #[cfg(target_arch = "x86_64")]
        if !self.isa.avx2 {
            out.push("CPU lacks AVX2: CPU expert kernels fall back to scalar code and will be slow".to_owned());
        }
        out
    }

    /// One logical CPU id per physical core (its lowest usable sibling), ordered by NUMA node
    /// then CPU id: the pinning plan for workers.
    pub fn one_cpu_per_core(&self) -> Vec<usize> {
        plan_one_cpu_per_core(&self.cpu_topology, &self.numa_nodes)
    }
}

/// Resident set size of this process in bytes (`VmRSS` from `/proc/self/status`), `None` if
/// unreadable.
pub fn current_rss_bytes() -> Option<u64> {
    parse_meminfo_bytes(&read_string("/proc/self/status")?, "VmRSS")
}

// ---------------------------------------------------------------------------------------------
// Pure parsers and planners (tested without /sys).

/// Parses kernel cpulist syntax ("0-3,8,10-11") into sorted, deduplicated CPU ids.
/// Empty or whitespace-only input is an empty list; anything malformed is `None`.
pub fn parse_cpulist(s: &str) -> Option<Vec<usize>> {
    let s = s.trim();
    let mut cpus = BTreeSet::new();
    if s.is_empty() {
        return Some(Vec::new());
    }
    for part in s.split(',') {
        let (lo, hi) = match part.split_once('-') {
            Some((lo, hi)) => (parse_cpu_id(lo)?, parse_cpu_id(hi)?),
            None => {
                let id = parse_cpu_id(part)?;
                (id, id)
            }
        };
        if lo > hi {
            return None;
        }
        cpus.extend(lo..=hi);
    }
    Some(cpus.into_iter().collect())
}

fn parse_cpu_id(s: &str) -> Option<usize> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok().filter(|&id| id <= MAX_CPU_ID)
}

/// Formats CPU ids in cpulist syntax, the inverse of [`parse_cpulist`] (input need not be sorted).
pub fn format_cpulist(cpus: &[usize]) -> String {
    let sorted: BTreeSet<usize> = cpus.iter().copied().collect();
    let mut ranges: Vec<(usize, usize)> = Vec::new();
    for cpu in sorted {
        match ranges.last_mut() {
            Some((_, hi)) if *hi + 1 == cpu => *hi = cpu,
            _ => ranges.push((cpu, cpu)),
        }
    }
    ranges
        .iter()
        .map(|&(lo, hi)| if lo == hi { lo.to_string() } else { format!("{lo}-{hi}") })
        .collect::<Vec<_>>()
        .join(",")
}

/// Reads a `Key: value [kB]` field from `/proc/meminfo`, a node's `meminfo`
/// ("Node 0 MemTotal: ...") or `/proc/self/status`, in bytes.
pub fn parse_meminfo_bytes(contents: &str, key: &str) -> Option<u64> {
    contents.lines().find_map(|line| {
        let (name, rest) = line.split_once(':')?;
        if name.split_whitespace().last()? != key {
            return None;
        }
        let mut fields = rest.split_whitespace();
        let value: u64 = fields.next()?.parse().ok()?;
        match fields.next() {
            None => Some(value),
            Some(unit) if unit.eq_ignore_ascii_case("kB") => value.checked_mul(1024),
            Some(_) => None,
        }
    })
}

/// The bracketed (selected) mode of a sysfs choice file such as
/// "always [madvise] never".
fn parse_thp_mode(s: &str) -> Option<String> {
    let start = s.find('[')? + 1;
    let len = s[start..].find(']')?;
    let mode = s[start..start + len].trim();
    (!mode.is_empty()).then(|| mode.to_owned())
}

/// The CPU model from `/proc/cpuinfo` ("model name" on x86; other keys elsewhere).
fn parse_cpu_model(cpuinfo: &str) -> Option<String> {
    ["model name", "cpu model", "Model", "Hardware", "Processor"].iter().find_map(|key| {
        cpuinfo.lines().find_map(|line| {
            let (name, value) = line.split_once(':')?;
            let value = value.trim();
            (name.trim() == *key && !value.is_empty()).then(|| value.to_owned())
        })
    })
}

/// Whether the first "flags" line of `/proc/cpuinfo` lists `flag`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn cpuinfo_has_flag(cpuinfo: &str, flag: &str) -> bool {
    cpuinfo
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            (name.trim() == "flags").then_some(value)
        })
        .is_some_and(|flags| flags.split_whitespace().any(|f| f == flag))
}

/// Number of distinct physical cores among `cpus`, and whether any core has several siblings.
fn physical_core_summary(cpus: &[CpuTopology]) -> (usize, bool) {
    let mut siblings: BTreeMap<CoreKey, usize> = BTreeMap::new();
    for t in cpus {
        *siblings.entry(t.core_key()).or_default() += 1;
    }
    (siblings.len(), siblings.values().any(|&n| n > 1))
}

/// The lowest CPU of each physical core, ordered by NUMA node (CPUs in no node last) then id.
fn plan_one_cpu_per_core(cpus: &[CpuTopology], nodes: &[NumaNode]) -> Vec<usize> {
    let mut lowest: BTreeMap<CoreKey, usize> = BTreeMap::new();
    for t in cpus {
        lowest.entry(t.core_key()).and_modify(|c| *c = (*c).min(t.cpu)).or_insert(t.cpu);
    }
    let node_of = |cpu: usize| nodes.iter().find(|n| n.cpus.binary_search(&cpu).is_ok()).map_or(usize::MAX, |n| n.id);
    let mut plan: Vec<(usize, usize)> = lowest.into_values().map(|c| (node_of(c), c)).collect();
    plan.sort_unstable();
    plan.into_iter().map(|(_, cpu)| cpu).collect()
}

// ---------------------------------------------------------------------------------------------
// Readers (Linux files; missing means unknown).

fn read_string(path: impl AsRef<Path>) -> Option<String> {
    fs::read_to_string(path).ok()
}

fn read_u64(path: impl AsRef<Path>) -> Option<u64> {
    read_string(path)?.trim().parse().ok()
}

fn read_i64(path: impl AsRef<Path>) -> Option<i64> {
    read_string(path)?.trim().parse().ok()
}

fn read_topology(cpu: usize) -> CpuTopology {
    let dir = format!("{SYS_CPU}/cpu{cpu}/topology");
    CpuTopology {
        cpu,
        package_id: read_i64(format!("{dir}/physical_package_id")),
        die_id: read_i64(format!("{dir}/die_id")),
        core_id: read_i64(format!("{dir}/core_id")),
    }
}

/// NUMA nodes from sysfs, sorted by id; `None` if there are none to read.
fn read_numa_nodes() -> Option<Vec<NumaNode>> {
    let mut nodes: Vec<NumaNode> = fs::read_dir(SYS_NODE)
        .ok()?
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let id: usize = entry.file_name().to_str()?.strip_prefix("node")?.parse().ok()?;
            let dir = entry.path();
            Some(NumaNode {
                id,
                cpus: read_string(dir.join("cpulist")).and_then(|s| parse_cpulist(&s)).unwrap_or_default(),
                mem_total_bytes: read_string(dir.join("meminfo")).and_then(|s| parse_meminfo_bytes(&s, "MemTotal")),
            })
        })
        .collect();
    nodes.sort_by_key(|n| n.id);
    (!nodes.is_empty()).then_some(nodes)
}

/// CPUs this process may run on, intersected with the online set where both are known.
fn usable_cpus() -> Vec<usize> {
    let online = read_string(format!("{SYS_CPU}/online")).and_then(|s| parse_cpulist(&s));
    let mut cpus = affinity_cpus().or_else(|| online.clone()).filter(|c| !c.is_empty()).unwrap_or_else(|| {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        (0..n).collect()
    });
    if let Some(online) = online {
        let both: Vec<usize> = cpus.iter().copied().filter(|c| online.binary_search(c).is_ok()).collect();
        if !both.is_empty() {
            cpus = both;
        }
    }
    cpus
}

/// The affinity mask of this process, growing the buffer for machines with > 1024 CPUs.
#[cfg(target_os = "linux")]
fn affinity_cpus() -> Option<Vec<usize>> {
    let word_bits = libc::c_ulong::BITS as usize;
    let mut words = 1024 / word_bits;
    while words * word_bits <= MAX_CPU_ID {
        let mut mask: Vec<libc::c_ulong> = vec![0; words];
        let bytes = std::mem::size_of_val(mask.as_slice());
        // SAFETY: `mask` is a writable, suitably aligned buffer of `bytes` bytes and the kernel
        // writes at most `bytes` bytes into it (glibc and musl accept sizes above cpu_set_t).
        let rc = unsafe { libc::sched_getaffinity(0, bytes, mask.as_mut_ptr().cast::<libc::cpu_set_t>()) };
        if rc == 0 {
            let cpus =
                (0..words * word_bits).filter(|&cpu| mask[cpu / word_bits] >> (cpu % word_bits) & 1 == 1).collect();
            return Some(cpus);
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
            return None;
        }
        words *= 2;
    }
    None
}

#[cfg(not(target_os = "linux"))]
fn affinity_cpus() -> Option<Vec<usize>> {
    None
}

/// Physical memory from `sysconf`, for systems without `/proc/meminfo`.
#[cfg(unix)]
fn sysconf_mem_total() -> Option<u64> {
    // SAFETY: sysconf has no preconditions.
    let (pages, page_size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    let pages = u64::try_from(pages).ok()?;
    let page_size = u64::try_from(page_size).ok()?;
    pages.checked_mul(page_size).filter(|&b| b > 0)
}

#[cfg(not(unix))]
fn sysconf_mem_total() -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn topo(cpu: usize, package: i64, core: i64) -> CpuTopology {
        CpuTopology { cpu, package_id: Some(package), die_id: Some(0), core_id: Some(core) }
    }

    #[test]
    fn cpulist_valid() {
        assert_eq!(parse_cpulist("0-3,8,10-11"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpulist("5\n"), Some(vec![5]));
        assert_eq!(parse_cpulist("2-2"), Some(vec![2]));
        assert_eq!(parse_cpulist("4-5,0-1,5"), Some(vec![0, 1, 4, 5]));
        assert_eq!(parse_cpulist(""), Some(vec![]));
        assert_eq!(parse_cpulist(" \n"), Some(vec![]));
    }

    #[test]
    fn cpulist_malformed() {
        for bad in [
            "a",
            "1,,2",
            ",1",
            "1,",
            "-",
            "1-",
            "-3",
            "3-1",
            "1-2-3",
            "1 2",
            "+1",
            "0x3",
            "1.5",
            "1--2",
            "0-99999999",
            "99999999999999999999999",
        ] {
            assert_eq!(parse_cpulist(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn cpulist_format() {
        assert_eq!(format_cpulist(&[11, 0, 1, 2, 3, 8, 10]), "0-3,8,10-11");
        assert_eq!(format_cpulist(&[]), "");
        assert_eq!(format_cpulist(&[7]), "7");
    }

    proptest! {
        #[test]
        fn cpulist_never_panics(s in "\\PC{0,40}") {
            let _ = parse_cpulist(&s);
        }

        #[test]
        fn cpulist_round_trip(cpus in proptest::collection::btree_set(0usize..4096, 0..64)) {
            let cpus: Vec<usize> = cpus.into_iter().collect();
            prop_assert_eq!(parse_cpulist(&format_cpulist(&cpus)), Some(cpus));
        }
    }

    #[test]
    fn meminfo() {
        let proc_meminfo = "MemTotal:       65536000 kB\nMemFree:         1000 kB\n\
                            MemAvailable:   32768000 kB\nHugePages_Total:       4\n";
        assert_eq!(parse_meminfo_bytes(proc_meminfo, "MemTotal"), Some(65_536_000 * 1024));
        assert_eq!(parse_meminfo_bytes(proc_meminfo, "MemAvailable"), Some(32_768_000 * 1024));
        assert_eq!(parse_meminfo_bytes(proc_meminfo, "HugePages_Total"), Some(4));
        assert_eq!(parse_meminfo_bytes(proc_meminfo, "Mem"), None);
        assert_eq!(parse_meminfo_bytes(proc_meminfo, "SwapTotal"), None);

        let node = "Node 1 MemTotal:       1024 kB\nNode 1 MemFree:  512 kB\n";
        assert_eq!(parse_meminfo_bytes(node, "MemTotal"), Some(1024 * 1024));

        let status = "Name:\tkrasis\nVmRSS:\t    2048 kB\n";
        assert_eq!(parse_meminfo_bytes(status, "VmRSS"), Some(2048 * 1024));

        assert_eq!(parse_meminfo_bytes("MemTotal: lots kB\n", "MemTotal"), None);
        assert_eq!(parse_meminfo_bytes("MemTotal: 5 MB\n", "MemTotal"), None);
        assert_eq!(parse_meminfo_bytes("", "MemTotal"), None);
        let huge = format!("MemTotal: {} kB\n", u64::MAX);
        assert_eq!(parse_meminfo_bytes(&huge, "MemTotal"), None);
    }

    #[test]
    fn thp_mode() {
        assert_eq!(parse_thp_mode("always [madvise] never\n").as_deref(), Some("madvise"));
        assert_eq!(parse_thp_mode("[always] madvise never").as_deref(), Some("always"));
        assert_eq!(parse_thp_mode("always madvise [never]").as_deref(), Some("never"));
        assert_eq!(parse_thp_mode("always madvise never"), None);
        assert_eq!(parse_thp_mode("[unclosed"), None);
        assert_eq!(parse_thp_mode("[]"), None);
        assert_eq!(parse_thp_mode(""), None);
    }

    #[test]
    fn cpu_model_and_flags() {
        let info = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) \
                    Platinum 8480+\nflags\t\t: fpu avx2 amx_bf16 amx_tile\n";
        assert_eq!(parse_cpu_model(info).as_deref(), Some("Intel(R) Xeon(R) Platinum 8480+"));
        assert!(cpuinfo_has_flag(info, "amx_tile"));
        assert!(!cpuinfo_has_flag(info, "amx_int8"));
        assert!(!cpuinfo_has_flag(info, "amx"));
        assert_eq!(parse_cpu_model("processor : 0\n"), None);
    }

    #[test]
    fn smt_detection() {
        // 2 cores x 2 threads: cpus 0,1 are cores 0,1; cpus 2,3 their siblings.
        let smt = [topo(0, 0, 0), topo(1, 0, 1), topo(2, 0, 0), topo(3, 0, 1)];
        assert_eq!(physical_core_summary(&smt), (2, true));

        // Affinity excluding the siblings: SMT is not active for us.
        assert_eq!(physical_core_summary(&smt[..2]), (2, false));

        // Same core id on two packages are two different cores.
        let two_sockets = [topo(0, 0, 0), topo(1, 1, 0)];
        assert_eq!(physical_core_summary(&two_sockets), (2, false));

        // Unknown topology: every CPU counts as its own core.
        let unknown: Vec<CpuTopology> = (0..4).map(|cpu| CpuTopology { cpu, ..Default::default() }).collect();
        assert_eq!(physical_core_summary(&unknown), (4, false));
        assert_eq!(physical_core_summary(&[]), (0, false));
    }

    #[test]
    fn one_cpu_per_core_two_nodes() {
        // Two sockets/nodes, 2 cores each, SMT siblings numbered +4 (Linux's usual enumeration):
        // node 0: cpus 0,1 (+ siblings 4,5); node 1: cpus 2,3 (+ siblings 6,7).
        let mut cpu_topology = Vec::new();
        for cpu in 0..8 {
            let package = ((cpu % 4) / 2) as i64;
            let core = (cpu % 2) as i64;
            cpu_topology.push(topo(cpu, package, core));
        }
        let report = SystemReport {
            logical_cpus: 8,
            physical_cores: 4,
            smt_active: true,
            cpu_topology,
            numa_nodes: vec![
                NumaNode { id: 1, cpus: vec![2, 3, 6, 7], mem_total_bytes: None },
                NumaNode { id: 0, cpus: vec![0, 1, 4, 5], mem_total_bytes: None },
            ],
            ..Default::default()
        };
        assert_eq!(report.one_cpu_per_core(), vec![0, 1, 2, 3]);

        // Nodes whose CPUs interleave: ordering is by node first, then id.
        let interleaved = [topo(0, 0, 0), topo(1, 1, 0), topo(2, 0, 1), topo(3, 1, 1)];
        let nodes = [
            NumaNode { id: 0, cpus: vec![0, 2], mem_total_bytes: None },
            NumaNode { id: 1, cpus: vec![1, 3], mem_total_bytes: None },
        ];
        assert_eq!(plan_one_cpu_per_core(&interleaved, &nodes), vec![0, 2, 1, 3]);

        // Lowest sibling wins even if the topology list is unsorted; CPUs in no node go last.
        let unsorted = [topo(9, 0, 0), topo(5, 0, 0), topo(7, 0, 1)];
        let node0 = [NumaNode { id: 0, cpus: vec![7], mem_total_bytes: None }];
        assert_eq!(plan_one_cpu_per_core(&unsorted, &node0), vec![7, 5]);
    }

    #[test]
    fn warnings_cover_findings() {
        let report = SystemReport {
            logical_cpus: 8,
            physical_cores: 4,
            smt_active: true,
            cpu_topology: (0..8).map(|c| topo(c, 0, (c % 4) as i64)).collect(),
            numa_nodes: vec![NumaNode::default(), NumaNode::default()],
            thp_enabled: Some("never".to_owned()),
            governors: vec!["performance".to_owned(), "powersave".to_owned()],
            isa: IsaFlags { avx2: true, ..Default::default() },
            ..Default::default()
        };
        let w = report.warnings(HUGE_PAGES_1G_MATTER_BYTES).join("\n");
        assert!(w.contains("SMT is on (8 logical CPUs on 4 physical cores)"), "{w}");
        assert!(w.contains("powersave") && !w.contains("governor is performance"), "{w}");
        assert!(w.contains("\"never\""), "{w}");
        assert!(w.contains("1 GiB hugepages"), "{w}");
        assert!(w.contains("2 NUMA nodes"), "{w}");
        assert!(!w.contains("topology unreadable"), "{w}");

        let clean = SystemReport {
            logical_cpus: 4,
            physical_cores: 4,
            cpu_topology: (0..4).map(|c| topo(c, 0, c as i64)).collect(),
            numa_nodes: vec![NumaNode::default()],
            thp_enabled: Some("madvise".to_owned()),
            hugepages_1g_total: 8,
            governors: vec!["performance".to_owned()],
            isa: IsaFlags { avx2: true, ..Default::default() },
            ..Default::default()
        };
        assert_eq!(clean.warnings(HUGE_PAGES_1G_MATTER_BYTES), Vec::<String>::new());

        // The page-size findings only for weights large enough that page size matters.
        let small = report.warnings(THP_MATTERS_BYTES - 1).join("\n");
        assert!(!small.contains("hugepages") && small.contains("SMT is on"), "{small}");
        let mid = report.warnings(HUGE_PAGES_1G_MATTER_BYTES - 1).join("\n");
        assert!(mid.contains("\"never\"") && !mid.contains("1 GiB hugepages"), "{mid}");
    }

    #[test]
    fn probe_this_machine() {
        let r = probe();
        assert!(r.logical_cpus >= 1);
        assert!(r.physical_cores >= 1 && r.physical_cores <= r.logical_cpus);
        assert_eq!(r.cpu_topology.len(), r.logical_cpus);
        assert!(r.mem_total_bytes > 0);
        assert!(r.mem_available_bytes <= r.mem_total_bytes);
        assert!(!r.numa_nodes.is_empty());
        let plan = r.one_cpu_per_core();
        assert_eq!(plan.len(), r.physical_cores);
        assert!(plan.iter().all(|c| r.cpu_topology.iter().any(|t| t.cpu == *c)));
        let _ = r.warnings(0);
        #[cfg(target_os = "linux")]
        assert!(current_rss_bytes().is_some_and(|b| b > 0));
    }
}
