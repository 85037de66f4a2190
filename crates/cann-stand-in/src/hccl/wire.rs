//! What a rank and the hub say over their Unix-domain socket: frames of a little-endian `u32`
//! length and a body, the body a tag byte and fixed-width little-endian fields (byte strings
//! length-prefixed). A rank makes one request at a time and waits for its reply, except for
//! the requests that carry no reply ([`Request::answered`]).

use hccl_sys::{HcclDataType, HcclReduceOp, HcclResult};
use std::io::{self, Read, Write};

/// The collectives, each a call every rank makes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
}

impl Kind {
    const ALL: [Kind; 4] = [
        Kind::AllReduce,
        Kind::AllGather,
        Kind::ReduceScatter,
        Kind::Broadcast,
    ];

    /// The HCCL function's name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "HcclAllReduce",
            Kind::AllGather => "HcclAllGather",
            Kind::ReduceScatter => "HcclReduceScatter",
            Kind::Broadcast => "HcclBroadcast",
        }
    }
}

/// A rank's collective call as it made it: what every rank must agree on. `count` is the
/// function's own count argument; `op` and `root` are 0 where the kind has none.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Call {
    pub kind: Kind,
    /// The communicator's sequence number of the call (0, 1, … per rank).
    pub seq: u64,
    pub count: u64,
    pub dtype: HcclDataType,
    pub op: HcclReduceOp,
    pub root: u32,
}

/// A rank's bytes for a call, or why the rank failed it before sending any (so the others fail
/// at once instead of waiting for it).
pub(crate) type Data = Result<Vec<u8>, String>;

pub(crate) enum Request {
    /// Join as `rank` of `size`, waiting at most `timeout_ms` for the others.
    Join {
        size: u32,
        rank: u32,
        timeout_ms: u64,
    },
    Collective {
        call: Call,
        timeout_ms: u64,
        data: Data,
    },
    Send {
        to: u32,
        count: u64,
        dtype: HcclDataType,
        data: Data,
    },
    Recv {
        from: u32,
        count: u64,
        dtype: HcclDataType,
        timeout_ms: u64,
    },
    /// The communicator is destroyed (a closed connection without it is a rank that died).
    Leave,
}

impl Request {
    /// Whether the hub replies: not to a rank that leaves or already failed its call.
    pub(crate) fn answered(&self) -> bool {
        match self {
            Request::Collective { data, .. } | Request::Send { data, .. } => data.is_ok(),
            Request::Leave => false,
            Request::Join { .. } | Request::Recv { .. } => true,
        }
    }
}

pub(crate) enum Reply {
    /// The bytes this rank receives (empty for a join or a send).
    Done(Vec<u8>),
    Failed(HcclResult, String),
}

/// A frame body being written.
#[derive(Default)]
struct Body(Vec<u8>);

impl Body {
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn i32(self, v: i32) -> Self {
        self.u32(v as u32)
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn bytes(mut self, v: &[u8]) -> Self {
        self.0.extend((v.len() as u64).to_le_bytes());
        self.0.extend(v);
        self
    }
    fn data(self, data: &Data) -> Self {
        match data {
            Ok(bytes) => self.u8(0).bytes(bytes),
            Err(why) => self.u8(1).bytes(why.as_bytes()),
        }
    }
    fn call(self, c: &Call) -> Self {
        let kind = Kind::ALL.iter().position(|&k| k == c.kind).expect("a kind");
        self.u8(kind as u8)
            .u64(c.seq)
            .u64(c.count)
            .i32(c.dtype)
            .i32(c.op)
            .u32(c.root)
    }
}

/// A frame body being read.
struct Fields<'a>(&'a [u8]);

fn malformed() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "malformed HCCL stand-in frame")
}

impl Fields<'_> {
    fn take<const N: usize>(&mut self) -> io::Result<[u8; N]> {
        let (head, rest) = self.0.split_at_checked(N).ok_or_else(malformed)?;
        self.0 = rest;
        Ok(head.try_into().expect("N bytes"))
    }
    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take::<1>()?[0])
    }
    fn u32(&mut self) -> io::Result<u32> {
        self.take().map(u32::from_le_bytes)
    }
    fn i32(&mut self) -> io::Result<i32> {
        self.take().map(i32::from_le_bytes)
    }
    fn u64(&mut self) -> io::Result<u64> {
        self.take().map(u64::from_le_bytes)
    }
    fn bytes(&mut self) -> io::Result<Vec<u8>> {
        let len = usize::try_from(self.u64()?).map_err(|_| malformed())?;
        let (head, rest) = self.0.split_at_checked(len).ok_or_else(malformed)?;
        self.0 = rest;
        Ok(head.to_vec())
    }
    fn text(&mut self) -> io::Result<String> {
        Ok(String::from_utf8_lossy(&self.bytes()?).into_owned())
    }
    fn data(&mut self) -> io::Result<Data> {
        Ok(match self.u8()? {
            0 => Ok(self.bytes()?),
            _ => Err(self.text()?),
        })
    }
    fn call(&mut self) -> io::Result<Call> {
        let kind = *Kind::ALL
            .get(usize::from(self.u8()?))
            .ok_or_else(malformed)?;
        Ok(Call {
            kind,
            seq: self.u64()?,
            count: self.u64()?,
            dtype: self.i32()?,
            op: self.i32()?,
            root: self.u32()?,
        })
    }
}

fn write_frame(w: &mut impl Write, body: Body) -> io::Result<()> {
    let len = u32::try_from(body.0.len()).map_err(|_| malformed())?;
    w.write_all(&len.to_le_bytes())?;
    w.write_all(&body.0)?;
    w.flush()
}

fn read_frame(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    r.read_exact(&mut body)?;
    Ok(body)
}

pub(crate) fn write_request(w: &mut impl Write, request: &Request) -> io::Result<()> {
    let body = match request {
        Request::Join {
            size,
            rank,
            timeout_ms,
        } => Body::default().u8(0).u32(*size).u32(*rank).u64(*timeout_ms),
        Request::Collective {
            call,
            timeout_ms,
            data,
        } => Body::default().u8(1).call(call).u64(*timeout_ms).data(data),
        Request::Send {
            to,
            count,
            dtype,
            data,
        } => Body::default()
            .u8(2)
            .u32(*to)
            .u64(*count)
            .i32(*dtype)
            .data(data),
        Request::Recv {
            from,
            count,
            dtype,
            timeout_ms,
        } => Body::default()
            .u8(3)
            .u32(*from)
            .u64(*count)
            .i32(*dtype)
            .u64(*timeout_ms),
        Request::Leave => Body::default().u8(4),
    };
    write_frame(w, body)
}

pub(crate) fn read_request(r: &mut impl Read) -> io::Result<Request> {
    let body = read_frame(r)?;
    let mut f = Fields(&body);
    Ok(match f.u8()? {
        0 => Request::Join {
            size: f.u32()?,
            rank: f.u32()?,
            timeout_ms: f.u64()?,
        },
        1 => Request::Collective {
            call: f.call()?,
            timeout_ms: f.u64()?,
            data: f.data()?,
        },
        2 => Request::Send {
            to: f.u32()?,
            count: f.u64()?,
            dtype: f.i32()?,
            data: f.data()?,
        },
        3 => Request::Recv {
            from: f.u32()?,
            count: f.u64()?,
            dtype: f.i32()?,
            timeout_ms: f.u64()?,
        },
        4 => Request::Leave,
        _ => return Err(malformed()),
    })
}

pub(crate) fn write_reply(w: &mut impl Write, reply: &Reply) -> io::Result<()> {
    let body = match reply {
        Reply::Done(bytes) => Body::default().u8(0).bytes(bytes),
        Reply::Failed(code, message) => Body::default().u8(1).i32(*code).bytes(message.as_bytes()),
    };
    write_frame(w, body)
}

pub(crate) fn read_reply(r: &mut impl Read) -> io::Result<Reply> {
    let body = read_frame(r)?;
    let mut f = Fields(&body);
    Ok(match f.u8()? {
        0 => Reply::Done(f.bytes()?),
        _ => Reply::Failed(f.i32()?, f.text()?),
    })
}
