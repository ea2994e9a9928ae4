//! Tensors a checkpoint stores in another arrangement than the inventory names them
//! ([`crate::arch::StoredLayout`]), served by their canonical names: the engines, the expert
//! caches and the inventory checks see one layout per family, whatever the publisher chose.
//!
//! - **Fused experts** (Qwen3.5): `experts.gate_up_proj` `[E, 2I, H]` and `experts.down_proj`
//!   `[E, H, I]` serve `experts.{e}.{gate,up,down}_proj.weight` as ranges of the stored bytes
//!   (each expert's rows are contiguous: no copy, the mapping stays the backing).
//! - **Fused DeltaNet inputs** (Qwen3-Next): `in_proj_qkvz` and `in_proj_ba`, grouped per key
//!   head, serve the flat `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a` (Qwen3.5's
//!   names) as rows gathered into memory of their own.
//!
//! A name the checkpoint stores as the inventory names it is served as stored, so a file
//! written in the canonical layout (`krasis synth`) reads the same.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

use krasis_core::DType;

use crate::arch::StoredLayout;
use crate::error::{ModelError, Result};
use crate::model::tensors::{experts_prefix, layer_prefix};
use crate::source::{SharedBytes, StoredTensor, WeightSource};
use crate::spec::ModelSpec;

/// How a canonical tensor is made from a stored one.
enum Derived {
    /// Elements `elems` of `from`, in place.
    Range { from: String, elems: Range<usize>, shape: Vec<usize> },
    /// Rows `rows` of the 2-D `from`, gathered in that order.
    Rows { from: String, rows: Vec<usize>, shape: Vec<usize> },
}

/// A weight source serving canonical names over a checkpoint's own arrangement (module docs).
pub struct AdaptedSource<S> {
    inner: S,
    derived: HashMap<String, Derived>,
}

impl<S: WeightSource> AdaptedSource<S> {
    /// `inner` as `spec`'s inventory names it, given how the checkpoint stores it. Shapes of the
    /// stored tensors are checked here; an error names the tensor.
    pub fn new(inner: S, spec: &ModelSpec, layout: StoredLayout) -> Result<Self> {
        let mut derived = HashMap::new();
        if layout.fused_experts {
            fused_experts(&inner, spec, &mut derived)?;
        }
        if layout.fused_delta_net_inputs {
            fused_delta_net_inputs(&inner, spec, &mut derived)?;
        }
        Ok(AdaptedSource { inner, derived })
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }
}

fn shape_error(source: &dyn WeightSource, name: &str, found: &[usize], want: &[usize]) -> ModelError {
    ModelError::Invalid(format!(
        "{}: tensor `{name}` has shape {found:?}, expected {want:?} for this configuration",
        source.location().display()
    ))
}

/// Whether `name` is stored; when it is, its shape must be `want`.
fn stored_with_shape(source: &dyn WeightSource, name: &str, want: &[usize]) -> Result<bool> {
    if !source.contains(name) {
        return Ok(false);
    }
    let t = source.tensor(name)?;
    if t.shape != want {
        return Err(shape_error(source, name, &t.shape, want));
    }
    Ok(true)
}

fn fused_experts(source: &dyn WeightSource, spec: &ModelSpec, out: &mut HashMap<String, Derived>) -> Result<()> {
    let Some(moe) = &spec.moe else { return Ok(()) };
    let (e, i, h) = (moe.n_routed_experts, moe.moe_intermediate_size, spec.hidden_size);
    for l in spec.moe_layers() {
        let p = experts_prefix(spec, l);
        let (gate_up, down) = (format!("{p}.gate_up_proj"), format!("{p}.down_proj"));
        if !stored_with_shape(source, &gate_up, &[e, 2 * i, h])? {
            continue;
        }
        if !stored_with_shape(source, &down, &[e, h, i])? {
            return Err(ModelError::MissingTensor { name: down, dir: source.location().to_path_buf() });
        }
        for x in 0..e {
            let at = x * 2 * i * h;
            let range = |from: &str, elems: Range<usize>, shape: Vec<usize>| Derived::Range {
                from: from.to_string(),
                elems,
                shape,
            };
            out.insert(format!("{p}.{x}.gate_proj.weight"), range(&gate_up, at..at + i * h, vec![i, h]));
            out.insert(format!("{p}.{x}.up_proj.weight"), range(&gate_up, at + i * h..at + 2 * i * h, vec![i, h]));
            out.insert(format!("{p}.{x}.down_proj.weight"), range(&down, x * h * i..(x + 1) * h * i, vec![h, i]));
        }
    }
    Ok(())
}

fn fused_delta_net_inputs(
    source: &dyn WeightSource,
    spec: &ModelSpec,
    out: &mut HashMap<String, Derived>,
) -> Result<()> {
    let Some(d) = spec.delta_net else { return Ok(()) };
    let (nk, dk, dv, h) = (d.key_heads, d.key_dim, d.value_dim, spec.hidden_size);
    let r = d.value_heads / d.key_heads;
    // Per key head: q (dk), k (dk), v (r·dv), z (r·dv) rows; b (r), a (r) rows.
    let group = 2 * dk + 2 * r * dv;
    for l in (0..spec.num_layers).filter(|&l| spec.is_delta_net(l)) {
        let p = format!("{}.linear_attn", layer_prefix(l));
        let (qkvz, ba) = (format!("{p}.in_proj_qkvz.weight"), format!("{p}.in_proj_ba.weight"));
        if !stored_with_shape(source, &qkvz, &[nk * group, h])? {
            continue;
        }
        if !stored_with_shape(source, &ba, &[nk * 2 * r, h])? {
            return Err(ModelError::MissingTensor { name: ba, dir: source.location().to_path_buf() });
        }
        for name in [&qkvz, &ba] {
            let dtype = source.stored_dtype(name);
            if !matches!(dtype, Some(DType::BF16 | DType::F16 | DType::F32)) {
                return Err(ModelError::Invalid(format!(
                    "{}: tensor `{name}` is stored as {dtype:?}; its rows are regrouped on load, which Krasis \
                     does for BF16, F16 and F32 weights only",
                    source.location().display()
                )));
            }
        }
        let rows_of = |at: usize, n: usize| (0..nk).flat_map(move |k| k * group + at..k * group + at + n);
        let qkv: Vec<usize> = rows_of(0, dk).chain(rows_of(dk, dk)).chain(rows_of(2 * dk, r * dv)).collect();
        let z: Vec<usize> = rows_of(2 * dk + r * dv, r * dv).collect();
        let b: Vec<usize> = (0..nk).flat_map(|k| k * 2 * r..k * 2 * r + r).collect();
        let a: Vec<usize> = (0..nk).flat_map(|k| k * 2 * r + r..(k + 1) * 2 * r).collect();
        let rows =
            |from: &str, rows: Vec<usize>| Derived::Rows { from: from.to_string(), shape: vec![rows.len(), h], rows };
        out.insert(format!("{p}.in_proj_qkv.weight"), rows(&qkvz, qkv));
        out.insert(format!("{p}.in_proj_z.weight"), rows(&qkvz, z));
        out.insert(format!("{p}.in_proj_b.weight"), rows(&ba, b));
        out.insert(format!("{p}.in_proj_a.weight"), rows(&ba, a));
    }
    Ok(())
}

impl<S: WeightSource> WeightSource for AdaptedSource<S> {
    fn location(&self) -> &Path {
        self.inner.location()
    }

    fn contains(&self, name: &str) -> bool {
        self.derived.contains_key(name) || self.inner.contains(name)
    }

    fn tensor(&self, name: &str) -> Result<StoredTensor> {
        let Some(d) = self.derived.get(name) else { return self.inner.tensor(name) };
        match d {
            Derived::Range { from, elems, shape } => {
                let t = self.inner.tensor(from)?;
                let es = t.dtype.size_bytes();
                let bytes = t.bytes.slice(elems.start * es..elems.end * es);
                Ok(StoredTensor { dtype: t.dtype, shape: shape.clone(), bytes, file: t.file })
            }
            Derived::Rows { from, rows, shape } => {
                let t = self.inner.tensor(from)?;
                let row = t.shape[1] * t.dtype.size_bytes();
                let src = t.bytes.as_slice();
                let mut buf = Vec::with_capacity(rows.len() * row);
                for &r in rows {
                    buf.extend_from_slice(&src[r * row..(r + 1) * row]);
                }
                Ok(StoredTensor {
                    dtype: t.dtype,
                    shape: shape.clone(),
                    bytes: SharedBytes::from_bytes(&buf),
                    file: t.file,
                })
            }
        }
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn stored_dtype(&self, name: &str) -> Option<DType> {
        match self.derived.get(name) {
            Some(Derived::Range { from, .. } | Derived::Rows { from, .. }) => self.inner.stored_dtype(from),
            None => self.inner.stored_dtype(name),
        }
    }

    fn is_mapped(&self, name: &str) -> bool {
        match self.derived.get(name) {
            Some(Derived::Range { from, .. }) => self.inner.is_mapped(from),
            Some(Derived::Rows { .. }) => false,
            None => self.inner.is_mapped(name),
        }
    }

    fn release_resident(&self) {
        self.inner.release_resident()
    }
}
