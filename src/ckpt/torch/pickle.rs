//! A pickle reader that never runs code: an opcode machine (protocols 2–5) whose GLOBALs must
//! be on an allow-list and are interpreted here, not looked up. What `torch.save` writes for
//! state dicts and Megatron checkpoints comes out as a [`Value`] tree with tensors as
//! [`TensorRef`]s (storage key, dtype, offset, shape, stride): data is read later, lazily.
//!
//! Opcode meanings follow CPython's `Lib/pickletools.py`. Every length read from the stream is
//! checked against the bytes left before anything is allocated.

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;
use std::mem::size_of;

use crate::tensor::DType;

/// How torch names each dtype (storage classes and `torch.<dtype>` objects).
impl DType {
    /// The legacy storage class torch pickles for this dtype (`FloatStorage`, …).
    pub fn storage_class(self) -> &'static str {
        lookup_name(STORAGE_CLASSES, self)
    }

    /// The name of the `torch.<dtype>` object (`bfloat16`, …).
    pub fn torch_name(self) -> &'static str {
        lookup_name(TORCH_DTYPES, self)
    }
}

/// The dtype torch names `name` (`bfloat16`, `float`, …).
pub fn dtype_of_torch_name(name: &str) -> Option<DType> {
    (TORCH_DTYPES.iter())
        .find(|(c, _)| *c == name)
        .map(|(_, d)| *d)
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

/// The dtypes torch pickles as a typed storage class ([`DType::storage_class`]); newer ones
/// (float8) only as untyped storage with a dtype.
pub fn has_storage_class(d: DType) -> bool {
    STORAGE_CLASSES.iter().any(|&(_, t)| t == d)
}

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
    ("float8_e4m3fn", DType::F8E4M3),
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
    /// A tensor (data not read). Boxed, like the storage: a [`Value`] stays 32 bytes.
    Tensor(Box<TensorRef>),
    /// An object of one of the allowed classes of a distributed checkpoint's index (torch's DCP
    /// `Metadata` and its parts), its attributes in order.
    Object(Box<Object>),
    /// Internal: a storage from a persistent id, consumed by the tensor rebuild.
    Storage(Box<StorageRef>),
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

/// An instance of an allowed class, rebuilt as `NEWOBJ` + `BUILD` rebuild it: the attributes
/// of its `__dict__` state, or its `__setstate__` tuple under [`Object::STATE`].
#[derive(Debug, Clone, PartialEq)]
pub struct Object {
    /// Its class.
    pub class: DcpClass,
    /// Its attributes.
    pub attrs: Vec<(String, Value)>,
}

impl Object {
    /// The attribute a tuple state (`__setstate__`) is kept under.
    pub const STATE: &'static str = "__setstate__";

    /// Attribute `name`.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.attrs.iter().find(|(k, _)| k == name).map(|(_, v)| v)
    }
}

/// The classes of torch's distributed checkpoint index (`.metadata`: torch 2.9
/// torch/distributed/checkpoint/metadata.py, filesystem.py; megatron-core 0.15
/// dist_checkpointing/strategies/torch.py `MCoreMetadata`) the reader rebuilds as [`Object`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DcpClass {
    /// `Metadata`, or megatron-core's `MCoreMetadata` (with `mcore_data`).
    Metadata,
    /// `TensorStorageMetadata(properties, size, chunks)`.
    TensorStorage,
    /// `BytesStorageMetadata` (an object item, e.g. an `_extra_state`).
    BytesStorage,
    /// `ChunkStorageMetadata(offsets, sizes)`.
    Chunk,
    /// `TensorProperties` (its state a tuple: dtype, layout, requires_grad, memory format,
    /// pin_memory).
    TensorProperties,
    /// `MetadataIndex(fqn, offset, index)`.
    MetadataIndex,
    /// `_StorageInfo(relative_path, offset, length)`.
    StorageInfo,
    /// `StorageMeta`.
    StorageMeta,
}

/// The globals the reader understands; anything else is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Global {
    /// `collections.OrderedDict`
    OrderedDict,
    /// `collections.defaultdict` (MindSpeed-LLM's converters save their state dicts as
    /// one), read as a plain dict: only ever called with a container type as its factory,
    /// which is never called.
    DefaultDict,
    /// `builtins.dict` / `builtins.list`, as a defaultdict's factory only.
    ContainerType,
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
    /// A class of a distributed checkpoint's index.
    Dcp(DcpClass),
    /// `torch.Size` (called with a tuple of ints)
    TorchSize,
    /// `torch.serialization._get_layout` (called with the layout's name)
    GetLayout,
    /// `torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING` (an enum, called with its
    /// value)
    MemFormat,
}

fn resolve_global(module: &str, name: &str) -> Option<Global> {
    let storage = |n: &str| {
        STORAGE_CLASSES
            .iter()
            .find(|(c, _)| *c == n)
            .map(|(_, d)| *d)
    };
    let dtype = dtype_of_torch_name;
    Some(match (module, name) {
        ("collections", "OrderedDict") => Global::OrderedDict,
        ("collections", "defaultdict") => Global::DefaultDict,
        ("builtins" | "__builtin__", "dict" | "list") => Global::ContainerType,
        ("torch._utils", "_rebuild_tensor_v2") => Global::RebuildTensorV2,
        ("torch._utils", "_rebuild_parameter") => Global::RebuildParameter,
        ("argparse", "Namespace") => Global::Namespace,
        ("_codecs", "encode") => Global::CodecsEncode,
        ("builtins" | "__builtin__", "bytearray") => Global::ByteArray,
        ("torch", "Size") => Global::TorchSize,
        ("torch.serialization", "_get_layout") => Global::GetLayout,
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING") => Global::MemFormat,
        ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata") => {
            Global::Dcp(DcpClass::Metadata)
        }
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo") => {
            Global::Dcp(DcpClass::StorageInfo)
        }
        ("torch.distributed.checkpoint.metadata", n) => Global::Dcp(match n {
            "Metadata" => DcpClass::Metadata,
            "TensorStorageMetadata" => DcpClass::TensorStorage,
            "BytesStorageMetadata" => DcpClass::BytesStorage,
            "ChunkStorageMetadata" => DcpClass::Chunk,
            "TensorProperties" => DcpClass::TensorProperties,
            "MetadataIndex" => DcpClass::MetadataIndex,
            "StorageMeta" => DcpClass::StorageMeta,
            _ => return None,
        }),
        ("torch", n) => match (storage(n), dtype(n)) {
            (Some(d), _) => Global::StorageClass(d),
            (_, Some(d)) => Global::TorchDType(d),
            _ => return None,
        },
        _ => return None,
    })
}

/// Containers nested deeper than this are refused. `torch.save` state dicts and Megatron
/// checkpoints nest a dozen levels at most; the bound keeps every walk over a [`Value`] that
/// recurses (drop, clone, comparison, the writer in `save.rs`) far from the end of a thread's stack.
pub const MAX_DEPTH: usize = 1000;

/// Elements a tensor shape may describe (its non-zero dimensions multiplied): 2^48, far above
/// any tensor (a 256k × 16k embedding has 2^32).
const MAX_ELEMENTS: u64 = 1 << 48;

/// Memory the parsed objects of any pickle may take (see [`MEMORY_PER_PICKLE_BYTE`]).
pub const MEMORY_FLOOR: usize = 64 << 20;

/// Memory the parsed objects may take per byte of pickle, above [`MEMORY_FLOOR`]. What
/// `torch.save` writes for state dicts and Megatron checkpoints takes 2–3 bytes of objects
/// per byte; a list of small ints takes 16 or more, empty lists 32: such a pickle is refused
/// once its objects outgrow the budget, long before memory runs out (a 40 MB pickle of 20 M
/// ints at 264 MB of objects, under 0.5 GB resident). Copies made by memo fetches have the
/// same budget.
pub const MEMORY_PER_PICKLE_BYTE: usize = 5;

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
    /// Containers nested deeper than [`MAX_DEPTH`].
    #[error(
        "containers nested more than {limit} deep at byte {at} of the pickle; no checkpoint \
         nests that deep, so the file is damaged or hostile (refused before reading it could \
         exhaust the stack)"
    )]
    TooDeep {
        /// Where the limit was crossed.
        at: usize,
        /// The limit.
        limit: usize,
    },
    /// The parsed objects would take more memory than the pickle's budget.
    #[error(
        "the objects of this {pickle_bytes}-byte pickle would take more than {budget} bytes of \
         memory (at byte {at}); a checkpoint's pickle needs a few bytes per byte, so the file is \
         damaged or hostile (refused before it could exhaust memory)"
    )]
    TooLarge {
        /// Where the budget ran out.
        at: usize,
        /// The budget in bytes.
        budget: usize,
        /// The pickle's size.
        pickle_bytes: usize,
    },
}

type Result<T> = std::result::Result<T, PickleError>;

/// The bounds a parse runs under.
#[derive(Debug, Clone, Copy)]
struct Limits {
    depth: usize,
    floor: usize,
    per_byte: usize,
}

const LIMITS: Limits = Limits {
    depth: MAX_DEPTH,
    floor: MEMORY_FLOOR,
    per_byte: MEMORY_PER_PICKLE_BYTE,
};

/// Bytes of one [`Value`] slot (in a container, or on the stack).
const SLOT: usize = size_of::<Value>();

/// A value on the machine's stack or in its memo, with what the bounds need to know of it, kept
/// up to date as it grows so that nothing ever walks it: how deep its containers nest
/// (0 for a scalar, 1 for a container of scalars) and the bytes it holds.
#[derive(Clone)]
struct Obj {
    value: Value,
    depth: usize,
    bytes: usize,
}

impl Obj {
    /// A value with no children: a scalar, an empty container, a tensor, a storage.
    fn leaf(value: Value) -> Obj {
        let heap = match &value {
            Value::Str(s) => s.len(),
            Value::Bytes(b) => b.len(),
            Value::Tensor(t) => {
                size_of::<TensorRef>()
                    + t.storage.key.len()
                    + t.storage.location.len()
                    + 8 * (t.shape.len() + t.stride.len())
            }
            Value::Storage(s) => size_of::<StorageRef>() + s.key.len() + s.location.len(),
            _ => 0,
        };
        let container = matches!(
            value,
            Value::List(_) | Value::Tuple(_) | Value::Dict(_) | Value::Namespace(_)
        ) || matches!(value, Value::Object(_));
        Obj {
            value,
            depth: container as usize,
            bytes: SLOT + heap,
        }
    }
}

/// A container's length, capacity and bytes per element.
fn room(v: &Value) -> (usize, usize, usize) {
    match v {
        Value::List(x) | Value::Tuple(x) => (x.len(), x.capacity(), SLOT),
        Value::Dict(x) => (x.len(), x.capacity(), 2 * SLOT),
        Value::Namespace(x) => (x.len(), x.capacity(), size_of::<(String, Value)>()),
        Value::Object(o) => (
            o.attrs.len(),
            o.attrs.capacity(),
            size_of::<(String, Value)>(),
        ),
        _ => (0, 0, 0),
    }
}

/// Room for `additional` more elements in a container, exactly.
fn reserve(v: &mut Value, additional: usize) {
    match v {
        Value::List(x) | Value::Tuple(x) => x.reserve_exact(additional),
        Value::Dict(x) => x.reserve_exact(additional),
        Value::Namespace(x) => x.reserve_exact(additional),
        Value::Object(o) => o.attrs.reserve_exact(additional),
        _ => {}
    }
}

/// Items on the machine's stack: values, or MARKs.
enum Item {
    Mark,
    Obj(Obj),
}

/// One opcode with its argument, as the stream spells it (CPython's `Lib/pickletools.py`).
#[derive(Debug, Clone, Copy)]
enum Op<'a> {
    Proto(u8),
    Frame,
    Stop,
    Mark,
    Pop,
    PopMark,
    Dup,
    None,
    Bool(bool),
    Int(i64),
    Long(&'a [u8]),
    Float(f64),
    Utf8(&'a [u8]),
    /// SHORT_BINSTRING: a Python 2 `str`, latin-1 by torch's convention.
    Latin1(&'a [u8]),
    Bytes(&'a [u8]),
    EmptyDict,
    EmptyList,
    EmptyTuple,
    Tuple,
    TupleN(usize),
    Append,
    Appends,
    SetItem,
    SetItems,
    Put(u32),
    Memoize,
    Get(u32),
    Global(&'a str, &'a str),
    StackGlobal,
    Call,
    Build,
    PersId,
}

/// The opcode stream: every length read from it is checked against the bytes left.
struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
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

    /// The next opcode and its argument, with the opcode's position.
    fn next(&mut self) -> Result<(usize, Op<'a>)> {
        let at = self.pos;
        let code = self.u8()?;
        let op = match code {
            0x80 => Op::Proto(self.u8()?),
            0x95 => {
                self.take(8)?; // FRAME: a length hint only
                Op::Frame
            }
            b'.' => Op::Stop,
            b'(' => Op::Mark,
            b'0' => Op::Pop,
            b'1' => Op::PopMark,
            b'2' => Op::Dup,
            b'N' => Op::None,
            0x88 => Op::Bool(true),
            0x89 => Op::Bool(false),
            b'J' => Op::Int(i32::from_le_bytes(self.le()?) as i64),
            b'K' => Op::Int(self.u8()? as i64),
            b'M' => Op::Int(u16::from_le_bytes(self.le()?) as i64),
            0x8a => {
                let n = self.u8()? as usize;
                Op::Long(self.take(n)?)
            }
            0x8b => {
                let n = self.len_u32()?;
                Op::Long(self.take(n)?)
            }
            b'G' => Op::Float(f64::from_be_bytes(self.le()?)),
            b'X' => {
                let n = self.len_u32()?;
                Op::Utf8(self.take(n)?)
            }
            0x8c => {
                let n = self.u8()? as usize;
                Op::Utf8(self.take(n)?)
            }
            0x8d => {
                let n = self.len_u64()?;
                Op::Utf8(self.take(n)?)
            }
            b'U' => {
                let n = self.u8()? as usize;
                Op::Latin1(self.take(n)?)
            }
            b'C' => {
                let n = self.u8()? as usize;
                Op::Bytes(self.take(n)?)
            }
            b'B' => {
                let n = self.len_u32()?;
                Op::Bytes(self.take(n)?)
            }
            0x8e | 0x96 => {
                let n = self.len_u64()?;
                Op::Bytes(self.take(n)?)
            }
            b'}' => Op::EmptyDict,
            b']' => Op::EmptyList,
            b')' => Op::EmptyTuple,
            b't' => Op::Tuple,
            0x85..=0x87 => Op::TupleN((code - 0x84) as usize),
            b'a' => Op::Append,
            b'e' => Op::Appends,
            b's' => Op::SetItem,
            b'u' => Op::SetItems,
            b'q' => Op::Put(self.u8()? as u32),
            b'r' => Op::Put(u32::from_le_bytes(self.le()?)),
            0x94 => Op::Memoize,
            b'h' => Op::Get(self.u8()? as u32),
            b'j' => Op::Get(u32::from_le_bytes(self.le()?)),
            b'c' => {
                let module = self.line()?;
                let name = self.line()?;
                Op::Global(module, name)
            }
            0x93 => Op::StackGlobal,
            b'R' | 0x81 => Op::Call,
            b'b' => Op::Build,
            b'Q' => Op::PersId,
            opcode => return Err(PickleError::UnsupportedOpcode { opcode, at }),
        };
        Ok((at, op))
    }
}

/// The memo indices the pickle ever fetches. Only those are copied into the memo: `torch.save`
/// memoizes every object it writes and fetches few of them again, so copying all would
/// double the memory a checkpoint takes. The scan stops where the stream stops decoding
/// (the run then reports the error in its place).
fn fetched_memo_indices(data: &[u8]) -> HashSet<u32> {
    let mut reader = Reader { data, pos: 0 };
    let mut fetched = HashSet::new();
    while let Ok((_, op)) = reader.next() {
        match op {
            Op::Get(i) => {
                fetched.insert(i);
            }
            Op::Stop => break,
            _ => {}
        }
    }
    fetched
}

/// Which memo indices were stored, for MEMOIZE (whose index is the memo's size): indices
/// stored in order (what picklers write) take no memory; only others are kept in a set.
#[derive(Default)]
struct MemoIndices {
    /// Every index below it was stored.
    dense: u64,
    /// Indices stored at or above `dense`.
    sparse: HashSet<u32>,
}

impl MemoIndices {
    fn len(&self) -> usize {
        self.dense as usize + self.sparse.len()
    }

    /// Record index `i`; true when it is new and kept in the set.
    fn insert(&mut self, i: u32) -> bool {
        match u64::from(i).cmp(&self.dense) {
            std::cmp::Ordering::Less => false,
            std::cmp::Ordering::Greater => self.sparse.insert(i),
            std::cmp::Ordering::Equal => {
                self.dense += 1;
                while u32::try_from(self.dense).is_ok_and(|d| self.sparse.remove(&d)) {
                    self.dense += 1;
                }
                false
            }
        }
    }
}

/// Bytes a memo index kept in a set takes (with the set's spare room).
const SET_ENTRY: usize = 16;

struct Machine<'a> {
    reader: Reader<'a>,
    stack: Vec<Item>,
    /// Memo indices fetched somewhere in the stream (see [`fetched_memo_indices`]).
    fetched: HashSet<u32>,
    memo: HashMap<u32, Obj>,
    stored: MemoIndices,
    limits: Limits,
    /// Bytes held by the stack and the memo now.
    live: usize,
    /// Bytes copied by memo fetches and DUPs so far (a copy is work even when it is dropped).
    copied: usize,
}

/// Parse one pickle (up to STOP) from `data`, within [`MAX_DEPTH`] and the memory budget
/// ([`MEMORY_FLOOR`] + [`MEMORY_PER_PICKLE_BYTE`] per byte of `data`).
pub fn parse(data: &[u8]) -> Result<Value> {
    parse_within(data, LIMITS)
}

fn parse_within(data: &[u8], limits: Limits) -> Result<Value> {
    let fetched = fetched_memo_indices(data);
    let mut m = Machine {
        reader: Reader { data, pos: 0 },
        live: fetched.len() * SET_ENTRY,
        fetched,
        stack: Vec::new(),
        memo: HashMap::new(),
        stored: MemoIndices::default(),
        limits,
        copied: 0,
    };
    m.check_budget()?;
    let mut root = m.run()?;
    dedupe_keys(&mut root);
    Ok(root)
}

impl Machine<'_> {
    fn bad<T>(&self, what: impl Into<String>) -> Result<T> {
        self.reader.bad(what)
    }

    fn budget(&self) -> usize {
        let per_byte = (self.limits.per_byte).saturating_mul(self.reader.data.len());
        self.limits.floor.saturating_add(per_byte)
    }

    /// Refuse once what is held (values, the stack's and the memo's room), or what was
    /// copied, outgrows the budget.
    fn check_budget(&self) -> Result<()> {
        self.check_budget_with(0)
    }

    /// [`Machine::check_budget`] with `more` bytes about to be taken.
    fn check_budget_with(&self, more: usize) -> Result<()> {
        let budget = self.budget();
        let room = self.stack.capacity() * size_of::<Item>()
            + self.memo.capacity() * size_of::<(u32, Obj)>();
        if self.live + room + more > budget || self.copied > budget {
            return Err(PickleError::TooLarge {
                at: self.reader.pos,
                budget,
                pickle_bytes: self.reader.data.len(),
            });
        }
        Ok(())
    }

    fn check_depth(&self, depth: usize) -> Result<()> {
        if depth > self.limits.depth {
            return Err(PickleError::TooDeep {
                at: self.reader.pos,
                limit: self.limits.depth,
            });
        }
        Ok(())
    }

    fn push_obj(&mut self, obj: Obj) -> Result<()> {
        self.live += obj.bytes;
        self.push_item(Item::Obj(obj))?;
        self.check_budget()
    }

    /// Push onto the stack, doubling it here when full, once the budget allows the new room
    /// (so that a growth past the budget is never taken).
    fn push_item(&mut self, item: Item) -> Result<()> {
        if self.stack.len() == self.stack.capacity() {
            let more = self.stack.capacity().max(16);
            self.check_budget_with(more * size_of::<Item>())?;
            self.stack.reserve_exact(more);
        }
        self.stack.push(item);
        Ok(())
    }

    fn push(&mut self, v: Value) -> Result<()> {
        self.push_obj(Obj::leaf(v))
    }

    fn pop(&mut self) -> Result<Obj> {
        match self.stack.pop() {
            Some(Item::Obj(o)) => {
                self.live -= o.bytes;
                Ok(o)
            }
            Some(Item::Mark) => self.bad("unexpected MARK"),
            None => self.bad("stack underflow"),
        }
    }

    fn top(&mut self) -> Result<&mut Obj> {
        match self.stack.last_mut() {
            Some(Item::Obj(o)) => Ok(o),
            _ => self.reader.bad("no value on the stack"),
        }
    }

    /// Everything above the topmost MARK (which is removed).
    fn pop_mark(&mut self) -> Result<Vec<Obj>> {
        let Some(mark) = self.stack.iter().rposition(|i| matches!(i, Item::Mark)) else {
            return self.bad("no MARK");
        };
        let items = self.stack.split_off(mark + 1);
        self.stack.pop();
        let objs: Vec<Obj> = items
            .into_iter()
            .map(|i| match i {
                Item::Obj(o) => o,
                Item::Mark => unreachable!("rposition found the topmost mark"),
            })
            .collect();
        self.live -= objs.iter().map(|o| o.bytes).sum::<usize>();
        Ok(objs)
    }

    /// Move `children` (already off the stack) into the container on top of the stack with
    /// `insert`, which adds `extra` elements: their bytes, the container's new capacity and
    /// its new depth are counted, and the budget checked before the container grows (it
    /// doubles, as `Vec` does, but here, so that a growth past the budget is never taken).
    fn adopt(
        &mut self,
        children: Vec<Obj>,
        extra: usize,
        insert: impl FnOnce(&mut Value, Vec<Value>),
    ) -> Result<()> {
        let bytes: usize = children.iter().map(|o| o.bytes).sum();
        let deepest = children.iter().map(|o| o.depth).max().unwrap_or(0);
        let (len, cap, elem) = room(&self.top()?.value);
        let wanted = len + extra;
        let new_cap = if wanted <= cap {
            cap
        } else {
            wanted.max(cap.saturating_mul(2))
        };
        let spare_before = (cap - len) * elem;
        let grown = bytes + (new_cap - wanted) * elem;
        // `live` and the container's bytes include `spare_before`: no underflow.
        self.live = self.live + grown - spare_before;
        self.check_budget()?;
        let top = self.top()?;
        reserve(&mut top.value, new_cap - len);
        insert(
            &mut top.value,
            children.into_iter().map(|o| o.value).collect(),
        );
        top.bytes = top.bytes + grown - spare_before;
        top.depth = top.depth.max(deepest + 1);
        let depth = top.depth;
        self.check_depth(depth)
    }

    /// A tuple of `items` (already off the stack), pushed.
    fn push_tuple(&mut self, items: Vec<Obj>) -> Result<()> {
        let depth = 1 + items.iter().map(|o| o.depth).max().unwrap_or(0);
        self.check_depth(depth)?;
        let bytes = SLOT + items.iter().map(|o| o.bytes).sum::<usize>();
        let value = Value::Tuple(items.into_iter().map(|o| o.value).collect());
        self.push_obj(Obj {
            value,
            depth,
            bytes,
        })
    }

    /// Charge a copy of `bytes` (memo store and fetch, DUP) before making it.
    fn charge_copy(&mut self, bytes: usize) -> Result<()> {
        self.copied = self.copied.saturating_add(bytes);
        self.check_budget()
    }

    fn global(&self, module: &str, name: &str) -> Result<Value> {
        match resolve_global(module, name) {
            Some(Global::TorchDType(d)) => Ok(Value::TorchDType(d)),
            Some(g) => Ok(Value::Global(g)),
            None => Err(PickleError::ForbiddenGlobal(format!("{module}.{name}"))),
        }
    }

    fn memo_get(&mut self, i: u32) -> Result<()> {
        let Some(bytes) = self.memo.get(&i).map(|v| v.bytes) else {
            return self.bad(format!("memo {i} is not set"));
        };
        self.charge_copy(bytes)?;
        let v = self.memo[&i].clone();
        self.push_obj(v)
    }

    /// Store the top of the stack as memo `i` (a copy only when some opcode fetches it).
    fn memo_put(&mut self, i: u32) -> Result<()> {
        let bytes = self.top()?.bytes;
        if self.stored.insert(i) {
            self.live += SET_ENTRY;
        }
        if self.fetched.contains(&i) {
            self.charge_copy(bytes)?;
            let v = self.top()?.clone();
            self.live += v.bytes;
            if let Some(old) = self.memo.insert(i, v) {
                self.live -= old.bytes;
            }
        }
        self.check_budget()
    }

    fn run(&mut self) -> Result<Value> {
        loop {
            let (at, op) = self.reader.next()?;
            match op {
                Op::Proto(proto) => {
                    if !(2..=5).contains(&proto) {
                        return self.bad(format!("protocol {proto} (2 to 5 supported)"));
                    }
                }
                Op::Frame => {}
                Op::Stop => return Ok(self.pop()?.value),
                Op::Mark => self.push_item(Item::Mark)?,
                Op::Pop => {
                    if let Some(Item::Obj(o)) = self.stack.pop() {
                        self.live -= o.bytes;
                    }
                }
                Op::PopMark => {
                    self.pop_mark()?;
                }
                Op::Dup => {
                    let bytes = self.top()?.bytes;
                    self.charge_copy(bytes)?;
                    let v = self.top()?.clone();
                    self.push_obj(v)?;
                }
                Op::Put(i) => self.memo_put(i)?,
                Op::Memoize => {
                    let i = u32::try_from(self.stored.len())
                        .or_else(|_| self.bad("more than 2^32 memo entries"))?;
                    self.memo_put(i)?;
                }
                Op::Get(i) => self.memo_get(i)?,
                _ => self.build_value(op, at)?,
            }
        }
    }

    /// The opcodes that make or combine values.
    fn build_value(&mut self, op: Op, at: usize) -> Result<()> {
        match op {
            Op::None => self.push(Value::None),
            Op::Bool(b) => self.push(Value::Bool(b)),
            Op::Int(i) => self.push(Value::Int(i)),
            Op::Long(bytes) => {
                let v = self.long(bytes)?;
                self.push(v)
            }
            Op::Float(f) => self.push(Value::Float(f)),
            Op::Utf8(bytes) => match std::str::from_utf8(bytes) {
                Ok(s) => self.push(Value::Str(s.to_owned())),
                Err(_) => self.bad("string is not utf-8"),
            },
            Op::Latin1(bytes) => self.push(Value::Str(bytes.iter().map(|&b| b as char).collect())),
            Op::Bytes(bytes) => self.push(Value::Bytes(bytes.to_vec())),
            Op::EmptyDict => self.push(Value::Dict(Vec::new())),
            Op::EmptyList => self.push(Value::List(Vec::new())),
            Op::EmptyTuple => self.push(Value::Tuple(Vec::new())),
            Op::Tuple => {
                let items = self.pop_mark()?;
                self.push_tuple(items)
            }
            Op::TupleN(n) => {
                if self.stack.len() < n {
                    return self.bad("stack underflow");
                }
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.pop()?);
                }
                items.reverse();
                self.push_tuple(items)
            }
            Op::Append => {
                let v = self.pop()?;
                self.extend_list(vec![v])
            }
            Op::Appends => {
                let items = self.pop_mark()?;
                self.extend_list(items)
            }
            Op::SetItem => {
                let v = self.pop()?;
                let k = self.pop()?;
                self.set_items(vec![k, v])
            }
            Op::SetItems => {
                let items = self.pop_mark()?;
                self.set_items(items)
            }
            _ => self.call_like(op, at),
        }
    }

    /// Globals, calls, BUILD and persistent ids.
    fn call_like(&mut self, op: Op, at: usize) -> Result<()> {
        match op {
            Op::Global(module, name) => {
                let g = self.global(module, name)?;
                self.push(g)
            }
            Op::StackGlobal => {
                let name = self.pop()?.value;
                let module = self.pop()?.value;
                let (Value::Str(module), Value::Str(name)) = (module, name) else {
                    return self.bad("STACK_GLOBAL needs two strings");
                };
                let g = self.global(&module, &name)?;
                self.push(g)
            }
            Op::Call => {
                let args = self.pop()?.value;
                let func = self.pop()?.value;
                let v = self.call(func, args)?;
                self.push(v)
            }
            Op::Build => {
                let state = self.pop()?;
                self.build(state)
            }
            Op::PersId => {
                let pid = self.pop()?.value;
                let v = self.persistent(pid)?;
                self.push(v)
            }
            _ => unreachable!("run and build_value handle {op:?} at byte {at}"),
        }
    }

    /// LONG1/LONG4: little-endian two's complement; must fit in i64.
    fn long(&self, bytes: &[u8]) -> Result<Value> {
        let n = bytes.len();
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

    fn extend_list(&mut self, items: Vec<Obj>) -> Result<()> {
        if !matches!(self.top()?.value, Value::List(_)) {
            return self.bad("APPEND to a non-list");
        }
        let extra = items.len();
        self.adopt(items, extra, |list, items| {
            if let Value::List(list) = list {
                list.extend(items);
            }
        })
    }

    /// SETITEM(S): pairs appended in order; a repeated key is resolved once parsing ends
    /// ([`dedupe_keys`]), so that a large dict costs no comparison per insertion.
    fn set_items(&mut self, items: Vec<Obj>) -> Result<()> {
        if !items.len().is_multiple_of(2) {
            return self.bad("SETITEMS with an odd number of items");
        }
        if !matches!(self.top()?.value, Value::Dict(_)) {
            return self.bad("SETITEM on a non-dict");
        }
        let unhashable = |o: &Obj| {
            matches!(
                o.value,
                Value::List(_) | Value::Dict(_) | Value::Namespace(_)
            )
        };
        if items.iter().step_by(2).any(unhashable) {
            return self.bad("a list, dict or Namespace as a dict key (unhashable in Python)");
        }
        let extra = items.len() / 2;
        self.adopt(items, extra, |dict, items| {
            if let Value::Dict(dict) = dict {
                let mut it = items.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    dict.push((k, v));
                }
            }
        })
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
            (Global::DefaultDict, [] | [Value::None | Value::Global(Global::ContainerType)]) => {
                Ok(Value::Dict(Vec::new()))
            }
            (Global::Namespace, []) => Ok(Value::Namespace(Vec::new())),
            (Global::RebuildTensorV2, [storage, offset, size, stride, _grad, _hooks, ..]) => {
                let Value::Storage(storage) = storage else {
                    return self.bad("_rebuild_tensor_v2 without a storage");
                };
                let tensor = TensorRef {
                    storage: (**storage).clone(),
                    offset: self.uint(offset)?,
                    shape: self.uints(size)?,
                    stride: self.uints(stride)?,
                };
                if tensor.shape.len() != tensor.stride.len() {
                    return self.bad("tensor shape and stride differ in rank");
                }
                // A tensor's bytes lie in the file, but a zero dimension empties it whatever the
                // others say: bound them all, so that no size computed from a shape overflows.
                let elements = (tensor.shape.iter().filter(|&&n| n != 0))
                    .try_fold(1u64, |acc, &n| {
                        acc.checked_mul(n).filter(|&p| p <= MAX_ELEMENTS)
                    });
                if elements.is_none() {
                    return self.bad(format!(
                        "tensor shape {:?} has more than 2^48 elements",
                        tensor.shape
                    ));
                }
                Ok(Value::Tensor(Box::new(tensor)))
            }
            (Global::RebuildParameter, [tensor @ Value::Tensor(_), ..]) => Ok(tensor.clone()),
            (Global::CodecsEncode, [Value::Str(s), Value::Str(enc)]) if enc == "latin1" => {
                match s.chars().map(|c| u8::try_from(c as u32)).collect() {
                    Ok(bytes) => Ok(Value::Bytes(bytes)),
                    Err(_) => self.bad("latin1 bytes out of range"),
                }
            }
            (Global::ByteArray, [Value::Bytes(b)]) => Ok(Value::Bytes(b.clone())),
            (Global::Dcp(class), []) => Ok(Value::Object(Box::new(Object {
                class,
                attrs: Vec::new(),
            }))),
            (Global::TorchSize, [dims @ Value::Tuple(_)]) => {
                self.uints(dims)?;
                Ok(dims.clone())
            }
            (Global::GetLayout, [Value::Str(name)]) => Ok(Value::Str(name.clone())),
            (Global::MemFormat, [Value::Int(i)]) => Ok(Value::Int(*i)),
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

    fn build(&mut self, state: Obj) -> Result<()> {
        match (&self.top()?.value, &state.value) {
            (Value::Namespace(_) | Value::Object(_), Value::Dict(items)) => {
                if !items.iter().all(|(k, _)| matches!(k, Value::Str(_))) {
                    return self.bad("attribute name is not a string");
                }
            }
            // `__setstate__` with a tuple (TensorProperties)
            (Value::Object(_), Value::Tuple(_)) => {}
            // OrderedDict state (e.g. a module state_dict's `_metadata`) carries no tensors.
            (Value::Dict(_), _) => return Ok(()),
            _ => return self.bad("BUILD on an object that takes no state"),
        }
        let extra = match &state.value {
            Value::Dict(items) => items.len(),
            _ => 1,
        };
        self.adopt(vec![state], extra, |obj, mut state| {
            let attrs = match obj {
                Value::Namespace(attrs) => attrs,
                Value::Object(o) => &mut o.attrs,
                _ => return,
            };
            match &mut state[..] {
                [Value::Dict(items)] => {
                    for (k, v) in items.drain(..) {
                        if let Value::Str(k) = k {
                            attrs.push((k, v));
                        }
                    }
                }
                [tuple @ Value::Tuple(_)] => {
                    attrs.push((Object::STATE.into(), std::mem::replace(tuple, Value::None)))
                }
                _ => {}
            }
        })
    }

    fn persistent(&self, pid: Value) -> Result<Value> {
        let Value::Tuple(items) = pid else {
            return self.bad("persistent id is not a tuple");
        };
        match items.as_slice() {
            [Value::Str(tag), Value::Global(Global::StorageClass(dtype)), Value::Str(key), Value::Str(location), numel]
                if tag == "storage" =>
            {
                Ok(Value::Storage(Box::new(StorageRef {
                    key: key.clone(),
                    dtype: *dtype,
                    location: location.clone(),
                    numel: self.uint(numel)?,
                })))
            }
            _ => self.bad("persistent id is not ('storage', torch.XStorage, key, location, numel)"),
        }
    }
}

/// Python's dict semantics for a key assigned twice: the first position, the last value.
/// One pass over the parsed tree (an explicit stack, no recursion over its depth); keys are
/// found by hash, so a large dict costs no comparison per insertion. Keys are equal as
/// values, floats by their bits.
fn dedupe_keys(root: &mut Value) {
    let state = std::collections::hash_map::RandomState::new();
    let mut todo: Vec<&mut Value> = vec![root];
    while let Some(v) = todo.pop() {
        match v {
            Value::Dict(items) => {
                dedupe(items, |k| state.hash_one(KeyHash(k)), same_key);
                for (k, v) in items.iter_mut() {
                    todo.push(k);
                    todo.push(v);
                }
            }
            Value::Namespace(attrs) => {
                dedupe(attrs, |k| state.hash_one(k), |a, b| a == b);
                todo.extend(attrs.iter_mut().map(|(_, v)| v));
            }
            Value::Object(o) => {
                dedupe(&mut o.attrs, |k| state.hash_one(k), |a, b| a == b);
                todo.extend(o.attrs.iter_mut().map(|(_, v)| v));
            }
            Value::List(items) | Value::Tuple(items) => todo.extend(items.iter_mut()),
            _ => {}
        }
    }
}

/// Keep the first position of each key with the value of its last occurrence.
fn dedupe<K>(items: &mut Vec<(K, Value)>, hash: impl Fn(&K) -> u64, same: impl Fn(&K, &K) -> bool) {
    if items.len() < 2 {
        return;
    }
    // first[i]: the index of the first item with item i's key.
    let mut first = Vec::with_capacity(items.len());
    let mut by_hash: HashMap<u64, usize> = HashMap::new();
    // Items whose hash another key had first (a 64-bit collision: practically never).
    let mut collided: Vec<usize> = Vec::new();
    for (i, (k, _)) in items.iter().enumerate() {
        let f = match by_hash.get(&hash(k)) {
            None => {
                by_hash.insert(hash(k), i);
                i
            }
            Some(&j) if same(&items[j].0, k) => j,
            Some(_) => match collided.iter().find(|&&j| same(&items[j].0, k)) {
                Some(&j) => j,
                None => {
                    collided.push(i);
                    i
                }
            },
        };
        first.push(f);
    }
    if first.iter().enumerate().all(|(i, &f)| i == f) {
        return;
    }
    let mut slots: Vec<Option<(K, Value)>> = std::mem::take(items).into_iter().map(Some).collect();
    for (i, &f) in first.iter().enumerate() {
        if f != i {
            let (_, v) = slots[i].take().expect("each item moves once");
            if let Some(slot) = slots[f].as_mut() {
                slot.1 = v;
            }
        }
    }
    items.extend(slots.into_iter().flatten());
}

/// A dict key hashed as [`same_key`] compares it (depth bounded by [`MAX_DEPTH`]).
struct KeyHash<'a>(&'a Value);

impl std::hash::Hash for KeyHash<'_> {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        std::mem::discriminant(self.0).hash(h);
        match self.0 {
            Value::Bool(b) => b.hash(h),
            Value::Int(i) => i.hash(h),
            Value::Float(f) => f.to_bits().hash(h),
            Value::Str(s) => s.hash(h),
            Value::Bytes(b) => b.hash(h),
            Value::List(x) | Value::Tuple(x) => {
                x.len().hash(h);
                x.iter().for_each(|v| KeyHash(v).hash(h));
            }
            Value::TorchDType(d) => d.hash(h),
            Value::Global(g) => g.hash(h),
            Value::Tensor(t) => (&t.storage.key, t.offset, &t.shape).hash(h),
            Value::Storage(s) => s.key.hash(h),
            // a frozen dataclass (MetadataIndex) as a key
            Value::Object(o) => {
                o.class.hash(h);
                for (k, v) in &o.attrs {
                    k.hash(h);
                    KeyHash(v).hash(h);
                }
            }
            // None; dicts and Namespaces are refused as keys (SETITEM).
            _ => {}
        }
    }
}

/// Keys equal as values, floats by their bits (so a NaN key matches itself).
fn same_key(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Float(x), Value::Float(y)) => x.to_bits() == y.to_bits(),
        (Value::List(x), Value::List(y)) | (Value::Tuple(x), Value::Tuple(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same_key(a, b))
        }
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exact stream torch writes for `{'w': bf16 tensor [4, 8]}` (docs/checkpoints.md §4.3).
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
    fn reads_a_defaultdict_as_a_dict_and_never_calls_its_factory() {
        // pickle.dumps(defaultdict(dict, a=1), protocol=4), as MindSpeed-LLM's converters save
        let p = b"\x80\x04\x95>\x00\x00\x00\x00\x00\x00\x00\x8c\x0bcollections\x94\x8c\x0bdefaultdict\x94\x93\x94\x8c\x08builtins\x94\x8c\x04dict\x94\x93\x94\x85\x94R\x94\x8c\x01a\x94K\x01s.";
        assert_eq!(
            parse(p).unwrap(),
            Value::Dict(vec![(Value::Str("a".into()), Value::Int(1))])
        );
        // the factory is never called, nor a defaultdict of another one built
        let e = parse(b"\x80\x04\x8c\x08builtins\x8c\x04dict\x93)R.").unwrap_err();
        assert!(e.to_string().contains("call"), "{e}");
        let p = b"\x80\x04\x8c\x0bcollections\x8c\x0bdefaultdict\x93K\x01\x85R.";
        assert!(parse(p).is_err());
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

    /// `bf16_state_dict()` with `["nest"] = [[[…]]]`, `lists` lists deep, beside the tensor.
    fn with_nested_lists(lists: usize) -> Vec<u8> {
        let mut p = bf16_state_dict();
        p.pop(); // STOP
        p.extend_from_slice(b"X\x04\x00\x00\x00nest");
        p.extend(std::iter::repeat_n(b']', lists));
        p.extend(std::iter::repeat_n(b'a', lists - 1));
        p.extend_from_slice(b"s.");
        p
    }

    #[test]
    fn nesting_is_bounded() {
        for p in [
            with_nested_lists(200_000),
            with_nested_lists(MAX_DEPTH),
            [&b"\x80\x02)"[..], &[0x85; 200_000], b"."].concat(),
        ] {
            let e = parse(&p).unwrap_err();
            assert!(
                matches!(
                    e,
                    PickleError::TooDeep {
                        limit: MAX_DEPTH,
                        ..
                    }
                ),
                "{e}"
            );
            assert!(e.to_string().contains("nested more than 1000 deep"), "{e}");
        }
        // At the limit (the dict holds the lists) the value parses, and what walks it
        // recursively (clone, comparison, Debug, the writer, drop) fits a thread's default stack.
        let at_limit = with_nested_lists(MAX_DEPTH - 1);
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                let v = parse(&at_limit).unwrap();
                let copy = v.clone();
                assert_eq!(copy, v);
                assert!(format!("{v:?}").len() > 2 * MAX_DEPTH);
                let dir = tempfile::tempdir().unwrap();
                let Some(Value::List(nest)) = v.get("nest") else {
                    panic!("no nest")
                };
                let only_nest =
                    Value::Dict(vec![(Value::Str("nest".into()), Value::List(nest.clone()))]);
                let path = dir.path().join("nest.pt");
                crate::ckpt::torch::save::PtWriter::create(&path, &only_nest, false)
                    .unwrap()
                    .finish()
                    .unwrap();
                let back = crate::ckpt::torch::TorchFile::open(&path).unwrap();
                assert_eq!(back.root(), &only_nest);
            })
            .unwrap()
            .join()
            .unwrap();
    }

    #[test]
    fn memory_is_budgeted() {
        // The 40 MB pickle of 20 M ints (2 bytes each), scaled down 40 times with the floor.
        let limits = Limits {
            floor: MEMORY_FLOOR / 40,
            ..LIMITS
        };
        let bomb = [&b"\x80\x02]("[..], &b"K\x01".repeat(500_000), b"e."].concat();
        assert_eq!(bomb.len(), 1_000_006);
        let e = parse_within(&bomb, limits).unwrap_err();
        assert!(matches!(e, PickleError::TooLarge { .. }), "{e}");
        assert!(e.to_string().contains("would take more than"), "{e}");
        // The same ints in batches of 1000, as pickle writes lists.
        let batched = [
            &b"\x80\x02]"[..],
            &[&b"("[..], &b"K\x01".repeat(1000), b"e"]
                .concat()
                .repeat(500),
            b".",
        ]
        .concat();
        assert!(matches!(
            parse_within(&batched, limits),
            Err(PickleError::TooLarge { .. })
        ));
        // A list fetched from the memo over and over: copies have the same budget.
        let fetches = [
            &b"\x80\x02]("[..],
            &b"K\x01".repeat(1000),
            b"eq\x000",
            &b"h\x000".repeat(100_000),
            b"N.",
        ]
        .concat();
        assert!(matches!(parse(&fetches), Err(PickleError::TooLarge { .. })));
        // What torch writes parses within the scaled budget.
        assert!(parse_within(&bf16_state_dict(), limits).is_ok());
    }

    #[test]
    fn a_shape_past_2_48_elements_is_refused() {
        // `{'w': tensor}` of shape (2^40, 2^40, 0): empty, but 2^80 elements by its other
        // dimensions (multiplying them overflowed).
        let long = |v: u64| [&b"\x8a\x08"[..], &v.to_le_bytes()].concat();
        let shape = [long(1 << 40), long(1 << 40), long(0)].concat();
        let mut p = bf16_state_dict();
        let at = p.windows(6).position(|w| w == b"K\x04K\x08\x86q").unwrap();
        p.splice(at..at + 5, [&b"("[..], &shape, b"t"].concat());
        let at = p.windows(5).position(|w| w == b"K\x08K\x01\x86").unwrap();
        p.splice(at..at + 5, b"(K\x00K\x00K\x01t".iter().copied());
        let e = parse(&p).unwrap_err().to_string();
        assert!(e.contains("has more than 2^48 elements"), "{e}");
    }

    #[test]
    fn a_repeated_key_keeps_its_first_position_and_last_value() {
        // {'a': 1, 'b': 2, 'a': 3} as SETITEMS, then ('k', 4) by SETITEM.
        let p = b"\x80\x02}(X\x01\x00\x00\x00aK\x01X\x01\x00\x00\x00bK\x02X\x01\x00\x00\x00aK\x03uX\x01\x00\x00\x00kK\x04s.";
        let v = parse(p).unwrap();
        let s = |k: &str| Value::Str(k.into());
        assert_eq!(
            v,
            Value::Dict(vec![
                (s("a"), Value::Int(3)),
                (s("b"), Value::Int(2)),
                (s("k"), Value::Int(4))
            ])
        );
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
