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
    /// The mapped file, kept open for positioned reads ([`SharedBytes::read_at`]).
    file: Arc<File>,
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
        Ok(SafetensorsFile { path: path.to_path_buf(), map: Arc::new(map), file: Arc::new(file), entries, header_hash })
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
            bytes: SharedBytes::of_file(self.map.clone(), self.file.clone(), e.start..e.end),
            file: self.path.clone(),
        })
    }
}

/// A model directory: `model.safetensors`, or shards listed by `model.safetensors.index.json`,
/// or (failing both) every `*.safetensors` file in it. Shard names are taken as they are (Kimi-K2
/// names them `model-1-of-61.safetensors`, without zero padding); the files are kept in shard
/// order (numbers in names compare by value).
pub struct SafetensorsDir {
    dir: PathBuf,
    files: Vec<SafetensorsFile>,
    /// Canonical name → the file holding it, and its stored name where that differs (under the
    /// tensor prefix).
    index: HashMap<String, (usize, Option<String>)>,
}

impl SafetensorsDir {
    /// Opens the directory's weights under their stored names.
    pub fn open(dir: &Path) -> Result<Self> {
        Self::open_with_prefix(dir, "", "")
    }

    /// Opens the directory's weights; a tensor stored as `<prefix><name>` is served as
    /// `<canonical><name>` (Kimi-K2.5 stores its text model under `language_model.`, with
    /// `canonical` empty; Qwen3.5 under `model.language_model.` for `model.`). Tensors without
    /// the prefix keep their names (a vision tower beside the text model; nothing reads them),
    /// unless a prefixed tensor of the same canonical name exists, which wins.
    pub fn open_with_prefix(dir: &Path, prefix: &str, canonical: &str) -> Result<Self> {
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
        paths.sort_by(|a, b| natural_cmp(&a.to_string_lossy(), &b.to_string_lossy()));
        let files = paths.iter().map(|p| SafetensorsFile::open(p)).collect::<Result<Vec<_>>>()?;
        let mut index: HashMap<String, (usize, Option<String>)> = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for n in f.names() {
                match n.strip_prefix(prefix).filter(|_| !prefix.is_empty()) {
                    Some(rest) => {
                        index.insert(format!("{canonical}{rest}"), (i, Some(n.to_string())));
                    }
                    None => {
                        if !index.get(n).is_some_and(|(_, stored)| stored.is_some()) {
                            index.insert(n.to_string(), (i, None));
                        }
                    }
                }
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

    /// The file holding the tensor of canonical name `name`.
    pub fn file_of(&self, name: &str) -> Option<&SafetensorsFile> {
        self.index.get(name).map(|&(i, _)| &self.files[i])
    }

    /// The name under which the tensor of canonical name `name` is stored.
    pub fn stored_name<'a>(&'a self, name: &'a str) -> Option<&'a str> {
        self.index.get(name).map(|(_, stored)| stored.as_deref().unwrap_or(name))
    }
}

/// Orders names with the numbers in them compared by value (`model-2-of-12` before
/// `model-10-of-12`); zero-padded names keep their plain order.
fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    fn chunks(s: &str) -> Vec<(bool, &str)> {
        let mut out = Vec::new();
        let mut start = 0;
        let bytes = s.as_bytes();
        for i in 1..=bytes.len() {
            if i == bytes.len() || bytes[i].is_ascii_digit() != bytes[start].is_ascii_digit() {
                out.push((bytes[start].is_ascii_digit(), &s[start..i]));
                start = i;
            }
        }
        out
    }
    let (ca, cb) = (chunks(a), chunks(b));
    for (x, y) in ca.iter().zip(&cb) {
        let ord = match (x, y) {
            ((true, dx), (true, dy)) => {
                let (tx, ty) = (dx.trim_start_matches('0'), dy.trim_start_matches('0'));
                tx.len().cmp(&ty.len()).then_with(|| tx.cmp(ty)).then_with(|| dx.len().cmp(&dy.len()))
            }
            ((_, sx), (_, sy)) => sx.cmp(sy),
        };
        if ord != std::cmp::Ordering::Equal {
            return ord;
        }
    }
    ca.len().cmp(&cb.len())
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
            .zip(self.stored_name(name))
            .and_then(|(f, stored)| f.stored(stored))
            .ok_or_else(|| ModelError::MissingTensor { name: name.into(), dir: self.dir.clone() })
    }

    fn is_mapped(&self, name: &str) -> bool {
        self.contains(name)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_order_by_their_numbers_padded_or_not() {
        let mut names: Vec<String> = (1..=12).rev().map(|k| format!("model-{k}-of-12.safetensors")).collect();
        names.sort_by(|a, b| natural_cmp(a, b));
        let want: Vec<String> = (1..=12).map(|k| format!("model-{k}-of-12.safetensors")).collect();
        assert_eq!(names, want);
        let mut padded: Vec<String> = (1..=12).rev().map(|k| format!("model-{k:05}-of-00012.safetensors")).collect();
        let mut plain = padded.clone();
        padded.sort_by(|a, b| natural_cmp(a, b));
        plain.sort();
        assert_eq!(padded, plain);
        assert_eq!(natural_cmp("a-01", "a-1"), std::cmp::Ordering::Greater);
        assert_eq!(natural_cmp("model.safetensors", "model.safetensors"), std::cmp::Ordering::Equal);
    }

    /// Twelve unpadded shards with no index: every tensor found, the files in shard order.
    #[test]
    fn unpadded_shards_without_an_index_are_all_found_in_order() {
        let tmp = tempfile::tempdir().unwrap();
        for k in 1..=12 {
            let name = format!("t{k}");
            let header = format!(r#"{{"{name}":{{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}}}"#);
            let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(header.as_bytes());
            bytes.extend_from_slice(&(k as f32).to_le_bytes());
            std::fs::write(tmp.path().join(format!("model-{k}-of-12.safetensors")), bytes).unwrap();
        }
        let dir = SafetensorsDir::open(tmp.path()).unwrap();
        let files: Vec<String> =
            dir.files().iter().map(|f| f.path().file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(files, (1..=12).map(|k| format!("model-{k}-of-12.safetensors")).collect::<Vec<_>>());
        for k in 1..=12 {
            let t = dir.tensor(&format!("t{k}")).unwrap();
            assert_eq!(t.view().to_f32_vec().unwrap(), vec![k as f32]);
        }
    }

    /// A tensor's bytes read with positioned reads (`read_at`), and copied out of the mapping
    /// (`copied`), are the mapped bytes; a read past the tensor's end panics.
    #[test]
    fn positioned_reads_and_copies_give_the_mapped_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let header = r#"{"a":{"dtype":"BF16","shape":[3,5],"data_offsets":[0,30]},"b":{"dtype":"F32","shape":[2],"data_offsets":[30,38]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend((0..38u8).map(|i| i.wrapping_mul(7)));
        std::fs::write(tmp.path().join("model.safetensors"), bytes).unwrap();
        let dir = SafetensorsDir::open(tmp.path()).unwrap();
        assert!(dir.is_mapped("a") && !dir.is_mapped("zz"));
        for name in ["a", "b"] {
            let t = dir.tensor(name).unwrap();
            let mapped = t.bytes.as_slice().to_vec();
            assert!(t.bytes.is_mapped());
            let n = mapped.len();
            for (off, len) in [(0, n), (2, n - 4), (n - 1, 1), (n, 0)] {
                let mut buf = vec![0u8; len];
                t.bytes.read_at(off, &mut buf);
                assert_eq!(buf, mapped[off..off + len], "{name} {off}+{len}");
            }
            let copy = t.bytes.copied();
            assert!(!copy.is_mapped());
            assert_eq!(copy.as_slice(), &mapped[..]);
            let mut buf = vec![0u8; 4];
            copy.read_at(mapped.len() - 4, &mut buf);
            assert_eq!(buf, mapped[mapped.len() - 4..]);
        }
        let t = dir.tensor("a").unwrap();
        let past = std::panic::catch_unwind(|| t.bytes.read_at(28, &mut [0u8; 4]));
        assert!(past.is_err(), "a read past the tensor's end panics");
    }

    /// Under a prefix, prefixed tensors answer to their canonical names; the others keep theirs.
    #[test]
    fn a_tensor_prefix_maps_stored_names_to_canonical_ones() {
        let tmp = tempfile::tempdir().unwrap();
        let header = r#"{"language_model.model.norm.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
            "model.norm.weight":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},
            "vision_tower.w":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        for x in [1.0f32, 2.0, 3.0] {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
        std::fs::write(tmp.path().join("model.safetensors"), bytes).unwrap();
        let value = |d: &SafetensorsDir, n: &str| d.tensor(n).unwrap().view().to_f32_vec().unwrap()[0];
        let dir = SafetensorsDir::open_with_prefix(tmp.path(), "language_model.", "").unwrap();
        assert_eq!(value(&dir, "model.norm.weight"), 1.0, "the prefixed tensor wins");
        assert_eq!(dir.stored_name("model.norm.weight"), Some("language_model.model.norm.weight"));
        assert_eq!(value(&dir, "vision_tower.w"), 3.0);
        assert!(!dir.contains("language_model.model.norm.weight"));
        let plain = SafetensorsDir::open(tmp.path()).unwrap();
        assert_eq!(value(&plain, "model.norm.weight"), 2.0);
        assert_eq!(value(&plain, "language_model.model.norm.weight"), 1.0);
    }
}
