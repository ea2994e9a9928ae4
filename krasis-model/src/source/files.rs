//! The front door: [`ModelFiles::open`] turns a path into everything read from disk — the
//! architecture ([`ModelSpec`]), the weights (an `Arc<dyn WeightSource>`), the tokenizer and chat
//! template (loaded on first use) and a fingerprint for cache keys. Every entry point (the CPU and
//! GPU loaders, the expert cache, the CLI, the tests) starts here, so a new on-disk format (GGUF)
//! is one more branch in [`ModelFiles::open`] and nothing else changes.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use crate::arch::{load_checkpoint_config, StoredLayout};
use crate::error::{ModelError, Result};
use crate::source::adapt::AdaptedSource;
use crate::source::gguf::{spec_from_gguf, GgufModel, GgufSource};
use crate::source::{fnv1a, SafetensorsDir, WeightSource};
use crate::spec::ModelSpec;
use crate::text::tokenizer::TextCodec;

/// A model on disk, opened: its spec, its weights and (lazily) its tokenizer.
pub struct ModelFiles {
    path: PathBuf,
    spec: ModelSpec,
    source: Arc<dyn WeightSource>,
    fingerprint: u64,
    codec: OnceLock<Arc<TextCodec>>,
    /// The GGUF model when the weights are one (its metadata carries the tokenizer).
    gguf: Option<Arc<GgufModel>>,
    /// What was left out of the checkpoint (see [`ModelFiles::notes`]).
    notes: Vec<String>,
}

/// Whether `path` names a GGUF file (by extension; the magic is checked on open).
pub fn is_gguf_path(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

impl ModelFiles {
    /// Opens a hub-format model directory: `config.json` (parsed into the spec) and the
    /// `*.safetensors` weights (memory-mapped, headers validated). The tokenizer is not read
    /// until [`ModelFiles::text_codec`] asks for it, so `--prompt-ids` runs need no
    /// `tokenizer.json`.
    ///
    /// A path ending in `.gguf` opens a GGUF model instead (any split of a split model opens
    /// all of them): the spec from its metadata, the weights by llama.cpp's names mapped to the
    /// canonical ones, the tokenizer and chat template from `tokenizer.*` metadata.
    ///
    /// A vision-language checkpoint whose configuration nests the text model (Kimi-K2.5's
    /// `text_config`) opens as its text model: the tensors under its prefix (`language_model.`)
    /// are served by their canonical names, and [`ModelFiles::notes`] says what was left out.
    pub fn open(path: &Path) -> Result<ModelFiles> {
        if is_gguf_path(path) {
            return Self::open_gguf(path);
        }
        let cfg = load_checkpoint_config(path)?;
        let weights = SafetensorsDir::open_with_prefix(path, cfg.tensor_prefix, cfg.canonical_prefix)?;
        let fingerprint = safetensors_fingerprint(path, &weights)?;
        let source: Arc<dyn WeightSource> = if cfg.layout == StoredLayout::default() {
            Arc::new(weights)
        } else {
            Arc::new(AdaptedSource::new(weights, &cfg.spec, cfg.layout)?)
        };
        for note in &cfg.notes {
            tracing::info!("{note}");
        }
        Ok(ModelFiles {
            path: path.to_path_buf(),
            spec: cfg.spec,
            source,
            fingerprint,
            codec: OnceLock::new(),
            gguf: None,
            notes: cfg.notes,
        })
    }

    /// What Krasis leaves out of this checkpoint, one sentence each (the vision tower of a
    /// vision-language model); empty for most models.
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    fn open_gguf(path: &Path) -> Result<ModelFiles> {
        let model = Arc::new(GgufModel::open(path)?);
        let (spec, map) = spec_from_gguf(&model)?;
        let paths: Vec<&Path> = model.files().iter().map(|f| f.path.as_path()).collect();
        let fingerprint = fnv1a(model.fingerprint(), &weight_files_identity(&paths)?.to_le_bytes());
        Ok(ModelFiles {
            path: path.to_path_buf(),
            spec,
            source: Arc::new(GgufSource::new(Arc::clone(&model), map)),
            fingerprint,
            codec: OnceLock::new(),
            gguf: Some(model),
            notes: Vec::new(),
        })
    }

    /// The GGUF model, when the weights are one.
    pub fn gguf(&self) -> Option<&Arc<GgufModel>> {
        self.gguf.as_ref()
    }

    /// Where on-disk caches of this model go unless `--cache-dir` says otherwise: the model
    /// directory's `.krasis_cache` (see `krasis_cache::default_cache_dir`), or for a GGUF file
    /// `<its directory>/.krasis_cache/<file name>/`, so two GGUFs side by side never share one.
    pub fn default_cache_dir(&self) -> PathBuf {
        match &self.gguf {
            None => krasis_cache::default_cache_dir(&self.path),
            Some(_) => {
                let dir = self.path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
                let name = self.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                krasis_cache::default_cache_dir(dir).join(name)
            }
        }
    }

    /// Where the model was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The architecture read from the model's configuration.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The weights, by canonical tensor name.
    pub fn source(&self) -> &Arc<dyn WeightSource> {
        &self.source
    }

    /// The weights as a plain trait object (what the loaders take).
    pub fn weights(&self) -> &dyn WeightSource {
        self.source.as_ref()
    }

    /// Identity of the model for cache keys (every cache and the tune file): the configuration,
    /// each weight file's name and header, and each weight file's size, mtime and sampled pages
    /// ([`krasis_cache::identity`]), so a rewrite of the weights in place (same sizes and headers)
    /// changes it. Survives copying the model elsewhere when the copy keeps mtimes (`cp -p`,
    /// `rsync -a`); a plain copy gets new mtimes, and its caches are rebuilt once.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Whether the model ships a tokenizer (`tokenizer.json`, or Kimi's `tiktoken.model`).
    pub fn has_tokenizer(&self) -> bool {
        match &self.gguf {
            Some(m) => m.meta("tokenizer.ggml.tokens").is_some(),
            None => self.path.join("tokenizer.json").exists() || self.path.join("tiktoken.model").exists(),
        }
    }

    /// The tokenizer and chat template, loaded on the first call and kept (shared: it outlives
    /// the `ModelFiles`, whose weight mapping callers may drop once an engine is built):
    /// `tokenizer.json`, or without it Kimi's `tiktoken.model` ([`TextCodec::load`]). A missing
    /// or broken tokenizer is an error naming the file (and `--prompt-ids` as the way around it).
    pub fn text_codec(&self) -> Result<Arc<TextCodec>> {
        if let Some(codec) = self.codec.get() {
            return Ok(Arc::clone(codec));
        }
        let loaded = Arc::new(match &self.gguf {
            Some(m) => TextCodec::from_gguf(m)?,
            None => TextCodec::load(&self.path)?,
        });
        Ok(Arc::clone(self.codec.get_or_init(|| loaded)))
    }
}

/// The cache-key fingerprint of a safetensors model: `config.json`'s bytes, the weight files'
/// names and headers, then their contents' identity ([`weight_files_identity`]).
fn safetensors_fingerprint(dir: &Path, weights: &SafetensorsDir) -> Result<u64> {
    let cfg_path = dir.join("config.json");
    let cfg = std::fs::read(&cfg_path).map_err(|e| ModelError::io(&cfg_path, e))?;
    let paths: Vec<&Path> = weights.files().iter().map(|f| f.path()).collect();
    let layout = fnv1a(fnv1a(0, &cfg), &weights.fingerprint().to_le_bytes());
    Ok(fnv1a(layout, &weight_files_identity(&paths)?.to_le_bytes()))
}

/// [`krasis_cache::files_identity`] of the weight files (size, mtime, sampled pages of each), its
/// time logged at debug level.
fn weight_files_identity(paths: &[&Path]) -> Result<u64> {
    let started = std::time::Instant::now();
    let id = krasis_cache::files_identity(paths).map_err(|(path, e)| ModelError::io(&path, e))?;
    tracing::debug!(
        "weight files' identity (size, mtime, {} sampled pages each) of {} file(s) in {:.2} ms",
        krasis_cache::identity::SAMPLE_PAGES,
        paths.len(),
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(id)
}

impl std::fmt::Debug for ModelFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelFiles")
            .field("path", &self.path)
            .field("model_type", &self.spec.arch.model_type())
            .field("fingerprint", &format_args!("{:016x}", self.fingerprint))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{synthesize, Preset, SynthOptions};

    #[test]
    fn opens_spec_weights_and_fingerprint_and_loads_the_tokenizer_lazily() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("tiny");
        synthesize(&SynthOptions { layers: Some(2), ..SynthOptions::new(Preset::Tiny, &out) }).unwrap();
        let files = ModelFiles::open(&out).unwrap();
        assert_eq!(files.path(), out);
        assert_eq!(files.spec(), &crate::arch::load_config(&out).unwrap());
        assert!(files.weights().contains("model.embed_tokens.weight"));
        // The configuration, the weight files' names and headers, and their contents' identity.
        let cfg = std::fs::read(out.join("config.json")).unwrap();
        let weights = SafetensorsDir::open(&out).unwrap();
        let layout = fnv1a(fnv1a(0, &cfg), &weights.fingerprint().to_le_bytes());
        let paths: Vec<&Path> = weights.files().iter().map(|f| f.path()).collect();
        let content = krasis_cache::files_identity(&paths).unwrap();
        assert_eq!(files.fingerprint(), fnv1a(layout, &content.to_le_bytes()));
        assert!(files.has_tokenizer());
        assert!(!files.text_codec().unwrap().encode("hello").unwrap().is_empty());

        // Without tokenizer.json the model still opens; asking for the tokenizer names the file.
        std::fs::remove_file(out.join("tokenizer.json")).unwrap();
        let files = ModelFiles::open(&out).unwrap();
        assert!(!files.has_tokenizer());
        let e = files.text_codec().err().expect("no tokenizer").to_string();
        assert!(e.contains("tokenizer.json") && e.contains("`GenerateRequest::prompt_ids`"), "{e}");
    }

    #[test]
    fn a_rewrite_of_the_weights_in_place_changes_the_fingerprint() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("tiny");
        let synth = |seed, force| {
            let opts = SynthOptions { layers: Some(2), seed, force, ..SynthOptions::new(Preset::Tiny, &out) };
            synthesize(&opts).unwrap();
        };
        synth(0, false);
        let weights = SafetensorsDir::open(&out).unwrap().files()[0].path().to_path_buf();
        let header_of = || {
            let b = std::fs::read(&weights).unwrap();
            let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            (b.len(), b[..8 + n].to_vec())
        };
        let (before, old_header) = (ModelFiles::open(&out).unwrap().fingerprint(), header_of());
        let old_mtime = std::fs::metadata(&weights).unwrap().modified().unwrap();
        assert_eq!(ModelFiles::open(&out).unwrap().fingerprint(), before, "stable while nothing changes");

        // Other weights of the same sizes and headers: another fingerprint.
        synth(7, true);
        assert_eq!(header_of(), old_header, "the rewrite keeps sizes and headers");
        assert_ne!(ModelFiles::open(&out).unwrap().fingerprint(), before);
        // Even with the old mtime put back (the sampled pages differ).
        std::fs::File::options().write(true).open(&weights).unwrap().set_modified(old_mtime).unwrap();
        assert_ne!(ModelFiles::open(&out).unwrap().fingerprint(), before);
        // The old weights back, with their mtime: the old fingerprint.
        synth(0, true);
        std::fs::File::options().write(true).open(&weights).unwrap().set_modified(old_mtime).unwrap();
        assert_eq!(ModelFiles::open(&out).unwrap().fingerprint(), before);
    }

    #[test]
    fn a_missing_directory_is_named() {
        let e = ModelFiles::open(Path::new("/nonexistent/krasis-model")).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/krasis-model") && e.contains("does not exist"), "{e}");
    }
}
