//! GGUF input (llama.cpp's container): a validated, zero-copy reader over the file's mapping
//! ([`header`]), split files (`name-00001-of-0000N.gguf`), llama.cpp's architectures and tensor
//! names mapped to the canonical ones ([`arch`]), and a [`WeightSource`] that serves F32/F16/BF16
//! tensors straight from the mapping and dequantises block types (`krasis_quant::ggml`) on read.

pub mod arch;
pub mod header;
pub mod writer;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use krasis_core::DType;
use krasis_quant::ggml::{self, GgmlType};
use memmap2::Mmap;

pub use self::arch::{expert_source_types, spec_from_gguf, GgufTensorRef, Rearranged, StoredValues, TensorMap};
pub use self::header::{Header, TensorInfo, Value, ValueType};

use super::{fnv1a, SharedBytes, StoredTensor, WeightSource};
use crate::error::{ModelError, Result};

/// Split files in one model: llama.cpp's `gguf-split` caps it at 3 digits' worth; 4096 is far
/// above any real model and bounds the files opened from a name.
const MAX_SPLITS: usize = 4096;

fn gguf_err(path: &Path, msg: impl Into<String>) -> ModelError {
    ModelError::Gguf { path: path.to_path_buf(), msg: msg.into() }
}

/// One GGUF file: its mapping and validated header.
pub struct GgufFile {
    pub path: PathBuf,
    pub map: Arc<Mmap>,
    /// The mapped file, kept open for positioned reads ([`SharedBytes::read_at`]).
    pub file: Arc<std::fs::File>,
    pub header: Header,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile> {
        let f = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: read-only mapping; a file truncated under us is outside what any reader of a
        // mapped model can defend against (the safetensors reader accepts the same).
        let map = unsafe { Mmap::map(&f) }.map_err(|e| ModelError::io(path, e))?;
        let header = header::parse(&map).map_err(|m| gguf_err(path, m))?;
        Ok(GgufFile { path: path.to_path_buf(), map: Arc::new(map), file: Arc::new(f), header })
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}

/// `(prefix, index, count)` of a split file name `prefix-00001-of-00003.gguf`.
fn split_name(path: &Path) -> Option<(String, usize, usize)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, index) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(index) || !digits(count) {
        return None;
    }
    Some((prefix.to_string(), index.parse().ok()?, count.parse().ok()?))
}

/// A GGUF model: one file, or every split of a split model (any split's name opens all).
pub struct GgufModel {
    files: Vec<GgufFile>,
    /// Tensor name → (file, tensor index).
    index: HashMap<String, (usize, usize)>,
}

impl GgufModel {
    pub fn open(path: &Path) -> Result<GgufModel> {
        if !path.is_file() {
            return Err(ModelError::MissingDir(path.to_path_buf()));
        }
        let paths = match split_name(path) {
            Some((prefix, _, count)) => {
                if count == 0 || count > MAX_SPLITS {
                    return Err(gguf_err(
                        path,
                        format!("split count {count} in the file name is out of range 1..={MAX_SPLITS}"),
                    ));
                }
                let dir = path.parent().unwrap_or(Path::new("."));
                (1..=count).map(|i| dir.join(format!("{prefix}-{i:05}-of-{count:05}.gguf"))).collect()
            }
            None => vec![path.to_path_buf()],
        };
        let mut files = Vec::with_capacity(paths.len());
        for p in &paths {
            if !p.is_file() {
                return Err(gguf_err(p, format!("split file missing (opening {})", path.display())));
            }
            files.push(GgufFile::open(p)?);
        }
        if paths.len() > 1 {
            for (i, f) in files.iter().enumerate() {
                let want = |key: &str, v: usize| -> Result<()> {
                    match f.header.kv.get(key).and_then(Value::as_int) {
                        Some(x) if x == v as i128 => Ok(()),
                        Some(x) => Err(gguf_err(&f.path, format!("metadata `{key}` is {x}, the file name says {v}"))),
                        None => Ok(()),
                    }
                };
                want("split.no", i)?;
                want("split.count", paths.len())?;
            }
        }
        let mut index = HashMap::new();
        for (fi, f) in files.iter().enumerate() {
            for (ti, t) in f.header.tensors.iter().enumerate() {
                if let Some((prev, _)) = index.insert(t.name.clone(), (fi, ti)) {
                    return Err(gguf_err(
                        &f.path,
                        format!("tensor `{}` is also in {}", header::shown(&t.name), files[prev].path.display()),
                    ));
                }
            }
        }
        Ok(GgufModel { files, index })
    }

    /// The first (or only) file: where the model's metadata lives.
    pub fn main(&self) -> &GgufFile {
        &self.files[0]
    }

    pub fn files(&self) -> &[GgufFile] {
        &self.files
    }

    pub fn path(&self) -> &Path {
        &self.files[0].path
    }

    /// A metadata value of the main file.
    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.main().header.kv.get(key)
    }

    /// A string metadata value.
    pub fn meta_str(&self, key: &str) -> Option<&str> {
        self.meta(key).and_then(|v| v.as_str(self.main().bytes()))
    }

    /// A tensor's header entry and its file.
    pub fn tensor_info(&self, name: &str) -> Option<(&GgufFile, &TensorInfo)> {
        let &(fi, ti) = self.index.get(name)?;
        let f = &self.files[fi];
        Some((f, &f.header.tensors[ti]))
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Every tensor name, in file order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.files.iter().flat_map(|f| f.header.tensors.iter().map(|t| t.name.as_str()))
    }

    /// Identity for cache keys: every file's name, size and header bytes (metadata and tensor
    /// infos, which carry every tensor's type, shape and offset).
    pub fn fingerprint(&self) -> u64 {
        let mut h = fnv1a(0, b"gguf");
        for f in &self.files {
            let name = f.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            h = fnv1a(h, name.as_bytes());
            h = fnv1a(h, &(f.map.len() as u64).to_le_bytes());
            h = fnv1a(h, &f.map[..f.header.data_offset.min(f.map.len())]);
        }
        h
    }
}

/// The weights of a GGUF model by canonical tensor name.
pub struct GgufSource {
    model: Arc<GgufModel>,
    map: TensorMap,
}

impl GgufSource {
    pub fn new(model: Arc<GgufModel>, map: TensorMap) -> Self {
        GgufSource { model, map }
    }

    /// The ggml type a canonical tensor is stored in (for precision choices and reports).
    pub fn stored_type(&self, name: &str) -> Option<GgmlType> {
        let r = self.map.get(name)?;
        self.model.tensor_info(r.primary()).map(|(_, t)| t.ty)
    }

    /// Where `r` lies when it is one stored tensor or one expert's slice of a stacked one (a weight
    /// `[experts, rows, cols]` or a bias `[experts, rows]`): its file, tensor, first element and
    /// shape. `None` for the tensors rebuilt from others; an expert past the stack is an error.
    fn span(&self, r: &GgufTensorRef) -> Result<Option<Span<'_>>> {
        let span = |file, info, first, shape| Ok(Some(Span { file, info, first, shape }));
        match r {
            GgufTensorRef::Whole(g) => {
                let (f, t) = self.whole(g)?;
                span(f, t, 0, t.shape())
            }
            GgufTensorRef::Expert { stacked, expert } => {
                let (f, t) = self.whole(stacked)?;
                let s = t.shape();
                match *s.as_slice() {
                    [n, rows, cols] if *expert < n => span(f, t, expert * rows * cols, vec![rows, cols]),
                    [n, rows] if *expert < n => span(f, t, expert * rows, vec![rows]),
                    _ => Err(gguf_err(&f.path, format!("`{stacked}` {s:?} has no expert {expert}"))),
                }
            }
            GgufTensorRef::KvB { .. } | GgufTensorRef::Rearranged(_) => Ok(None),
        }
    }

    /// The file bytes of `elements` values of `t` from element `first` (whole blocks).
    fn raw_range(file: &GgufFile, t: &TensorInfo, first: usize, elements: usize) -> Result<std::ops::Range<usize>> {
        let bs = t.ty.block_elems();
        if !first.is_multiple_of(bs) || !elements.is_multiple_of(bs) || first + elements > t.elements() {
            return Err(gguf_err(
                &file.path,
                format!("tensor `{}`: slice {first}+{elements} is not whole blocks", header::shown(&t.name)),
            ));
        }
        let start = t.data.start + first / bs * t.ty.block_bytes();
        Ok(start..start + elements / bs * t.ty.block_bytes())
    }

    /// `elements` values of `t` starting at element `first` (whole blocks), as a stored tensor.
    fn slice(&self, file: &GgufFile, t: &TensorInfo, first: usize, shape: Vec<usize>) -> Result<StoredTensor> {
        let elements: usize = shape.iter().product();
        let raw = Self::raw_range(file, t, first, elements)?;
        let mapped = |raw| SharedBytes::of_file(Arc::clone(&file.map), Arc::clone(&file.file), raw);
        let (dtype, bytes) = match t.ty {
            GgmlType::F32 => (DType::F32, mapped(raw)),
            GgmlType::F16 => (DType::F16, mapped(raw)),
            GgmlType::BF16 => (DType::BF16, mapped(raw)),
            ty => {
                let v = ggml::dequantize_vec(ty, &file.map[raw], elements)
                    .map_err(|e| gguf_err(&file.path, format!("tensor `{}`: {e}", header::shown(&t.name))))?;
                (DType::F32, SharedBytes::from_f32(v))
            }
        };
        Ok(StoredTensor { dtype, shape, bytes, file: file.path.clone() })
    }

    fn whole(&self, name: &str) -> Result<(&GgufFile, &TensorInfo)> {
        self.model
            .tensor_info(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.to_string(), dir: self.model.path().to_path_buf() })
    }

    /// MLA's `kv_b_proj` `[heads·(nope+v), rank]` rebuilt from llama.cpp's split form:
    /// `attn_k_b` `[heads, rank, nope]` (transposed) and `attn_v_b` `[heads, v, rank]`.
    fn kv_b(&self, k_b: &str, v_b: &str) -> Result<StoredTensor> {
        let (kf, kt) = self.whole(k_b)?;
        let (vf, vt) = self.whole(v_b)?;
        let (ks, vs) = (kt.shape(), vt.shape());
        let bad = || {
            gguf_err(
                &kf.path,
                format!("`{k_b}` {ks:?} and `{v_b}` {vs:?} are not [heads, rank, nope] and [heads, v, rank]"),
            )
        };
        let [heads, rank, nope] = ks[..] else { return Err(bad()) };
        let [vh, v, vrank] = vs[..] else { return Err(bad()) };
        if vh != heads || vrank != rank {
            return Err(bad());
        }
        let k = self.slice(kf, kt, 0, ks.clone())?.view().to_f32_vec().ok_or_else(bad)?;
        let vv = self.slice(vf, vt, 0, vs.clone())?.view().to_f32_vec().ok_or_else(bad)?;
        let mut out = vec![0f32; heads * (nope + v) * rank];
        for h in 0..heads {
            let base = h * (nope + v) * rank;
            for n in 0..nope {
                for r in 0..rank {
                    out[base + n * rank + r] = k[(h * rank + r) * nope + n];
                }
            }
            let vsrc = &vv[h * v * rank..(h + 1) * v * rank];
            out[base + nope * rank..base + (nope + v) * rank].copy_from_slice(vsrc);
        }
        Ok(StoredTensor {
            dtype: DType::F32,
            shape: vec![heads * (nope + v), rank],
            bytes: SharedBytes::from_f32(out),
            file: kf.path.clone(),
        })
    }
}

impl GgufSource {
    /// A [`Rearranged`] tensor: the stored values gathered (and mapped) into the canonical order,
    /// in the stored float type (block types dequantised to f32; `ssm_a` served as f32 `A_log`).
    fn rearranged(&self, r: &Rearranged) -> Result<StoredTensor> {
        let (f, t) = self.whole(&r.from)?;
        let name = header::shown(&t.name);
        if t.shape() != r.stored {
            return Err(gguf_err(
                &f.path,
                format!("tensor `{name}` has shape {:?}, expected {:?}", t.shape(), r.stored),
            ));
        }
        let stored = self.slice(f, t, 0, t.shape())?;
        if r.rows.is_none() && r.cols.is_none() && r.values == StoredValues::AsStored {
            if stored.shape.iter().product::<usize>() != r.shape.iter().product::<usize>() {
                return Err(gguf_err(
                    &f.path,
                    format!("tensor `{name}` {:?} cannot be read as {:?}", t.shape(), r.shape),
                ));
            }
            return Ok(StoredTensor { shape: r.shape.clone(), ..stored });
        }
        let (dtype, bytes) = match r.values {
            StoredValues::AsStored => (stored.dtype, stored.bytes),
            StoredValues::NegExp => {
                let v = stored.view().to_f32_vec().expect("served tensors are floats");
                let a_log =
                    v.iter().map(|&a| arch::qwen3next::a_log_of(a)).collect::<Option<Vec<f32>>>().ok_or_else(|| {
                        gguf_err(
                            &f.path,
                            format!("tensor `{name}`: a value is not negative and finite (it is −exp(A_log))"),
                        )
                    })?;
                (DType::F32, SharedBytes::from_f32(a_log))
            }
        };
        let es = dtype.size_bytes();
        let width = r.stored.last().copied().unwrap_or(1).max(1);
        let src = bytes.as_slice();
        let n_rows = src.len() / (width * es);
        let rows: Vec<usize> = r.rows.clone().unwrap_or_else(|| (0..n_rows).collect());
        let out_width = r.cols.as_ref().map_or(width, Vec::len);
        if rows.iter().any(|&i| i >= n_rows)
            || r.cols.as_ref().is_some_and(|c| c.iter().any(|&j| j >= width))
            || rows.len() * out_width != r.shape.iter().product::<usize>()
        {
            return Err(gguf_err(
                &f.path,
                format!("tensor `{name}` {:?} cannot be rearranged into {:?}", t.shape(), r.shape),
            ));
        }
        let mut out = Vec::with_capacity(rows.len() * out_width * es);
        for &i in &rows {
            let row = &src[i * width * es..(i + 1) * width * es];
            match &r.cols {
                None => out.extend_from_slice(row),
                Some(cols) => cols.iter().for_each(|&j| out.extend_from_slice(&row[j * es..(j + 1) * es])),
            }
        }
        Ok(StoredTensor { dtype, shape: r.shape.clone(), bytes: SharedBytes::from_bytes(&out), file: f.path.clone() })
    }
}

/// Where a stored tensor (or one expert's slice of a stacked one) lies ([`GgufSource::span`]).
struct Span<'a> {
    file: &'a GgufFile,
    info: &'a TensorInfo,
    /// First element within `info`'s tensor, and the slice's shape.
    first: usize,
    shape: Vec<usize>,
}

impl WeightSource for GgufSource {
    fn location(&self) -> &Path {
        self.model.path()
    }

    fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    fn tensor(&self, name: &str) -> Result<StoredTensor> {
        let Some(r) = self.map.get(name) else {
            return Err(ModelError::MissingTensor { name: name.into(), dir: self.model.path().to_path_buf() });
        };
        if let Some(s) = self.span(r)? {
            return self.slice(s.file, s.info, s.first, s.shape);
        }
        match r {
            GgufTensorRef::KvB { k_b, v_b } => self.kv_b(k_b, v_b),
            GgufTensorRef::Rearranged(r) => self.rearranged(r),
            GgufTensorRef::Whole(_) | GgufTensorRef::Expert { .. } => unreachable!("spanned above"),
        }
    }

    fn stored_dtype(&self, name: &str) -> Option<DType> {
        // Block types are served dequantised; kv_b (rebuilt from two tensors) and `A_log` (from
        // `ssm_a`) are served as f32.
        Some(match self.map.get(name)? {
            GgufTensorRef::KvB { .. } => DType::F32,
            GgufTensorRef::Rearranged(r) if r.values == StoredValues::NegExp => DType::F32,
            _ => match self.stored_type(name)? {
                GgmlType::F16 => DType::F16,
                GgmlType::BF16 => DType::BF16,
                _ => DType::F32,
            },
        })
    }

    fn ggml_blocks(&self, name: &str) -> Result<Option<(GgmlType, SharedBytes)>> {
        let Some(r) = self.map.get(name) else { return Ok(None) };
        let Some(Span { file, info, first, shape }) = self.span(r)? else { return Ok(None) };
        if matches!(info.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            return Ok(None);
        }
        let raw = Self::raw_range(file, info, first, shape.iter().product())?;
        Ok(Some((info.ty, SharedBytes::of_file(Arc::clone(&file.map), Arc::clone(&file.file), raw))))
    }

    fn is_mapped(&self, name: &str) -> bool {
        matches!(self.map.get(name), Some(GgufTensorRef::Whole(_) | GgufTensorRef::Expert { .. }))
            && matches!(self.stored_type(name), Some(GgmlType::F32 | GgmlType::F16 | GgmlType::BF16))
    }

    fn release_resident(&self) {
        for f in &self.model.files {
            crate::source::release_mapping(&f.map);
        }
    }

    fn describe(&self) -> String {
        let bytes: usize = self.model.files.iter().map(|f| f.map.len()).sum();
        let mut types: Vec<(GgmlType, usize)> = Vec::new();
        for f in &self.model.files {
            for t in &f.header.tensors {
                match types.iter_mut().find(|(ty, _)| *ty == t.ty) {
                    Some((_, n)) => *n += 1,
                    None => types.push((t.ty, 1)),
                }
            }
        }
        let types: Vec<String> = types.iter().map(|(t, n)| format!("{n} {t}")).collect();
        format!(
            "{} (GGUF v{}, {} file{}, {:.2} GiB; tensors: {})",
            self.model.path().display(),
            self.model.main().header.version,
            self.model.files.len(),
            if self.model.files.len() == 1 { "" } else { "s" },
            bytes as f64 / (1u64 << 30) as f64,
            types.join(", ")
        )
    }
}

#[cfg(test)]
mod tests;
