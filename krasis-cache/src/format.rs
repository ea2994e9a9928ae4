//! The file format: preamble, JSON header, checksum table, records (spec in docs/FORMATS.md).

use std::fs::File;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::container::{check_common_fields, read_checksum_table, read_preamble_and_header};
use crate::CacheError;

/// First eight bytes of every expert cache file.
pub const MAGIC: [u8; 8] = *b"KRASISXC";
/// Version of the file layout described in docs/FORMATS.md; a file of another version is stale
/// (rebuilt, never read). 2: per-layer, per-projection bits and record sizes (1 had one `bits`).
pub const FORMAT_VERSION: u32 = 2;
/// Size of the fixed binary preamble at offset 0.
pub const PREAMBLE_BYTES: u64 = 64;
/// Alignment of every record in the file (and in memory once loaded).
pub const RECORD_ALIGN: u64 = 4096;
/// Alignment of the w2 part inside a record.
pub const W2_ALIGN: u64 = 64;
/// Name of the per-record checksum, as written in the header.
pub const CHECKSUM_NAME: &str = "xxh3-64";
/// Record order, as written in the header.
pub const RECORD_ORDER: &str = "layer-major, expert-minor";
/// Headers larger than this are refused as corrupt (a real one is a few KiB).
pub const MAX_HEADER_BYTES: u64 = 16 << 20;

/// What a cache holds and how it was made. The caller builds the expected header from the model
/// (and the packer's layout name and record sizes); `open` refuses a file whose header differs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheHeader {
    /// Must be [`FORMAT_VERSION`].
    pub format_version: u32,
    /// Record layout name from the packer, e.g. `"cpu-rb16-v1"`.
    pub layout: String,
    /// Hash of the model's config and weight-file identity, computed by the caller.
    pub config_hash: u64,
    pub group_size_hidden: u32,
    pub group_size_intermediate: u32,
    pub hidden: u32,
    pub intermediate: u32,
    pub n_experts: u32,
    /// Model layer indices of the MoE layers, in order; records are indexed by position in this list.
    pub moe_layers: Vec<u32>,
    /// Per MoE layer (parallel to `moe_layers`): the bits and sizes of its records' two parts.
    /// Layers may differ (a GGUF's Q4_K_M stores some layers' down projections in Q6_K).
    pub parts: Vec<LayerParts>,
}

/// The two parts of every record of one MoE layer: fused gate+up (w13) and down (w2), each with
/// the integer width it was quantised to and its packed size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerParts {
    pub w13_bits: u8,
    pub w2_bits: u8,
    /// Bytes of the fused gate+up part of a record.
    pub w13_bytes: u64,
    /// Bytes of the down part of a record.
    pub w2_bytes: u64,
}

impl CacheHeader {
    /// `Some(b)` when every projection of every layer is `b` bits wide.
    pub fn uniform_bits(&self) -> Option<u8> {
        let b = self.parts.first()?.w13_bits;
        self.parts.iter().all(|p| p.w13_bits == b && p.w2_bits == b).then_some(b)
    }

    /// The records' format for logs: the 4-bit float, asymmetric INT4 or GGUF-blocks format a
    /// layout name carries (`cpu-rb16-mxfp4-v1`: `"mxfp4"`, whose widths say only 4 bits), else the
    /// per-projection widths (see [`describe_widths`]).
    pub fn bits_summary(&self) -> String {
        if let Some(f) = LAYOUT_FORMATS.iter().find(|f| self.layout.split('-').any(|part| part == **f)) {
            return f.to_string();
        }
        describe_widths(&self.parts.iter().map(|p| (p.w13_bits, p.w2_bits)).collect::<Vec<_>>())
    }
}

/// The formats a layout name names as a `-`-separated part beyond its widths (the CPU and GPU FP4
/// layouts, asymmetric INT4, GGUF blocks kept as stored, whose widths 4 / 6 / 8 name Q4_K, Q6_K
/// and INT8 g32).
const LAYOUT_FORMATS: [&str; 4] = ["mxfp4", "nvfp4", "int4a", "ggml"];

/// Per-layer `(w13, w2)` widths for logs: `"int4"` when every projection is INT4, else each
/// distinct pair with its layer count: `"w13 int4 / w2 int8 × 10 layers, w13 int4 / w2 int4 × 16
/// layers"`.
pub fn describe_widths(widths: &[(u8, u8)]) -> String {
    if let Some(&(b, _)) = widths.first() {
        if widths.iter().all(|&(a, c)| a == b && c == b) {
            return format!("int{b}");
        }
    }
    describe_layer_runs(widths, |(a, b)| format!("w13 int{a} / w2 int{b}"))
}

/// Each distinct item of `layers` (one per layer) shown by `show` with its layer count, in order
/// of first appearance: `"<shown> × 10 layers, <shown> × 1 layer"`.
pub fn describe_layer_runs<K: PartialEq + Copy>(layers: &[K], show: impl Fn(K) -> String) -> String {
    let mut runs: Vec<(K, usize)> = Vec::new();
    for &w in layers {
        match runs.iter_mut().find(|(k, _)| *k == w) {
            Some((_, n)) => *n += 1,
            None => runs.push((w, 1)),
        }
    }
    let shown: Vec<String> =
        runs.iter().map(|&(k, n)| format!("{} × {n} layer{}", show(k), if n == 1 { "" } else { "s" })).collect();
    shown.join(", ")
}

/// `experts_cpu_int{bits}_g{group_size}.bin` for a cache whose projections are all `bits` wide,
/// `experts_cpu_mixed_g{group_size}.bin` (`bits` `None`) for one that mixes widths.
pub fn cache_file_name(bits: Option<u8>, group_size: u32) -> String {
    match bits {
        Some(b) => format!("experts_cpu_int{b}_g{group_size}.bin"),
        None => format!("experts_cpu_mixed_g{group_size}.bin"),
    }
}

/// Bytes of all records of a cache with this header (what a loaded cache holds resident);
/// `None` when the header's sizes are invalid.
pub fn records_bytes(h: &CacheHeader) -> Option<u64> {
    let (_, _, bytes) = Layout::geometry(h).ok()?;
    Some(bytes)
}

pub(crate) fn round_up(x: u64, a: u64) -> Option<u64> {
    x.checked_add(a - 1).map(|v| v / a * a)
}

/// Where the records of one MoE layer lie.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LayerGeom {
    /// Offset of w2 inside each record.
    pub w2_offset: u64,
    /// Bytes between consecutive records of the layer (a multiple of [`RECORD_ALIGN`]).
    pub stride: u64,
    /// Offset of the layer's first record from the first record of the file.
    pub start: u64,
}

/// Where everything lies in a file with this header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub layers: Vec<LayerGeom>,
    pub n_experts: u64,
    pub record_count: u64,
    pub header_len: u64,
    pub table_offset: u64,
    pub records_offset: u64,
    /// Bytes of all records, padding included.
    pub records_bytes: u64,
    pub file_len: u64,
}

impl Layout {
    /// Record geometry: each layer's, the record count and the bytes of all records.
    pub fn geometry(h: &CacheHeader) -> Result<(Vec<LayerGeom>, u64, u64), String> {
        if h.n_experts == 0 || h.moe_layers.is_empty() {
            return Err(format!("no records ({} MoE layers, {} experts)", h.moe_layers.len(), h.n_experts));
        }
        if h.parts.len() != h.moe_layers.len() {
            return Err(format!("{} layer part entries for {} MoE layers", h.parts.len(), h.moe_layers.len()));
        }
        let overflow = || "record sizes overflow".to_string();
        let mut layers = Vec::with_capacity(h.parts.len());
        let mut start = 0u64;
        for (p, layer) in h.parts.iter().zip(&h.moe_layers) {
            if p.w13_bytes == 0 || p.w2_bytes == 0 {
                return Err(format!(
                    "empty record part at layer {layer} (w13_bytes {}, w2_bytes {})",
                    p.w13_bytes, p.w2_bytes
                ));
            }
            let w2_offset = round_up(p.w13_bytes, W2_ALIGN).ok_or_else(overflow)?;
            let stride =
                round_up(w2_offset.checked_add(p.w2_bytes).ok_or_else(overflow)?, RECORD_ALIGN).ok_or_else(overflow)?;
            layers.push(LayerGeom { w2_offset, stride, start });
            let layer_bytes = stride.checked_mul(h.n_experts as u64).ok_or_else(overflow)?;
            start = start.checked_add(layer_bytes).ok_or_else(overflow)?;
        }
        let count = (h.moe_layers.len() as u64).checked_mul(h.n_experts as u64).ok_or_else(overflow)?;
        if usize::try_from(start).is_err() {
            return Err(overflow());
        }
        Ok((layers, count, start))
    }

    pub fn new(h: &CacheHeader, header_len: u64) -> Result<Layout, String> {
        let (layers, record_count, records_bytes) = Self::geometry(h)?;
        let overflow = || "file size overflows".to_string();
        let table_offset = round_up(PREAMBLE_BYTES + header_len, 8).ok_or_else(overflow)?;
        let table_end = record_count.checked_mul(8).and_then(|t| t.checked_add(table_offset)).ok_or_else(overflow)?;
        let records_offset = round_up(table_end, RECORD_ALIGN).ok_or_else(overflow)?;
        let file_len = records_bytes.checked_add(records_offset).ok_or_else(overflow)?;
        Ok(Layout {
            layers,
            n_experts: h.n_experts as u64,
            record_count,
            header_len,
            table_offset,
            records_offset,
            records_bytes,
            file_len,
        })
    }

    /// The geometry of the layer holding record `index`.
    pub fn layer_of(&self, index: usize) -> &LayerGeom {
        &self.layers[index / self.n_experts as usize]
    }

    /// Offset of record `index` from the first record (in the file and in the loaded buffer).
    pub fn record_start(&self, index: usize) -> u64 {
        let g = self.layer_of(index);
        g.start + (index as u64 % self.n_experts) * g.stride
    }

    /// Offset of record `index` in the file.
    pub fn record_offset(&self, index: usize) -> u64 {
        self.records_offset + self.record_start(index)
    }
}

/// The fixed binary preamble at offset 0 (little-endian).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Preamble {
    pub magic: [u8; 8],
    pub format_version: u32,
    pub header_len: u64,
    pub header_xxh3: u64,
    pub table_xxh3: u64,
    /// Whether the reserved bytes (12..16 and 40..64) are all zero.
    pub reserved_zero: bool,
}

impl Preamble {
    pub fn encode(&self) -> [u8; PREAMBLE_BYTES as usize] {
        let mut b = [0u8; PREAMBLE_BYTES as usize];
        b[0..8].copy_from_slice(&self.magic);
        b[8..12].copy_from_slice(&self.format_version.to_le_bytes());
        b[16..24].copy_from_slice(&self.header_len.to_le_bytes());
        b[24..32].copy_from_slice(&self.header_xxh3.to_le_bytes());
        b[32..40].copy_from_slice(&self.table_xxh3.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; PREAMBLE_BYTES as usize]) -> Preamble {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        Preamble {
            magic: b[0..8].try_into().unwrap(),
            format_version: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            header_len: u64_at(16),
            header_xxh3: u64_at(24),
            table_xxh3: u64_at(32),
            reserved_zero: b[12..16].iter().chain(&b[40..64]).all(|&x| x == 0),
        }
    }
}

/// One MoE layer's entry of the JSON header.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct DiskLayer {
    layer: u32,
    w13_bits: u8,
    w2_bits: u8,
    w13_bytes: u64,
    w2_bytes: u64,
    w2_offset: u64,
    record_stride: u64,
    /// Offset of the layer's first record from `records_offset`.
    layer_offset: u64,
}

/// The JSON header as stored in the file. Unknown fields are refused, so a header of another
/// version's shape never parses as this one.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct DiskHeader {
    format_version: u32,
    layout: String,
    config_hash: String,
    group_size_hidden: u32,
    group_size_intermediate: u32,
    hidden: u32,
    intermediate: u32,
    n_experts: u32,
    layers: Vec<DiskLayer>,
    record_count: u64,
    records_bytes: u64,
    record_order: String,
    checksum: String,
    writer: String,
}

/// The JSON header bytes for `h` (which must have valid geometry).
pub(crate) fn header_json(h: &CacheHeader) -> Result<Vec<u8>, String> {
    let (geom, count, records_bytes) = Layout::geometry(h)?;
    let layers = h
        .moe_layers
        .iter()
        .zip(&h.parts)
        .zip(&geom)
        .map(|((&layer, p), g)| DiskLayer {
            layer,
            w13_bits: p.w13_bits,
            w2_bits: p.w2_bits,
            w13_bytes: p.w13_bytes,
            w2_bytes: p.w2_bytes,
            w2_offset: g.w2_offset,
            record_stride: g.stride,
            layer_offset: g.start,
        })
        .collect();
    let d = DiskHeader {
        format_version: h.format_version,
        layout: h.layout.clone(),
        config_hash: format!("{:#018x}", h.config_hash),
        group_size_hidden: h.group_size_hidden,
        group_size_intermediate: h.group_size_intermediate,
        hidden: h.hidden,
        intermediate: h.intermediate,
        n_experts: h.n_experts,
        layers,
        record_count: count,
        records_bytes,
        record_order: RECORD_ORDER.into(),
        checksum: CHECKSUM_NAME.into(),
        writer: concat!("krasis-cache ", env!("CARGO_PKG_VERSION")).into(),
    };
    serde_json::to_vec(&d).map_err(|e| e.to_string())
}

fn parse_header_json(bytes: &[u8]) -> Result<CacheHeader, String> {
    let d: DiskHeader = serde_json::from_slice(bytes).map_err(|e| format!("not a valid header: {e}"))?;
    let config_hash = check_common_fields(&d.config_hash, d.format_version, FORMAT_VERSION, &d.checksum)?;
    if d.record_order != RECORD_ORDER {
        return Err(format!("record order {:?}, expected {RECORD_ORDER:?}", d.record_order));
    }
    let h = CacheHeader {
        format_version: d.format_version,
        layout: d.layout,
        config_hash,
        group_size_hidden: d.group_size_hidden,
        group_size_intermediate: d.group_size_intermediate,
        hidden: d.hidden,
        intermediate: d.intermediate,
        n_experts: d.n_experts,
        moe_layers: d.layers.iter().map(|l| l.layer).collect(),
        parts: d
            .layers
            .iter()
            .map(|l| LayerParts {
                w13_bits: l.w13_bits,
                w2_bits: l.w2_bits,
                w13_bytes: l.w13_bytes,
                w2_bytes: l.w2_bytes,
            })
            .collect(),
    };
    let (geom, count, records_bytes) = Layout::geometry(&h)?;
    if (d.record_count, d.records_bytes) != (count, records_bytes) {
        return Err(format!(
            "record_count/records_bytes {}/{} disagree with the record sizes ({count}/{records_bytes})",
            d.record_count, d.records_bytes
        ));
    }
    for (l, g) in d.layers.iter().zip(&geom) {
        if (l.w2_offset, l.record_stride, l.layer_offset) != (g.w2_offset, g.stride, g.start) {
            return Err(format!(
                "layer {}: w2_offset/record_stride/layer_offset {}/{}/{} disagree with the record sizes ({}/{}/{})",
                l.layer, l.w2_offset, l.record_stride, l.layer_offset, g.w2_offset, g.stride, g.start
            ));
        }
    }
    Ok(h)
}

fn show_layers(v: &[u32]) -> String {
    if v.len() <= 8 {
        format!("{v:?}")
    } else {
        let head: Vec<String> = v[..3].iter().map(|x| x.to_string()).collect();
        format!("[{}, …, {}] ({} layers)", head.join(", "), v[v.len() - 1], v.len())
    }
}

/// The first field in which `cache` differs from `expected`: `(field, cache value, expected value)`.
pub(crate) fn first_difference(cache: &CacheHeader, expected: &CacheHeader) -> Option<(&'static str, String, String)> {
    macro_rules! cmp {
        ($f:ident) => {
            if cache.$f != expected.$f {
                return Some((stringify!($f), cache.$f.to_string(), expected.$f.to_string()));
            }
        };
    }
    if cache.config_hash != expected.config_hash {
        return Some((
            "config_hash",
            format!("{:#018x}", cache.config_hash),
            format!("{:#018x}", expected.config_hash),
        ));
    }
    cmp!(format_version);
    if cache.layout != expected.layout {
        return Some(("layout", format!("{:?}", cache.layout), format!("{:?}", expected.layout)));
    }
    cmp!(group_size_hidden);
    cmp!(group_size_intermediate);
    cmp!(hidden);
    cmp!(intermediate);
    cmp!(n_experts);
    if cache.moe_layers != expected.moe_layers {
        return Some(("moe_layers", show_layers(&cache.moe_layers), show_layers(&expected.moe_layers)));
    }
    if cache.parts.len() != expected.parts.len() {
        return Some(("parts", format!("{} layers", cache.parts.len()), format!("{} layers", expected.parts.len())));
    }
    for ((c, e), layer) in cache.parts.iter().zip(&expected.parts).zip(&cache.moe_layers) {
        let fields: [(&'static str, u64, u64); 4] = [
            ("w13_bits", c.w13_bits.into(), e.w13_bits.into()),
            ("w2_bits", c.w2_bits.into(), e.w2_bits.into()),
            ("w13_bytes", c.w13_bytes, e.w13_bytes),
            ("w2_bytes", c.w2_bytes, e.w2_bytes),
        ];
        if let Some((field, c, e)) = fields.into_iter().find(|(_, c, e)| c != e) {
            return Some((field, format!("{c} at layer {layer}"), e.to_string()));
        }
    }
    None
}

/// Read and check everything but the records: preamble, header, size, checksum table.
/// Returns the header, the layout and the per-record checksums.
pub(crate) fn read_header(file: &File, path: &Path) -> Result<(CacheHeader, Layout, Vec<u64>), CacheError> {
    let p = || path.to_path_buf();
    let (pre, json, len) = read_preamble_and_header(file, path, MAGIC, FORMAT_VERSION)?;
    let header = parse_header_json(&json).map_err(|detail| CacheError::HeaderInvalid { path: p(), detail })?;
    let layout =
        Layout::new(&header, pre.header_len).map_err(|detail| CacheError::HeaderInvalid { path: p(), detail })?;
    if len != layout.file_len {
        return Err(CacheError::SizeMismatch {
            path: p(),
            actual: len,
            expected: layout.file_len,
            what: "the header implies",
        });
    }
    let sums = read_checksum_table(file, path, &pre, layout.table_offset, layout.record_count)?;
    Ok((header, layout, sums))
}
