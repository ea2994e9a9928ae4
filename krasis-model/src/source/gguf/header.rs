//! The GGUF header (v2/v3, little-endian): magic, version, metadata key/values, tensor infos.
//!
//! Parsed from a byte slice (the file's mapping) without trusting any count or length in it:
//! every count is checked against the bytes left *before* anything is allocated from it (an
//! array of 2^60 elements is refused because 2^60 elements cannot fit in the file), strings and
//! arrays are kept as ranges into the mapping (no copy, no per-element allocation), every tensor's
//! dimensions, byte size, alignment and data range are checked, and duplicate keys or tensor
//! names are refused. Errors are one line naming the field.

use std::collections::HashMap;
use std::ops::Range;

use krasis_quant::ggml::GgmlType;

/// `GGUF` read as a little-endian u32.
const MAGIC: &[u8; 4] = b"GGUF";
/// Default alignment of tensor data (the GGUF spec's, when `general.alignment` is absent).
pub const DEFAULT_ALIGNMENT: usize = 32;
/// Alignment cap: the spec allows any power of two; real files use 32. A megabyte still leaves
/// page alignment possible and keeps the padding arithmetic far from overflow.
const MAX_ALIGNMENT: usize = 1 << 20;
/// One string (key, value, tensor name): chat templates are tens of KiB; this is far above any
/// real one, and every length is also checked against the bytes left.
const MAX_STRING_BYTES: u64 = 64 << 20;
/// ggml tensors have at most 4 dimensions (`GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;
/// Arrays of arrays: the spec allows nesting, no model uses more than one level; a cap keeps a
/// hostile file from recursing deep.
const MAX_ARRAY_DEPTH: u32 = 2;
/// Smallest encoded metadata key/value: key length (8) + one key byte + value type (4) + a u8.
const MIN_KV_BYTES: u64 = 14;
/// Smallest encoded tensor info: name length (8) + one byte + n_dims (4) + one dim (8) + type (4)
/// + offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 33;

/// Metadata value types (GGUF `gguf_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Encoded size of a fixed-size value (`None` for strings and arrays).
    fn fixed_size(self) -> Option<usize> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    /// The smallest encoded size of one value of this type (a string's length prefix, an array's
    /// type and count).
    fn min_size(self) -> u64 {
        match self {
            ValueType::String => 8,
            ValueType::Array => 12,
            t => t.fixed_size().unwrap_or(1) as u64,
        }
    }
}

/// A metadata value. Strings and arrays are ranges of the file's bytes, decoded on request.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Int(i128),
    Float(f64),
    Bool(bool),
    /// UTF-8 checked at parse time.
    Str(Range<usize>),
    Array {
        elem: ValueType,
        len: usize,
        bytes: Range<usize>,
    },
}

/// One tensor's entry in the header, validated.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous (innermost) dimension.
    pub dims: Vec<usize>,
    pub ty: GgmlType,
    /// Absolute byte range of the data in the file.
    pub data: Range<usize>,
}

impl TensorInfo {
    /// The shape in row-major (PyTorch) order: `dims` reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }

    pub fn elements(&self) -> usize {
        self.dims.iter().product()
    }
}

/// A parsed, validated header.
#[derive(Debug)]
pub struct Header {
    pub version: u32,
    pub kv: HashMap<String, Value>,
    /// In file order.
    pub tensors: Vec<TensorInfo>,
    pub alignment: usize,
    /// Absolute offset of the tensor data section.
    pub data_offset: usize,
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

type Res<T> = std::result::Result<T, String>;

impl<'a> Cursor<'a> {
    fn left(&self) -> u64 {
        (self.b.len() - self.pos) as u64
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Res<Range<usize>> {
        if (n as u64) > self.left() {
            return Err(format!(
                "{}: needs {n} bytes at offset {}, the file ends at {}",
                what(),
                self.pos,
                self.b.len()
            ));
        }
        let r = self.pos..self.pos + n;
        self.pos += n;
        Ok(r)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Res<u32> {
        let r = self.take(4, what)?;
        Ok(u32::from_le_bytes(self.b[r].try_into().expect("4 bytes")))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Res<u64> {
        let r = self.take(8, what)?;
        Ok(u64::from_le_bytes(self.b[r].try_into().expect("8 bytes")))
    }

    /// A length-prefixed UTF-8 string, as a range of the buffer.
    fn string(&mut self, what: &dyn Fn() -> String) -> Res<Range<usize>> {
        let len = self.u64(what)?;
        if len > MAX_STRING_BYTES {
            return Err(format!("{}: string length {len} exceeds the {MAX_STRING_BYTES}-byte cap", what()));
        }
        if len > self.left() {
            return Err(format!(
                "{}: string length {len} runs past the end of the file ({} bytes left)",
                what(),
                self.left()
            ));
        }
        let r = self.take(len as usize, what)?;
        std::str::from_utf8(&self.b[r.clone()]).map_err(|e| format!("{}: string is not UTF-8 ({e})", what()))?;
        Ok(r)
    }

    fn value_type(&mut self, what: &dyn Fn() -> String) -> Res<ValueType> {
        let id = self.u32(what)?;
        ValueType::from_id(id).ok_or_else(|| format!("{}: unknown metadata value type {id}", what()))
    }

    /// A value of type `t`; arrays are walked (strings inside validated) but not materialised.
    fn value(&mut self, t: ValueType, depth: u32, what: &dyn Fn() -> String) -> Res<Value> {
        use ValueType::*;
        let fixed = |c: &mut Self, n: usize| -> Res<&'a [u8]> {
            let r = c.take(n, what)?;
            Ok(&c.b[r])
        };
        Ok(match t {
            U8 => Value::Int(fixed(self, 1)?[0] as i128),
            I8 => Value::Int(fixed(self, 1)?[0] as i8 as i128),
            U16 => Value::Int(u16::from_le_bytes(fixed(self, 2)?.try_into().expect("2")) as i128),
            I16 => Value::Int(i16::from_le_bytes(fixed(self, 2)?.try_into().expect("2")) as i128),
            U32 => Value::Int(u32::from_le_bytes(fixed(self, 4)?.try_into().expect("4")) as i128),
            I32 => Value::Int(i32::from_le_bytes(fixed(self, 4)?.try_into().expect("4")) as i128),
            U64 => Value::Int(u64::from_le_bytes(fixed(self, 8)?.try_into().expect("8")) as i128),
            I64 => Value::Int(i64::from_le_bytes(fixed(self, 8)?.try_into().expect("8")) as i128),
            F32 => Value::Float(f32::from_le_bytes(fixed(self, 4)?.try_into().expect("4")) as f64),
            F64 => Value::Float(f64::from_le_bytes(fixed(self, 8)?.try_into().expect("8"))),
            Bool => match fixed(self, 1)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(format!("{}: bool byte {b} is neither 0 nor 1", what())),
            },
            String => Value::Str(self.string(what)?),
            Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!("{}: arrays nested deeper than {MAX_ARRAY_DEPTH}", what()));
                }
                let elem = self.value_type(what)?;
                let len = self.u64(what)?;
                // Before walking or allocating anything: can `len` elements fit in what is left?
                let min = (len as u128) * (elem.min_size() as u128);
                if min > self.left() as u128 {
                    return Err(format!(
                        "{}: array of {len} {elem:?} elements needs at least {min} bytes, {} are left in the file",
                        what(),
                        self.left()
                    ));
                }
                let start = self.pos;
                match elem.fixed_size() {
                    Some(size) => {
                        self.take(len as usize * size, what)?;
                    }
                    None => {
                        for i in 0..len {
                            let at = || format!("{}[{i}]", what());
                            self.value(elem, depth + 1, &at)?;
                        }
                    }
                }
                Value::Array { elem, len: len as usize, bytes: start..self.pos }
            }
        })
    }
}

/// A key or tensor name as it appears in a message: control characters escaped (a name with a
/// newline must not split the one-line error) and long names cut.
pub fn shown(name: &str) -> String {
    /// Characters of a name quoted in a message: real names are < 100.
    const MAX_SHOWN: usize = 120;
    let mut out: String = name.chars().take(MAX_SHOWN).flat_map(char::escape_debug).collect();
    if name.chars().count() > MAX_SHOWN {
        out.push('…');
    }
    out
}

fn align_up(x: usize, a: usize) -> Option<usize> {
    x.checked_add(a - 1).map(|v| v / a * a)
}

/// Parse and validate the header of a GGUF file held in `b` (the whole file). The error is the
/// message only; the caller adds the file name.
pub fn parse(b: &[u8]) -> Res<Header> {
    let mut c = Cursor { b, pos: 0 };
    let magic = c.take(4, &|| "magic".into())?;
    if &b[magic] != MAGIC {
        return Err(format!("not a GGUF file (magic {:02x?}, expected \"GGUF\")", &b[..4]));
    }
    let version = c.u32(&|| "version".into())?;
    match version {
        2 | 3 => {}
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
            return Err("big-endian GGUF files are not supported".into());
        }
        1 => {
            return Err(
                "GGUF version 1 (32-bit counts) is not supported; convert it again with a current llama.cpp".into()
            )
        }
        v => return Err(format!("version {v} is not supported (2 or 3)")),
    }
    let n_tensors = c.u64(&|| "tensor_count".into())?;
    let n_kv = c.u64(&|| "metadata_kv_count".into())?;
    if (n_kv as u128) * (MIN_KV_BYTES as u128) > c.left() as u128 {
        return Err(format!("metadata_kv_count {n_kv} cannot fit in the {} bytes left", c.left()));
    }
    if (n_tensors as u128) * (MIN_TENSOR_INFO_BYTES as u128) > c.left() as u128 {
        return Err(format!("tensor_count {n_tensors} cannot fit in the {} bytes left", c.left()));
    }

    let mut kv = HashMap::with_capacity(n_kv as usize);
    for i in 0..n_kv {
        let key_r = c.string(&|| format!("metadata key {i}"))?;
        let key = std::str::from_utf8(&b[key_r]).expect("checked UTF-8").to_string();
        let what = || format!("metadata `{}`", shown(&key));
        let t = c.value_type(&what)?;
        let v = c.value(t, 0, &what)?;
        if kv.insert(key.clone(), v).is_some() {
            return Err(format!("metadata key `{}` appears twice", shown(&key)));
        }
    }

    let alignment = match kv.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(Value::Int(a)) if *a > 0 && (*a as u128).is_power_of_two() && *a as usize <= MAX_ALIGNMENT => *a as usize,
        Some(v) => {
            return Err(format!("metadata `general.alignment`: {v:?} is not a power of two in 1..={MAX_ALIGNMENT}"))
        }
    };

    let mut names: HashMap<String, usize> = HashMap::with_capacity(n_tensors as usize);
    let mut raw = Vec::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let name_r = c.string(&|| format!("tensor info {i}: name"))?;
        let name = std::str::from_utf8(&b[name_r]).expect("checked UTF-8").to_string();
        let sn = shown(&name);
        let what = || format!("tensor `{sn}`");
        let n_dims = c.u32(&what)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(format!("tensor `{sn}`: {n_dims} dimensions (1 to {MAX_DIMS} allowed)"));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        let mut elements: u64 = 1;
        for d in 0..n_dims {
            let v = c.u64(&what)?;
            if v == 0 {
                return Err(format!("tensor `{sn}`: dimension {d} is 0"));
            }
            elements = elements
                .checked_mul(v)
                .filter(|&e| e <= i64::MAX as u64)
                .ok_or_else(|| format!("tensor `{sn}`: element count overflows"))?;
            dims.push(v as usize);
        }
        let type_id = c.u32(&what)?;
        let ty = GgmlType::from_id(type_id).map_err(|e| format!("tensor `{sn}`: {e}"))?;
        let offset = c.u64(&what)?;
        if !dims[0].is_multiple_of(ty.block_elems()) {
            return Err(format!(
                "tensor `{sn}`: first dimension {} is not a multiple of the {ty} block size {}",
                dims[0],
                ty.block_elems()
            ));
        }
        let bytes = ty.bytes_for(elements as usize).map_err(|e| format!("tensor `{sn}`: {e}"))?;
        if !offset.is_multiple_of(alignment as u64) {
            return Err(format!("tensor `{sn}`: data offset {offset} is not a multiple of the alignment {alignment}"));
        }
        if let Some(prev) = names.insert(name.clone(), raw.len()) {
            return Err(format!("tensor `{sn}` appears twice (tensor infos {prev} and {i})"));
        }
        raw.push((name, dims, ty, offset, bytes));
    }

    let data_offset = align_up(c.pos, alignment).ok_or("data section offset overflows")?;
    if !raw.is_empty() && data_offset > b.len() {
        return Err(format!(
            "the tensor data section (offset {data_offset}) starts past the end of the file ({} bytes)",
            b.len()
        ));
    }
    let tensors = raw
        .into_iter()
        .map(|(name, dims, ty, offset, bytes)| {
            let start = (data_offset as u64).checked_add(offset);
            let end = start.and_then(|s| s.checked_add(bytes as u64));
            match (start, end) {
                (Some(s), Some(e)) if e <= b.len() as u64 => {
                    Ok(TensorInfo { name, dims, ty, data: s as usize..e as usize })
                }
                _ => Err(format!(
                    "tensor `{}`: data [{offset}, +{bytes}) of the data section at {data_offset} runs past the end of the file ({} bytes)",
                    shown(&name),
                    b.len()
                )),
            }
        })
        .collect::<Res<Vec<_>>>()?;
    Ok(Header { version, kv, tensors, alignment, data_offset })
}

impl Value {
    /// A string value, decoded from the file bytes `b`.
    pub fn as_str<'b>(&self, b: &'b [u8]) -> Option<&'b str> {
        match self {
            Value::Str(r) => std::str::from_utf8(&b[r.clone()]).ok(),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i128> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(*b as i128),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Float(f) => Some(*f),
            Value::Int(i) => Some(*i as f64),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// An array of strings (the elements were validated as UTF-8 at parse time).
    pub fn as_str_array<'b>(&self, b: &'b [u8]) -> Option<Vec<&'b str>> {
        let Value::Array { elem: ValueType::String, len, bytes } = self else { return None };
        let mut out = Vec::with_capacity(*len);
        let mut pos = bytes.start;
        for _ in 0..*len {
            let n = u64::from_le_bytes(b[pos..pos + 8].try_into().ok()?) as usize;
            out.push(std::str::from_utf8(&b[pos + 8..pos + 8 + n]).ok()?);
            pos += 8 + n;
        }
        Some(out)
    }

    /// An array of integers of any integer element type.
    pub fn as_int_array(&self, b: &[u8]) -> Option<Vec<i128>> {
        let Value::Array { elem, len, bytes } = self else { return None };
        let size = elem.fixed_size()?;
        let raw = &b[bytes.clone()];
        let mut out = Vec::with_capacity(*len);
        for c in raw.chunks_exact(size) {
            let mut cur = Cursor { b: c, pos: 0 };
            match cur.value(*elem, 0, &String::new).ok()? {
                Value::Int(i) => out.push(i),
                Value::Bool(v) => out.push(v as i128),
                _ => return None,
            }
        }
        Some(out)
    }

    /// An array of floats (f32/f64 elements, or integers).
    pub fn as_f64_array(&self, b: &[u8]) -> Option<Vec<f64>> {
        let Value::Array { elem, bytes, .. } = self else { return None };
        let size = elem.fixed_size()?;
        b[bytes.clone()]
            .chunks_exact(size)
            .map(|c| Cursor { b: c, pos: 0 }.value(*elem, 0, &String::new).ok().and_then(|v| v.as_f64()))
            .collect()
    }
}
