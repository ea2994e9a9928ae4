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
//! - **gpt-oss experts** ([`StoredLayout::gpt_oss_experts`]): the fused, transposed and
//!   interleaved `experts.gate_up_proj` / `down_proj` (BF16) serve
//!   `experts.{e}.{gate,up,down}_proj.weight` `[out, in]` as gathered copies, their `_bias`
//!   tensors `experts.{e}.{gate,up,down}_proj.bias`; in MXFP4 the `*_blocks` / `*_scales` rows
//!   of one expert and projection serve `experts.{e}.{gate,up,down}_proj.weight_blocks` /
//!   `weight_scales` (read by `WeightLoader` as MXFP4 linears), the bytes as stored.
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
    /// Rows `rows` of `from` seen as rows of `row_elems` elements, gathered in that order.
    Rows { from: String, rows: Vec<usize>, row_elems: usize, shape: Vec<usize> },
    /// The transpose of columns `cols` of the `[k, n]` matrix at element `base` of `from`:
    /// `out[r, j] = from[base + j·n + cols[r]]`, `shape` `[cols.len(), k]`.
    Transposed { from: String, base: usize, k: usize, n: usize, cols: Vec<usize>, shape: Vec<usize> },
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
        if layout.gpt_oss_experts {
            gpt_oss_experts(&inner, spec, &mut derived)?;
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
        let rows = |from: &str, rows: Vec<usize>| Derived::Rows {
            from: from.to_string(),
            shape: vec![rows.len(), h],
            rows,
            row_elems: h,
        };
        out.insert(format!("{p}.in_proj_qkv.weight"), rows(&qkvz, qkv));
        out.insert(format!("{p}.in_proj_z.weight"), rows(&qkvz, z));
        out.insert(format!("{p}.in_proj_b.weight"), rows(&ba, b));
        out.insert(format!("{p}.in_proj_a.weight"), rows(&ba, a));
    }
    Ok(())
}

/// A stored tensor's dtype must be one of `want` (an error names it and the arrangement).
fn stored_dtype_in(source: &dyn WeightSource, name: &str, want: &[DType], what: &str) -> Result<()> {
    match source.stored_dtype(name) {
        Some(d) if want.contains(&d) => Ok(()),
        found => Err(ModelError::Invalid(format!(
            "{}: tensor `{name}` is stored as {found:?}; {what}",
            source.location().display()
        ))),
    }
}

/// gpt-oss's fused experts ([`StoredLayout::gpt_oss_experts`]), BF16 or MXFP4, per MoE layer.
fn gpt_oss_experts(source: &dyn WeightSource, spec: &ModelSpec, out: &mut HashMap<String, Derived>) -> Result<()> {
    let Some(moe) = &spec.moe else { return Ok(()) };
    let (e, i, h) = (moe.n_routed_experts, moe.moe_intermediate_size, spec.hidden_size);
    const FLOATS: &[DType] = &[DType::BF16, DType::F16, DType::F32];
    for l in spec.moe_layers() {
        let p = experts_prefix(spec, l);
        let n = |s: &str| format!("{p}.{s}");
        let range = |from: String, elems: Range<usize>, shape: Vec<usize>| Derived::Range { from, elems, shape };
        let rows = |from: String, rows: Vec<usize>, row_elems: usize, shape: Vec<usize>| Derived::Rows {
            from,
            rows,
            row_elems,
            shape,
        };
        // The biases: gate j and up j alternate in `gate_up_proj_bias`.
        let (gub, db) = (n("gate_up_proj_bias"), n("down_proj_bias"));
        let has_bias = stored_with_shape(source, &gub, &[e, 2 * i])?;
        if has_bias {
            if !stored_with_shape(source, &db, &[e, h])? {
                return Err(ModelError::MissingTensor { name: db, dir: source.location().to_path_buf() });
            }
            stored_dtype_in(source, &gub, FLOATS, "expert biases are read as BF16, F16 or F32")?;
            for x in 0..e {
                let alt = |first: usize| (0..i).map(|j| x * 2 * i + 2 * j + first).collect::<Vec<_>>();
                out.insert(n(&format!("{x}.gate_proj.bias")), rows(gub.clone(), alt(0), 1, vec![i]));
                out.insert(n(&format!("{x}.up_proj.bias")), rows(gub.clone(), alt(1), 1, vec![i]));
                out.insert(n(&format!("{x}.down_proj.bias")), range(db.clone(), x * h..(x + 1) * h, vec![h]));
            }
        }
        let (gu, d) = (n("gate_up_proj"), n("down_proj"));
        if stored_with_shape(source, &gu, &[e, h, 2 * i])? {
            if !stored_with_shape(source, &d, &[e, i, h])? {
                return Err(ModelError::MissingTensor { name: d, dir: source.location().to_path_buf() });
            }
            for name in [&gu, &d] {
                stored_dtype_in(source, name, FLOATS, "gpt-oss's fused experts are transposed on load, which Krasis does for BF16, F16 and F32 (MXFP4 comes as `*_blocks` / `*_scales`)")?;
            }
            for x in 0..e {
                let t = |from: &String, base: usize, k: usize, n: usize, cols: Vec<usize>| Derived::Transposed {
                    from: from.clone(),
                    base,
                    k,
                    n,
                    shape: vec![cols.len(), k],
                    cols,
                };
                let alt = |first: usize| (0..i).map(|j| 2 * j + first).collect::<Vec<_>>();
                out.insert(n(&format!("{x}.gate_proj.weight")), t(&gu, x * h * 2 * i, h, 2 * i, alt(0)));
                out.insert(n(&format!("{x}.up_proj.weight")), t(&gu, x * h * 2 * i, h, 2 * i, alt(1)));
                out.insert(n(&format!("{x}.down_proj.weight")), t(&d, x * i * h, i, h, (0..h).collect()));
            }
            continue;
        }
        let (gub_, gus, db_, ds) =
            (n("gate_up_proj_blocks"), n("gate_up_proj_scales"), n("down_proj_blocks"), n("down_proj_scales"));
        if !source.contains(&gub_) {
            continue;
        }
        for (dim, what) in [(h, "hidden_size"), (i, "intermediate_size")] {
            if !dim.is_multiple_of(32) {
                return Err(ModelError::Invalid(format!(
                    "{}: MXFP4 experts need {what} ({dim}) to be a multiple of 32",
                    source.location().display()
                )));
            }
        }
        let (gh, gi) = (h / 32, i / 32);
        for (name, shape) in [
            (&gub_, vec![e, 2 * i, gh, 16]),
            (&gus, vec![e, 2 * i, gh]),
            (&db_, vec![e, h, gi, 16]),
            (&ds, vec![e, h, gi]),
        ] {
            if !stored_with_shape(source, name, &shape)? {
                return Err(ModelError::MissingTensor { name: name.clone(), dir: source.location().to_path_buf() });
            }
            stored_dtype_in(source, name, &[DType::U8], "MXFP4 blocks and scales are uint8")?;
        }
        for x in 0..e {
            let alt = |first: usize| (0..i).map(|j| x * 2 * i + 2 * j + first).collect::<Vec<_>>();
            for (proj, first) in [("gate_proj", 0), ("up_proj", 1)] {
                out.insert(
                    n(&format!("{x}.{proj}.weight_blocks")),
                    rows(gub_.clone(), alt(first), gh * 16, vec![i, gh, 16]),
                );
                out.insert(n(&format!("{x}.{proj}.weight_scales")), rows(gus.clone(), alt(first), gh, vec![i, gh]));
            }
            out.insert(
                n(&format!("{x}.down_proj.weight_blocks")),
                range(db_.clone(), x * h * gi * 16..(x + 1) * h * gi * 16, vec![h, gi, 16]),
            );
            out.insert(
                n(&format!("{x}.down_proj.weight_scales")),
                range(ds.clone(), x * h * gi..(x + 1) * h * gi, vec![h, gi]),
            );
        }
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
            Derived::Rows { from, rows, row_elems, shape } => {
                let t = self.inner.tensor(from)?;
                let row = row_elems * t.dtype.size_bytes();
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
            Derived::Transposed { from, base, k, n, cols, shape } => {
                let t = self.inner.tensor(from)?;
                let es = t.dtype.size_bytes();
                let src = t.bytes.as_slice();
                let mut buf = Vec::with_capacity(cols.len() * k * es);
                for &c in cols {
                    for j in 0..*k {
                        let at = (base + j * n + c) * es;
                        buf.extend_from_slice(&src[at..at + es]);
                    }
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
            Some(Derived::Range { from, .. } | Derived::Rows { from, .. } | Derived::Transposed { from, .. }) => {
                self.inner.stored_dtype(from)
            }
            None => self.inner.stored_dtype(name),
        }
    }

    fn is_mapped(&self, name: &str) -> bool {
        match self.derived.get(name) {
            Some(Derived::Range { from, .. }) => self.inner.is_mapped(from),
            Some(Derived::Rows { .. } | Derived::Transposed { .. }) => false,
            None => self.inner.is_mapped(name),
        }
    }

    fn release_resident(&self) {
        self.inner.release_resident()
    }
}
