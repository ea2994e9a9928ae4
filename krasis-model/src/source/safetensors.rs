//! Zero-copy reader for (sharded) safetensors directories. The header is validated before any
//! allocation sized from it: header length against the file size and a hard cap, every tensor's
//! byte range against its dtype × shape and against the data section.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use krasis_core::{DType, TensorView};
use memmap2::Mmap;
use serde_json::Value;

use super::{SharedBytes, StoredTensor, WeightSource};
use crate::error::{ModelError, Result};

/// Largest JSON header we accept (the reference implementation uses the same bound).
const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

struct Entry {
    dtype: DType,
    shape: Vec<usize>,
    /// Absolute byte range in the file.
    start: usize,
    end: usize,
}

pub struct SafetensorsFile {
    path: PathBuf,
    map: Arc<Mmap>,
    entries: HashMap<String, Entry>,
    /// FNV-1a of the file length and JSON header: identifies the file's layout cheaply.
    header_hash: u64,
}

/// FNV-1a, 64-bit: a stable, dependency-free identity hash (not for security).
pub fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = if seed == 0 { 0xcbf2_9ce4_8422_2325 } else { seed };
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn parse_dtype(s: &str) -> Option<DType> {
    Some(match s {
        "F32" => DType::F32,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        "F8_E4M3" => DType::F8E4M3,
        "I64" => DType::I64,
        "I32" => DType::I32,
        "U8" => DType::U8,
        _ => return None,
    })
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let len = file.metadata().map_err(|e| ModelError::io(path, e))?.len();
        let bad = |msg: String| ModelError::Safetensors { path: path.to_path_buf(), msg };
        if len < 8 {
            return Err(bad(format!("file is {len} bytes, too short for a safetensors header")));
        }
        // SAFETY: the map is read-only; a file truncated underneath us is the user's doing and is
        // the same hazard every mmap-based loader accepts.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let n = u64::from_le_bytes(map[..8].try_into().expect("8 bytes"));
        if n > MAX_HEADER_BYTES {
            return Err(bad(format!("header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")));
        }
        if n > len - 8 {
            return Err(bad(format!("header length {n} runs past the end of the {len}-byte file (truncated?)")));
        }
        let data_start = 8 + n as usize;
        let header: Value =
            serde_json::from_slice(&map[8..data_start]).map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
        let obj = header.as_object().ok_or_else(|| bad("header is not a JSON object".into()))?;
        let data_len = map.len() - data_start;
        let mut entries = HashMap::with_capacity(obj.len());
        for (name, info) in obj {
            if name == "__metadata__" {
                continue;
            }
            let tbad = |msg: &str| bad(format!("tensor `{name}`: {msg}"));
            let dtype_s = info.get("dtype").and_then(Value::as_str).ok_or_else(|| tbad("missing dtype"))?;
            let dtype = parse_dtype(dtype_s).ok_or_else(|| tbad(&format!("unsupported dtype {dtype_s}")))?;
            let shape: Vec<usize> = info
                .get("shape")
                .and_then(Value::as_array)
                .ok_or_else(|| tbad("missing shape"))?
                .iter()
                .map(|d| d.as_u64().map(|x| x as usize))
                .collect::<Option<_>>()
                .ok_or_else(|| tbad("shape is not a list of non-negative integers"))?;
            let offs = info
                .get("data_offsets")
                .and_then(Value::as_array)
                .filter(|a| a.len() == 2)
                .ok_or_else(|| tbad("missing data_offsets"))?;
            let (b, e) = match (offs[0].as_u64(), offs[1].as_u64()) {
                (Some(b), Some(e)) if b <= e => (b, e),
                _ => return Err(tbad("data_offsets must be two ascending integers")),
            };
            if e > data_len as u64 {
                return Err(tbad(&format!(
                    "data_offsets [{b}, {e}] run past the end of the data section ({data_len} bytes; truncated file?)"
                )));
            }
            let expect = shape.iter().try_fold(dtype.size_bytes() as u64, |acc, &d| acc.checked_mul(d as u64));
            if expect != Some(e - b) {
                return Err(tbad(&format!(
                    "{} bytes for shape {shape:?} of {dtype}, expected {}",
                    e - b,
                    expect.map_or("an overflowing count".to_string(), |x| x.to_string())
                )));
            }
            entries.insert(
                name.clone(),
                Entry { dtype, shape, start: data_start + b as usize, end: data_start + e as usize },
            );
        }
        let header_hash = fnv1a(fnv1a(0, &len.to_le_bytes()), &map[8..data_start]);
        Ok(SafetensorsFile { path: path.to_path_buf(), map: Arc::new(map), entries, header_hash })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's size in bytes.
    pub fn len_bytes(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    pub fn view(&self, name: &str) -> Option<TensorView<'_>> {
        self.entries.get(name).map(|e| TensorView { dtype: e.dtype, shape: &e.shape, bytes: &self.map[e.start..e.end] })
    }

    /// A zero-copy handle on a tensor.
    pub fn stored(&self, name: &str) -> Option<StoredTensor> {
        self.entries.get(name).map(|e| StoredTensor {
            dtype: e.dtype,
            shape: e.shape.clone(),
            bytes: SharedBytes::new(self.map.clone(), e.start..e.end),
            file: self.path.clone(),
        })
    }
}

/// A model directory: `model.safetensors`, or shards listed by `model.safetensors.index.json`,
/// or (failing both) every `*.safetensors` file in it.
pub struct SafetensorsDir {
    dir: PathBuf,
    files: Vec<SafetensorsFile>,
    index: HashMap<String, usize>,
}

impl SafetensorsDir {
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(ModelError::MissingDir(dir.to_path_buf()));
        }
        let index_path = dir.join("model.safetensors.index.json");
        let mut paths: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| ModelError::io(&index_path, e))?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::Json { path: index_path.clone(), msg: e.to_string() })?;
            let map = v.get("weight_map").and_then(Value::as_object).ok_or_else(|| ModelError::Config {
                path: index_path.clone(),
                field: "weight_map".into(),
                msg: "missing or not an object".into(),
            })?;
            let mut shards: Vec<PathBuf> = Vec::new();
            for (name, shard) in map {
                let s = shard.as_str().ok_or_else(|| ModelError::Config {
                    path: index_path.clone(),
                    field: format!("weight_map.{name}"),
                    msg: "expected a file name".into(),
                })?;
                if s.contains('/') || s.contains("..") {
                    return Err(ModelError::Config {
                        path: index_path.clone(),
                        field: format!("weight_map.{name}"),
                        msg: format!("shard name `{s}` must be a plain file name"),
                    });
                }
                let p = dir.join(s);
                if !shards.contains(&p) {
                    shards.push(p);
                }
            }
            shards
        } else if dir.join("model.safetensors").exists() {
            vec![dir.join("model.safetensors")]
        } else {
            let rd = std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))?;
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect()
        };
        if paths.is_empty() {
            return Err(ModelError::Invalid(format!("{}: no *.safetensors weight files found", dir.display())));
        }
        paths.sort();
        let files = paths.iter().map(|p| SafetensorsFile::open(p)).collect::<Result<Vec<_>>>()?;
        let mut index = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for n in f.names() {
                index.insert(n.to_string(), i);
            }
        }
        Ok(SafetensorsDir { dir: dir.to_path_buf(), files, index })
    }

    /// Identity of the weights: every file's name, size and header. Changes when the weights are
    /// replaced by different ones; survives copying the directory elsewhere.
    pub fn fingerprint(&self) -> u64 {
        self.files.iter().fold(0, |h, f| {
            let name = f.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            fnv1a(fnv1a(h, name.as_bytes()), &f.header_hash.to_le_bytes())
        })
    }

    /// The weight files, sorted by name.
    pub fn files(&self) -> &[SafetensorsFile] {
        &self.files
    }

    pub fn file_of(&self, name: &str) -> Option<&SafetensorsFile> {
        self.index.get(name).map(|&i| &self.files[i])
    }
}

impl WeightSource for SafetensorsDir {
    fn location(&self) -> &Path {
        &self.dir
    }

    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn tensor(&self, name: &str) -> Result<StoredTensor> {
        self.file_of(name)
            .and_then(|f| f.stored(name))
            .ok_or_else(|| ModelError::MissingTensor { name: name.into(), dir: self.dir.clone() })
    }

    fn describe(&self) -> String {
        let bytes: u64 = self.files.iter().map(|f| f.len_bytes()).sum();
        format!("{} safetensors file(s), {}", self.files.len(), krasis_core::budget::format_bytes(bytes))
    }

    fn release_resident(&self) {
        for f in &self.files {
            super::release_mapping(&f.map);
        }
    }
}
