//! A minimal GGUF v3 writer: enough to write small models and hostile variants of them in tests
//! (the reader's tests, the fuzz target, the integration tests). Not used to write real models.

use krasis_quant::ggml::GgmlType;

/// One metadata value as the writer encodes it.
#[derive(Clone, Debug)]
pub enum MetaValue {
    U32(u32),
    I32(i32),
    U64(u64),
    F32(f32),
    Bool(bool),
    Str(String),
    StrArray(Vec<String>),
    I32Array(Vec<i32>),
}

/// A GGUF file being assembled in memory.
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    pub kv: Vec<(String, MetaValue)>,
    /// (name, ggml dims — innermost first —, type, raw data)
    pub tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
    /// Tensor data alignment (32 unless set).
    pub alignment: Option<usize>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl GgufWriter {
    pub fn meta(&mut self, key: &str, v: MetaValue) -> &mut Self {
        self.kv.push((key.to_string(), v));
        self
    }

    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        self.tensors.push((name.to_string(), dims.to_vec(), ty, data));
        self
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.alignment.unwrap_or(super::header::DEFAULT_ALIGNMENT);
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            put_str(&mut out, k);
            match v {
                MetaValue::U32(x) => {
                    out.extend(4u32.to_le_bytes());
                    out.extend(x.to_le_bytes());
                }
                MetaValue::I32(x) => {
                    out.extend(5u32.to_le_bytes());
                    out.extend(x.to_le_bytes());
                }
                MetaValue::F32(x) => {
                    out.extend(6u32.to_le_bytes());
                    out.extend(x.to_le_bytes());
                }
                MetaValue::Bool(x) => {
                    out.extend(7u32.to_le_bytes());
                    out.push(*x as u8);
                }
                MetaValue::Str(s) => {
                    out.extend(8u32.to_le_bytes());
                    put_str(&mut out, s);
                }
                MetaValue::U64(x) => {
                    out.extend(10u32.to_le_bytes());
                    out.extend(x.to_le_bytes());
                }
                MetaValue::StrArray(a) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(8u32.to_le_bytes());
                    out.extend((a.len() as u64).to_le_bytes());
                    for s in a {
                        put_str(&mut out, s);
                    }
                }
                MetaValue::I32Array(a) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(5u32.to_le_bytes());
                    out.extend((a.len() as u64).to_le_bytes());
                    for x in a {
                        out.extend(x.to_le_bytes());
                    }
                }
            }
        }
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            put_str(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.id().to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len()).div_ceil(align) * align;
        }
        let data_start = out.len().div_ceil(align) * align;
        out.resize(data_start, 0);
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off, 0);
            out.extend(data);
        }
        out
    }
}
