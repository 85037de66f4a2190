//! A pickle reader that never runs code: an opcode machine (protocols 2–5) whose GLOBALs must
//! be on an allow-list and are interpreted here, not looked up. What `torch.save` writes for
//! state dicts and Megatron checkpoints comes out as a [`Value`] tree with tensors as
//! [`TensorRef`]s (storage key, dtype, offset, shape, stride): data is read later, lazily.
//!
//! Opcode meanings follow CPython's `Lib/pickletools.py`. Every length read from the stream is
//! checked against the bytes left before anything is allocated.

use std::collections::HashMap;

/// Element types of torch storages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// float64
    F64,
    /// float32
    F32,
    /// float16
    F16,
    /// bfloat16
    BF16,
    /// int64
    I64,
    /// int32
    I32,
    /// int16
    I16,
    /// int8
    I8,
    /// uint8
    U8,
    /// bool
    Bool,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// The legacy storage class torch pickles for this dtype (`FloatStorage`, …).
    pub fn storage_class(self) -> &'static str {
        lookup_name(STORAGE_CLASSES, self)
    }

    /// The name of the `torch.<dtype>` object (`bfloat16`, …).
    pub fn torch_name(self) -> &'static str {
        lookup_name(TORCH_DTYPES, self)
    }
}

fn lookup_name(table: &[(&'static str, DType)], d: DType) -> &'static str {
    table
        .iter()
        .find(|(_, t)| *t == d)
        .map(|(n, _)| *n)
        .expect("every dtype is in the table")
}

const STORAGE_CLASSES: &[(&str, DType)] = &[
    ("DoubleStorage", DType::F64),
    ("FloatStorage", DType::F32),
    ("HalfStorage", DType::F16),
    ("BFloat16Storage", DType::BF16),
    ("LongStorage", DType::I64),
    ("IntStorage", DType::I32),
    ("ShortStorage", DType::I16),
    ("CharStorage", DType::I8),
    ("ByteStorage", DType::U8),
    ("BoolStorage", DType::Bool),
];

const TORCH_DTYPES: &[(&str, DType)] = &[
    ("float64", DType::F64),
    ("float32", DType::F32),
    ("float16", DType::F16),
    ("bfloat16", DType::BF16),
    ("int64", DType::I64),
    ("int32", DType::I32),
    ("int16", DType::I16),
    ("int8", DType::I8),
    ("uint8", DType::U8),
    ("bool", DType::Bool),
    ("float", DType::F32),
    ("double", DType::F64),
    ("half", DType::F16),
    ("long", DType::I64),
    ("int", DType::I32),
];

/// A storage named by a persistent id: `('storage', torch.XStorage, key, location, numel)`.
#[derive(Debug, Clone, PartialEq)]
pub struct StorageRef {
    /// Record name under `<archive>/data/`.
    pub key: String,
    /// Element type.
    pub dtype: DType,
    /// Where it lived when saved (`cpu`, `cuda:0`); ignored when loading.
    pub location: String,
    /// Elements in the storage.
    pub numel: u64,
}

/// A tensor as `torch._utils._rebuild_tensor_v2` describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorRef {
    /// The storage it views.
    pub storage: StorageRef,
    /// Offset into the storage, in elements.
    pub offset: u64,
    /// Shape.
    pub shape: Vec<u64>,
    /// Strides, in elements.
    pub stride: Vec<u64>,
}

impl TensorRef {
    /// Elements in the tensor.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Row-major contiguous (the only layout the data reader accepts without copying).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1u64;
        for (&n, &s) in self.shape.iter().zip(&self.stride).rev() {
            if n != 1 && s != expected {
                return false;
            }
            expected *= n;
        }
        true
    }
}

/// What an allowed pickle can hold.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `None`
    None,
    /// `bool`
    Bool(bool),
    /// `int` (that fits i64)
    Int(i64),
    /// `float`
    Float(f64),
    /// `str`
    Str(String),
    /// `bytes` / `bytearray`
    Bytes(Vec<u8>),
    /// `list`
    List(Vec<Value>),
    /// `tuple`
    Tuple(Vec<Value>),
    /// `dict` or `collections.OrderedDict`, in insertion order.
    Dict(Vec<(Value, Value)>),
    /// `argparse.Namespace` (Megatron's `args`), attributes in order.
    Namespace(Vec<(String, Value)>),
    /// A `torch.<dtype>` object (e.g. `args.params_dtype`).
    TorchDType(DType),
    /// A tensor (data not read).
    Tensor(TensorRef),
    /// Internal: a storage from a persistent id, consumed by the tensor rebuild.
    Storage(StorageRef),
    /// Internal: an allowed global not yet called.
    Global(Global),
}

impl Value {
    /// Look up `key` in a dict (string keys).
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(items) => items
                .iter()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
                .map(|(_, v)| v),
            Value::Namespace(attrs) => attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
}

/// The globals the reader understands; anything else is refused.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Global {
    /// `collections.OrderedDict`
    OrderedDict,
    /// `torch._utils._rebuild_tensor_v2`
    RebuildTensorV2,
    /// `torch._utils._rebuild_parameter`
    RebuildParameter,
    /// `torch.<X>Storage`
    StorageClass(DType),
    /// `torch.<dtype>`
    TorchDType(DType),
    /// `argparse.Namespace`
    Namespace,
    /// `_codecs.encode` (how protocol 2 pickles `bytes`)
    CodecsEncode,
    /// `builtins.bytearray`
    ByteArray,
}

fn resolve_global(module: &str, name: &str) -> Option<Global> {
    let storage = |n: &str| {
        STORAGE_CLASSES
            .iter()
            .find(|(c, _)| *c == n)
            .map(|(_, d)| *d)
    };
    let dtype = |n: &str| TORCH_DTYPES.iter().find(|(c, _)| *c == n).map(|(_, d)| *d);
    Some(match (module, name) {
        ("collections", "OrderedDict") => Global::OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2") => Global::RebuildTensorV2,
        ("torch._utils", "_rebuild_parameter") => Global::RebuildParameter,
        ("argparse", "Namespace") => Global::Namespace,
        ("_codecs", "encode") => Global::CodecsEncode,
        ("builtins" | "__builtin__", "bytearray") => Global::ByteArray,
        ("torch", n) => match (storage(n), dtype(n)) {
            (Some(d), _) => Global::StorageClass(d),
            (_, Some(d)) => Global::TorchDType(d),
            _ => return None,
        },
        _ => return None,
    })
}

/// Why a pickle was refused.
#[derive(Debug, thiserror::Error)]
pub enum PickleError {
    /// A global that is not on the allow-list (never imported or called).
    #[error("forbidden global {0} in the pickle (mindkit never runs pickled code; only tensors, containers and Megatron args are allowed)")]
    ForbiddenGlobal(String),
    /// An opcode outside protocols 2–5 or one that state dicts never use.
    #[error("unsupported pickle opcode 0x{opcode:02x} at byte {at}")]
    UnsupportedOpcode {
        /// The opcode byte.
        opcode: u8,
        /// Its position.
        at: usize,
    },
    /// The stream ends early or is malformed.
    #[error("malformed pickle at byte {at}: {what}")]
    Malformed {
        /// Where.
        at: usize,
        /// What.
        what: String,
    },
}

type Result<T> = std::result::Result<T, PickleError>;

/// Items on the machine's stack: values, or MARKs.
enum Item {
    Mark,
    Value(Value),
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<Item>,
    memo: HashMap<u32, Value>,
    copied: usize,
}

/// Parse one pickle (up to STOP) from `data`.
pub fn parse(data: &[u8]) -> Result<Value> {
    let mut m = Machine {
        data,
        pos: 0,
        stack: Vec::new(),
        memo: HashMap::new(),
        copied: 0,
    };
    m.run()
}

impl<'a> Machine<'a> {
    fn bad<T>(&self, what: impl Into<String>) -> Result<T> {
        Err(PickleError::Malformed {
            at: self.pos,
            what: what.into(),
        })
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.data.len() - self.pos {
            return self.bad(format!(
                "needs {n} bytes, {} left",
                self.data.len() - self.pos
            ));
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn le<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        b.copy_from_slice(self.take(N)?);
        Ok(b)
    }

    fn len_u32(&mut self) -> Result<usize> {
        Ok(u32::from_le_bytes(self.le()?) as usize)
    }

    fn len_u64(&mut self) -> Result<usize> {
        let n = u64::from_le_bytes(self.le()?);
        usize::try_from(n).or_else(|_| self.bad("length overflows"))
    }

    fn line(&mut self) -> Result<&'a str> {
        let rest = &self.data[self.pos..];
        let Some(end) = rest.iter().position(|&b| b == b'\n') else {
            return self.bad("unterminated text argument");
        };
        let s = std::str::from_utf8(&rest[..end])
            .or_else(|_| self.bad("text argument is not utf-8"))?;
        self.pos += end + 1;
        Ok(s)
    }

    fn string(&mut self, n: usize) -> Result<Value> {
        let bytes = self.take(n)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(Value::Str(s.to_owned())),
            Err(_) => self.bad("string is not utf-8"),
        }
    }

    fn push(&mut self, v: Value) {
        self.stack.push(Item::Value(v));
    }

    fn pop(&mut self) -> Result<Value> {
        match self.stack.pop() {
            Some(Item::Value(v)) => Ok(v),
            Some(Item::Mark) => self.bad("unexpected MARK"),
            None => self.bad("stack underflow"),
        }
    }

    fn top(&mut self) -> Result<&mut Value> {
        match self.stack.last_mut() {
            Some(Item::Value(v)) => Ok(v),
            _ => Err(PickleError::Malformed {
                at: self.pos,
                what: "no value on the stack".into(),
            }),
        }
    }

    /// Everything above the topmost MARK (which is removed).
    fn pop_mark(&mut self) -> Result<Vec<Value>> {
        let Some(mark) = self.stack.iter().rposition(|i| matches!(i, Item::Mark)) else {
            return self.bad("no MARK");
        };
        let items = self.stack.split_off(mark + 1);
        self.stack.pop();
        Ok(items
            .into_iter()
            .map(|i| match i {
                Item::Value(v) => v,
                Item::Mark => unreachable!("rposition found the topmost mark"),
            })
            .collect())
    }

    fn global(&self, module: &str, name: &str) -> Result<Value> {
        match resolve_global(module, name) {
            Some(Global::TorchDType(d)) => Ok(Value::TorchDType(d)),
            Some(g) => Ok(Value::Global(g)),
            None => Err(PickleError::ForbiddenGlobal(format!("{module}.{name}"))),
        }
    }

    /// Charge a copy of `v` (memo fetch, DUP) against the budget, so that a small pickle
    /// cannot expand into an enormous tree by fetching a container over and over.
    fn charge(&mut self, v: &Value) -> Result<()> {
        fn nodes(v: &Value) -> usize {
            match v {
                Value::List(x) | Value::Tuple(x) => 1 + x.iter().map(nodes).sum::<usize>(),
                Value::Dict(x) => 1 + x.iter().map(|(k, v)| nodes(k) + nodes(v)).sum::<usize>(),
                Value::Namespace(x) => 1 + x.iter().map(|(_, v)| nodes(v)).sum::<usize>(),
                Value::Str(s) => 1 + s.len() / 64,
                Value::Bytes(b) => 1 + b.len() / 64,
                _ => 1,
            }
        }
        self.copied += nodes(v);
        if self.copied > 1_000_000 + 16 * self.data.len() {
            return self.bad("the pickle expands far beyond its size (repeated memo fetches)");
        }
        Ok(())
    }

    fn memo_get(&mut self, i: u32) -> Result<Value> {
        let Some(v) = self.memo.get(&i).cloned() else {
            return self.bad(format!("memo {i} is not set"));
        };
        self.charge(&v)?;
        Ok(v)
    }

    fn memo_put(&mut self, i: u32) -> Result<()> {
        let v = self.top()?.clone();
        self.charge(&v)?;
        self.memo.insert(i, v);
        Ok(())
    }

    fn run(&mut self) -> Result<Value> {
        loop {
            let at = self.pos;
            let op = self.u8()?;
            match op {
                0x80 => {
                    let proto = self.u8()?;
                    if !(2..=5).contains(&proto) {
                        return self.bad(format!("protocol {proto} (2 to 5 supported)"));
                    }
                }
                0x95 => {
                    self.take(8)?; // FRAME: a length hint only
                }
                b'.' => return self.pop(),
                b'(' => self.stack.push(Item::Mark),
                b'0' => {
                    self.stack.pop();
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?.clone();
                    self.charge(&v)?;
                    self.push(v);
                }
                b'N' => self.push(Value::None),
                0x88 => self.push(Value::Bool(true)),
                0x89 => self.push(Value::Bool(false)),
                b'J' => {
                    let i = i32::from_le_bytes(self.le()?);
                    self.push(Value::Int(i as i64));
                }
                b'K' => {
                    let i = self.u8()?;
                    self.push(Value::Int(i as i64));
                }
                b'M' => {
                    let i = u16::from_le_bytes(self.le()?);
                    self.push(Value::Int(i as i64));
                }
                0x8a => {
                    let n = self.u8()? as usize;
                    let v = self.long(n)?;
                    self.push(v);
                }
                0x8b => {
                    let n = self.len_u32()?;
                    let v = self.long(n)?;
                    self.push(v);
                }
                b'G' => {
                    let f = f64::from_be_bytes(self.le()?);
                    self.push(Value::Float(f));
                }
                b'X' => {
                    let n = self.len_u32()?;
                    let v = self.string(n)?;
                    self.push(v);
                }
                0x8c => {
                    let n = self.u8()? as usize;
                    let v = self.string(n)?;
                    self.push(v);
                }
                0x8d => {
                    let n = self.len_u64()?;
                    let v = self.string(n)?;
                    self.push(v);
                }
                b'U' => {
                    // SHORT_BINSTRING: Python 2 str, latin-1 by torch's convention.
                    let n = self.u8()? as usize;
                    let s = self.take(n)?.iter().map(|&b| b as char).collect();
                    self.push(Value::Str(s));
                }
                b'C' => {
                    let n = self.u8()? as usize;
                    let b = self.take(n)?.to_vec();
                    self.push(Value::Bytes(b));
                }
                b'B' => {
                    let n = self.len_u32()?;
                    let b = self.take(n)?.to_vec();
                    self.push(Value::Bytes(b));
                }
                0x8e | 0x96 => {
                    let n = self.len_u64()?;
                    let b = self.take(n)?.to_vec();
                    self.push(Value::Bytes(b));
                }
                b'}' => self.push(Value::Dict(Vec::new())),
                b']' => self.push(Value::List(Vec::new())),
                b')' => self.push(Value::Tuple(Vec::new())),
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Value::Tuple(items));
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < n {
                        return self.bad("stack underflow");
                    }
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.push(Value::Tuple(items));
                }
                b'a' => {
                    let v = self.pop()?;
                    self.extend_list(vec![v])?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    self.extend_list(items)?;
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.set_items(vec![k, v])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.set_items(items)?;
                }
                b'q' => {
                    let i = self.u8()? as u32;
                    self.memo_put(i)?;
                }
                b'r' => {
                    let i = self.len_u32()? as u32;
                    self.memo_put(i)?;
                }
                0x94 => {
                    let i = self.memo.len() as u32;
                    self.memo_put(i)?;
                }
                b'h' => {
                    let i = self.u8()? as u32;
                    let v = self.memo_get(i)?;
                    self.push(v);
                }
                b'j' => {
                    let i = self.len_u32()? as u32;
                    let v = self.memo_get(i)?;
                    self.push(v);
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    let g = self.global(module, name)?;
                    self.push(g);
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Value::Str(module), Value::Str(name)) = (module, name) else {
                        return self.bad("STACK_GLOBAL needs two strings");
                    };
                    let g = self.global(&module, &name)?;
                    self.push(g);
                }
                b'R' | 0x81 => {
                    let args = self.pop()?;
                    let func = self.pop()?;
                    let v = self.call(func, args)?;
                    self.push(v);
                }
                b'b' => {
                    let state = self.pop()?;
                    self.build(state)?;
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let v = self.persistent(pid)?;
                    self.push(v);
                }
                _ => return Err(PickleError::UnsupportedOpcode { opcode: op, at }),
            }
        }
    }

    /// LONG1/LONG4: little-endian two's complement; must fit in i64.
    fn long(&mut self, n: usize) -> Result<Value> {
        let bytes = self.take(n)?;
        if n > 8 {
            return self.bad(format!("integer of {n} bytes"));
        }
        let fill = if bytes.last().is_some_and(|&b| b & 0x80 != 0) {
            0xff
        } else {
            0
        };
        let mut b = [fill; 8];
        b[..n].copy_from_slice(bytes);
        Ok(Value::Int(i64::from_le_bytes(b)))
    }

    fn extend_list(&mut self, items: Vec<Value>) -> Result<()> {
        match self.top()? {
            Value::List(list) => {
                list.extend(items);
                Ok(())
            }
            _ => self.bad("APPEND to a non-list"),
        }
    }

    fn set_items(&mut self, items: Vec<Value>) -> Result<()> {
        if !items.len().is_multiple_of(2) {
            return self.bad("SETITEMS with an odd number of items");
        }
        let Value::Dict(dict) = self.top()? else {
            return self.bad("SETITEM on a non-dict");
        };
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            match dict.iter_mut().find(|(old, _)| *old == k) {
                Some(slot) => slot.1 = v,
                None => dict.push((k, v)),
            }
        }
        Ok(())
    }

    fn call(&self, func: Value, args: Value) -> Result<Value> {
        let Value::Global(g) = func else {
            return self.bad("call of a non-global");
        };
        let Value::Tuple(args) = args else {
            return self.bad("call arguments are not a tuple");
        };
        match (g, args.as_slice()) {
            (Global::OrderedDict, []) => Ok(Value::Dict(Vec::new())),
            (Global::Namespace, []) => Ok(Value::Namespace(Vec::new())),
            (Global::RebuildTensorV2, [storage, offset, size, stride, _grad, _hooks, ..]) => {
                let Value::Storage(storage) = storage else {
                    return self.bad("_rebuild_tensor_v2 without a storage");
                };
                let tensor = TensorRef {
                    storage: storage.clone(),
                    offset: self.uint(offset)?,
                    shape: self.uints(size)?,
                    stride: self.uints(stride)?,
                };
                if tensor.shape.len() != tensor.stride.len() {
                    return self.bad("tensor shape and stride differ in rank");
                }
                Ok(Value::Tensor(tensor))
            }
            (Global::RebuildParameter, [tensor @ Value::Tensor(_), ..]) => Ok(tensor.clone()),
            (Global::CodecsEncode, [Value::Str(s), Value::Str(enc)]) if enc == "latin1" => {
                match s.chars().map(|c| u8::try_from(c as u32)).collect() {
                    Ok(bytes) => Ok(Value::Bytes(bytes)),
                    Err(_) => self.bad("latin1 bytes out of range"),
                }
            }
            (Global::ByteArray, [Value::Bytes(b)]) => Ok(Value::Bytes(b.clone())),
            (Global::ByteArray, []) => Ok(Value::Bytes(Vec::new())),
            (g, _) => self.bad(format!("{g:?} called with unexpected arguments")),
        }
    }

    fn uint(&self, v: &Value) -> Result<u64> {
        match v {
            Value::Int(i) if *i >= 0 => Ok(*i as u64),
            _ => self.bad("expected a non-negative integer"),
        }
    }

    fn uints(&self, v: &Value) -> Result<Vec<u64>> {
        match v {
            Value::Tuple(items) => items.iter().map(|i| self.uint(i)).collect(),
            _ => self.bad("expected a tuple of integers"),
        }
    }

    fn build(&mut self, state: Value) -> Result<()> {
        let pos = self.pos;
        match (self.top()?, state) {
            (Value::Namespace(attrs), Value::Dict(items)) => {
                for (k, v) in items {
                    let Value::Str(k) = k else {
                        return Err(PickleError::Malformed {
                            at: pos,
                            what: "Namespace attribute name is not a string".into(),
                        });
                    };
                    attrs.push((k, v));
                }
                Ok(())
            }
            // OrderedDict state (e.g. a module state_dict's `_metadata`) carries no tensors.
            (Value::Dict(_), _) => Ok(()),
            _ => self.bad("BUILD on an object that takes no state"),
        }
    }

    fn persistent(&self, pid: Value) -> Result<Value> {
        let Value::Tuple(items) = pid else {
            return self.bad("persistent id is not a tuple");
        };
        match items.as_slice() {
            [Value::Str(tag), Value::Global(Global::StorageClass(dtype)), Value::Str(key), Value::Str(location), numel]
                if tag == "storage" =>
            {
                Ok(Value::Storage(StorageRef {
                    key: key.clone(),
                    dtype: *dtype,
                    location: location.clone(),
                    numel: self.uint(numel)?,
                }))
            }
            _ => self.bad("persistent id is not ('storage', torch.XStorage, key, location, numel)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exact stream torch writes for `{'w': bf16 tensor [4, 8]}` (reference/ckpt.md §4.3).
    fn bf16_state_dict() -> Vec<u8> {
        b"\x80\x02}q\x00X\x01\x00\x00\x00wq\x01ctorch._utils\n_rebuild_tensor_v2\nq\x02((X\x07\x00\x00\x00storageq\x03ctorch\nBFloat16Storage\nq\x04X\x01\x00\x00\x000q\x05X\x03\x00\x00\x00cpuq\x06K tq\x07QK\x00K\x04K\x08\x86q\x08K\x08K\x01\x86q\t\x89ccollections\nOrderedDict\nq\n)Rq\x0btq\x0cRq\rs.".to_vec()
    }

    #[test]
    fn reads_a_torch_state_dict() {
        let v = parse(&bf16_state_dict()).unwrap();
        let Some(Value::Tensor(t)) = v.get("w") else {
            panic!("{v:?}")
        };
        assert_eq!(t.storage.dtype, DType::BF16);
        assert_eq!(t.storage.key, "0");
        assert_eq!(t.storage.numel, 32);
        assert_eq!(
            (t.offset, t.shape.clone(), t.stride.clone()),
            (0, vec![4, 8], vec![8, 1])
        );
        assert!(t.is_contiguous());
    }

    #[test]
    fn refuses_os_system() {
        let p = b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00echo\x85R.";
        let e = parse(p).unwrap_err().to_string();
        assert!(e.contains("forbidden global os.system"), "{e}");
        let p = b"\x80\x04\x8c\x02os\x8c\x06system\x93.";
        assert!(parse(p).unwrap_err().to_string().contains("os.system"));
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let p = bf16_state_dict();
        for n in 0..p.len() {
            assert!(parse(&p[..n]).is_err(), "prefix of {n} bytes parsed");
        }
    }

    #[test]
    fn huge_lengths_are_refused_before_allocating() {
        let p = b"\x80\x02X\xff\xff\xff\xff.";
        assert!(parse(p)
            .unwrap_err()
            .to_string()
            .contains("needs 4294967295 bytes"));
        let p = b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\x7f.";
        assert!(parse(p).is_err());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let _ = parse(&bytes);
        }

        #[test]
        fn mutated_state_dicts_never_panic(at in 0usize..120, byte in proptest::num::u8::ANY) {
            let mut p = bf16_state_dict();
            let at = at % p.len();
            p[at] = byte;
            let _ = parse(&p);
        }
    }
}
