//! PyTorch's c10d TCPStore, spoken from Rust: a client ([`TcpStore`]) that torch's own store
//! servers accept (torchrun's elastic agent hosts one at MASTER_ADDR:MASTER_PORT), a minimal
//! server ([`StoreServer`]) that torch's clients accept, and the launcher's environment
//! ([`from_launcher`]). Ranks exchange small values through it, above all HCCL's root info.
//!
//! The wire protocol, as torch 2.9 speaks it (pytorch/pytorch
//! torch/csrc/distributed/c10d/TCPStore.cpp, TCPStoreBackend.hpp, TCPStoreLibUvBackend.cpp,
//! Utils.hpp): a request is one query-type byte followed by its fields; strings and byte
//! values are a u64 length and the bytes; integers are fixed-width in the host's byte order
//! (little-endian on every platform torch runs on, so little-endian here). A client first
//! sends VALIDATE with a magic number (no reply) and then PING with a nonce (echoed back).
//! The client API prefixes every key with "/" (`TCPStore::keyPrefix_`), so keys set here
//! are the keys a Python `TCPStore` sees under the same name.

use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The largest value either side accepts: lengths on the wire are never trusted beyond it.
pub const MAX_VALUE_LEN: usize = 64 << 20;
/// The largest key (torch's libuv server allows far less; this only bounds allocation).
const MAX_KEY_LEN: usize = 64 << 10;
/// The most keys one CHECK / WAIT / MULTI_* names (`MAX_KEY_COUNT` of
/// pytorch/pytorch torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp).
const MAX_KEY_COUNT: u64 = 128 * 1024;
/// `validationMagicNumber` of pytorch/pytorch torch/csrc/distributed/c10d/TCPStoreBackend.hpp.
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// `TCPStore::keyPrefix_` of pytorch/pytorch torch/csrc/distributed/c10d/TCPStore.hpp.
const KEY_PREFIX: &str = "/";

/// `QueryType` of pytorch/pytorch torch/csrc/distributed/c10d/TCPStoreBackend.hpp (a u8).
mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const COMPARE_SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const GETNUMKEYS: u8 = 7;
    pub const DELETE_KEY: u8 = 8;
    pub const APPEND: u8 = 9;
    pub const MULTI_GET: u8 = 10;
    pub const MULTI_SET: u8 = 11;
    pub const CANCEL_WAIT: u8 = 12;
    pub const PING: u8 = 13;
}

/// `CheckResponseType` (u8): READY, NOT_READY.
const CHECK_READY: u8 = 0;
const CHECK_NOT_READY: u8 = 1;
/// `WaitResponseType` (u8): STOP_WAITING, WAIT_CANCELED.
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

/// A request being framed: the query byte, then fields.
struct Request(Vec<u8>);

impl Request {
    fn new(query: u8) -> Self {
        Request(vec![query])
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(self, b: &[u8]) -> Self {
        let mut r = self.u64(b.len() as u64);
        r.0.extend_from_slice(b);
        r
    }
    /// A key as the client API sends it: with torch's prefix.
    fn key(self, key: &str) -> Self {
        self.bytes(format!("{KEY_PREFIX}{key}").as_bytes())
    }
    fn keys(self, keys: &[&str]) -> Self {
        keys.iter()
            .fold(self.u64(keys.len() as u64), |r, k| r.key(k))
    }
}

/// A connection to a TCPStore server, as `torch.distributed.TCPStore(is_master=False)`.
pub struct TcpStore {
    addr: String,
    stream: TcpStream,
    timeout: Duration,
}

impl TcpStore {
    /// Connect to the store at `host:port`, retrying until `timeout` while nothing listens
    /// there yet (the server may start after its clients, as in torch's constructor), then
    /// validate and ping as torch's client does. `timeout` also bounds every later wait.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Self> {
        let addr = format!("{host}:{port}");
        let deadline = Instant::now() + timeout;
        let mut backoff = Duration::from_millis(10);
        loop {
            let last = match Self::try_connect(&addr, timeout) {
                Ok(store) => return Ok(store),
                Err(e) => e,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(last.context(format!(
                    "TCPStore {addr}: no store server answered within {} s",
                    timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(backoff.min(deadline - now));
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    fn try_connect(addr: &str, timeout: Duration) -> Result<Self> {
        let targets = addr
            .to_socket_addrs()
            .with_context(|| format!("TCPStore {addr}: cannot resolve the address"))?;
        let mut last = anyhow!("TCPStore {addr}: the address resolves to nothing");
        for target in targets {
            match TcpStream::connect_timeout(&target, timeout.min(Duration::from_secs(5))) {
                Ok(stream) => {
                    stream.set_nodelay(true)?;
                    let mut store = TcpStore {
                        addr: addr.to_string(),
                        stream,
                        timeout,
                    };
                    store.handshake()?;
                    return Ok(store);
                }
                Err(e) => last = anyhow!("TCPStore {addr}: connecting to {target}: {e}"),
            }
        }
        Err(last)
    }

    /// `TCPStore::validate` then `TCPStore::ping` (the nonce is our pid, as torch's is).
    fn handshake(&mut self) -> Result<()> {
        let nonce = std::process::id();
        self.send(
            "validate",
            "",
            Request::new(query::VALIDATE).u32(VALIDATION_MAGIC),
        )?;
        self.send("ping", "", Request::new(query::PING).u32(nonce))?;
        let echoed = u32::from_le_bytes(self.recv("ping", "", self.timeout)?);
        if echoed != nonce {
            bail!(self.fail("ping", "", format!("sent nonce {nonce}, got back {echoed}")));
        }
        Ok(())
    }

    /// This end's address of the connection: the host's address on the interface that
    /// reaches the store, where the other ranks can reach this one.
    pub fn local_ip(&self) -> Result<std::net::IpAddr> {
        Ok(self.stream.local_addr()?.ip())
    }

    /// The address this client talks to, as `host:port`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Set `key` to `value` (no reply in the protocol).
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        self.check_len("set", key, value.len())?;
        self.send("set", key, Request::new(query::SET).key(key).bytes(value))
    }

    /// The value of `key`, once some client has set it: like torch's `get`, wait for the key
    /// (up to the timeout), then fetch it.
    pub fn get(&mut self, key: &str) -> Result<Vec<u8>> {
        self.wait(&[key])?;
        self.send("get", key, Request::new(query::GET).key(key))?;
        let len = u64::from_le_bytes(self.recv("get", key, self.timeout)?);
        self.recv_value("get", key, len)
    }

    /// Add `delta` to the integer at `key` (a decimal string on the server; 0 if unset) and
    /// return the sum. `add(key, 0)` reads a counter.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        self.send("add", key, Request::new(query::ADD).key(key).i64(delta))?;
        Ok(i64::from_le_bytes(self.recv("add", key, self.timeout)?))
    }

    /// Whether every key is set, without waiting.
    pub fn check(&mut self, keys: &[&str]) -> Result<bool> {
        let named = keys.join(", ");
        self.send("check", &named, Request::new(query::CHECK).keys(keys))?;
        match self.recv::<1>("check", &named, self.timeout)?[0] {
            CHECK_READY => Ok(true),
            CHECK_NOT_READY => Ok(false),
            other => bail!(self.fail("check", &named, format!("malformed reply {other}"))),
        }
    }

    /// Wait until every key is set, up to the timeout given at connect.
    pub fn wait(&mut self, keys: &[&str]) -> Result<()> {
        let named = keys.join(", ");
        self.send("wait", &named, Request::new(query::WAIT).keys(keys))?;
        match self.recv_or_timeout::<1>("wait", &named, self.timeout)? {
            Some([STOP_WAITING]) => Ok(()),
            Some([other]) => bail!(self.fail("wait", &named, format!("malformed reply {other}"))),
            None => self.cancel_wait(&named),
        }
    }

    /// The wait timed out: cancel it as torch's `doWait` does. The server may have answered
    /// STOP_WAITING just before it saw the cancel; WAIT_CANCELED follows either way.
    fn cancel_wait(&mut self, named: &str) -> Result<()> {
        self.send("wait", named, Request::new(query::CANCEL_WAIT))?;
        let mut reply = self.recv::<1>("wait", named, self.timeout)?[0];
        if reply == STOP_WAITING {
            reply = self.recv::<1>("wait", named, self.timeout)?[0];
        }
        if reply != WAIT_CANCELED {
            bail!(self.fail(
                "wait",
                named,
                format!("malformed reply {reply} to CANCEL_WAIT")
            ));
        }
        bail!(self.fail(
            "wait",
            named,
            format!(
                "timed out after {} s: the key is not set",
                self.timeout.as_secs_f64()
            )
        ))
    }

    fn fail(&self, op: &str, key: &str, what: impl std::fmt::Display) -> anyhow::Error {
        if key.is_empty() {
            anyhow!("TCPStore {}: {op}: {what}", self.addr)
        } else {
            anyhow!("TCPStore {}: {op} {key:?}: {what}", self.addr)
        }
    }

    fn check_len(&self, op: &str, key: &str, len: usize) -> Result<()> {
        if len > MAX_VALUE_LEN {
            bail!(self.fail(
                op,
                key,
                format!("value of {len} bytes exceeds the {MAX_VALUE_LEN}-byte limit")
            ));
        }
        Ok(())
    }

    fn send(&mut self, op: &str, key: &str, request: Request) -> Result<()> {
        self.stream
            .write_all(&request.0)
            .map_err(|e| self.fail(op, key, io_cause(&e)))
    }

    fn recv<const N: usize>(&mut self, op: &str, key: &str, within: Duration) -> Result<[u8; N]> {
        match self.recv_or_timeout(op, key, within)? {
            Some(reply) => Ok(reply),
            None => bail!(self.fail(
                op,
                key,
                format!("no reply within {} s", within.as_secs_f64())
            )),
        }
    }

    /// N reply bytes, or None when none arrived within `within`.
    fn recv_or_timeout<const N: usize>(
        &mut self,
        op: &str,
        key: &str,
        within: Duration,
    ) -> Result<Option<[u8; N]>> {
        // A zero read timeout means "block forever" to the socket API.
        let within = within.max(Duration::from_millis(1));
        self.stream
            .set_read_timeout(Some(within))
            .map_err(|e| self.fail(op, key, io_cause(&e)))?;
        let mut buf = [0u8; N];
        match self.stream.read_exact(&mut buf) {
            Ok(()) => Ok(Some(buf)),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Ok(None),
            Err(e) => Err(self.fail(op, key, io_cause(&e))),
        }
    }

    fn recv_value(&mut self, op: &str, key: &str, len: u64) -> Result<Vec<u8>> {
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        self.check_len(op, key, len)
            .context("refusing a malformed reply")?;
        let mut value = vec![0u8; len];
        self.stream
            .read_exact(&mut value)
            .map_err(|e| self.fail(op, key, io_cause(&e)))?;
        Ok(value)
    }
}

/// What a socket error means to the user.
fn io_cause(e: &std::io::Error) -> String {
    match e.kind() {
        ErrorKind::UnexpectedEof => "the server closed the connection".into(),
        ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
            format!("the server closed the connection ({e})")
        }
        ErrorKind::WouldBlock | ErrorKind::TimedOut => "no reply in time".into(),
        _ => e.to_string(),
    }
}

/// The keys and values, and a signal for waiters when they change.
#[derive(Default)]
struct Table {
    values: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    changed: Condvar,
}

impl Table {
    fn lock(&self) -> MutexGuard<'_, HashMap<Vec<u8>, Vec<u8>>> {
        // A connection thread cannot leave the map half-updated: ignore poisoning.
        self.values.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn update<T>(&self, f: impl FnOnce(&mut HashMap<Vec<u8>, Vec<u8>>) -> T) -> T {
        let out = f(&mut self.lock());
        self.changed.notify_all();
        out
    }
}

/// What the server threads share.
struct Shared {
    table: Table,
    stop: AtomicBool,
    /// Open connections, to shut down when the server stops.
    connections: Mutex<Vec<(TcpStream, JoinHandle<()>)>>,
}

/// A minimal TCPStore server that torch's clients accept: a background accept thread and a
/// thread per connection. Dropping it closes every connection and stops the threads.
pub struct StoreServer {
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Listen on `host:port` (port 0: any free port); returns the server and its port.
    pub fn bind(host: &str, port: u16) -> Result<(StoreServer, u16)> {
        let listener = TcpListener::bind((host, port))
            .with_context(|| format!("TCPStore server: cannot listen on {host}:{port}"))?;
        let actual = listener.local_addr()?.port();
        // Non-blocking, so the accept loop notices a stop request.
        listener.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            table: Table::default(),
            stop: AtomicBool::new(false),
            connections: Mutex::new(Vec::new()),
        });
        let accept = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("tcpstore-accept".into())
                .spawn(move || accept_loop(&listener, &shared))?
        };
        Ok((
            StoreServer {
                shared,
                accept: Some(accept),
            },
            actual,
        ))
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.table.changed.notify_all();
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        let connections = std::mem::take(&mut *lock(&self.shared.connections));
        for (stream, thread) in connections {
            let _ = stream.shutdown(Shutdown::Both);
            let _ = thread.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How often idle server threads look at the stop flag.
const POLL: Duration = Duration::from_millis(10);

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = start_connection(stream, shared) {
                    eprintln!("TCPStore server: dropping a connection: {e}");
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(e) => {
                eprintln!("TCPStore server: accept failed: {e}");
                std::thread::sleep(POLL);
            }
        }
    }
}

fn start_connection(stream: TcpStream, shared: &Arc<Shared>) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    let handle = stream.try_clone()?;
    let thread = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("tcpstore-conn".into())
            .spawn(move || {
                // A client that breaks the protocol or goes away just loses its connection,
                // as with torch's server.
                let _ = Connection { stream, shared }.serve();
            })?
    };
    let mut connections = lock(&shared.connections);
    connections.retain(|(_, t)| !t.is_finished());
    connections.push((handle, thread));
    Ok(())
}

/// Why the server ends a connection.
type Closed = std::io::Error;

fn protocol_error(what: impl Into<String>) -> Closed {
    std::io::Error::new(ErrorKind::InvalidData, what.into())
}

/// One client's connection, served by its own thread.
struct Connection {
    stream: TcpStream,
    shared: Arc<Shared>,
}

impl Connection {
    /// Serve requests until the client leaves, errs or the server stops. The first request
    /// must be VALIDATE with torch's magic number.
    fn serve(&mut self) -> Result<(), Closed> {
        if self.u8()? != query::VALIDATE {
            return Err(protocol_error("the first request is not VALIDATE"));
        }
        self.validate()?;
        while !self.shared.stop.load(Ordering::SeqCst) {
            let query = self.u8()?;
            self.dispatch(query)?;
        }
        Ok(())
    }

    fn dispatch(&mut self, query: u8) -> Result<(), Closed> {
        let shared = self.shared.clone();
        let table = &shared.table;
        match query {
            query::VALIDATE => self.validate(),
            query::PING => {
                let nonce = self.u32()?;
                self.reply(&nonce.to_le_bytes())
            }
            query::SET => {
                let (key, value) = (self.bytes(MAX_KEY_LEN)?, self.value()?);
                table.update(|t| t.insert(key, value));
                Ok(())
            }
            query::APPEND => {
                let (key, value) = (self.bytes(MAX_KEY_LEN)?, self.value()?);
                table.update(|t| t.entry(key).or_default().extend_from_slice(&value));
                Ok(())
            }
            query::COMPARE_SET => self.compare_set(),
            query::GET => {
                let key = self.bytes(MAX_KEY_LEN)?;
                let value = table.lock().get(&key).cloned();
                let value = value.ok_or_else(|| protocol_error("GET of a key that is not set"))?;
                self.reply_value(&value)
            }
            query::ADD => self.add(),
            query::CHECK => {
                let keys = self.key_list()?;
                let ready = keys.iter().all(|k| table.lock().contains_key(k));
                self.reply(&[if ready { CHECK_READY } else { CHECK_NOT_READY }])
            }
            query::WAIT => {
                let keys = self.key_list()?;
                self.wait(&keys)
            }
            // A cancel that crossed our STOP_WAITING: acknowledge it, as torch's server does.
            query::CANCEL_WAIT => self.reply(&[WAIT_CANCELED]),
            query::GETNUMKEYS => {
                let n = table.lock().len() as i64;
                self.reply(&n.to_le_bytes())
            }
            query::DELETE_KEY => {
                let key = self.bytes(MAX_KEY_LEN)?;
                let deleted = table.update(|t| t.remove(&key).is_some());
                self.reply(&i64::from(deleted).to_le_bytes())
            }
            query::MULTI_GET => self.multi_get(),
            query::MULTI_SET => self.multi_set(),
            other => Err(protocol_error(format!("unsupported query type {other}"))),
        }
    }

    fn validate(&mut self) -> Result<(), Closed> {
        match self.u32()? {
            VALIDATION_MAGIC => Ok(()),
            other => Err(protocol_error(format!("bad validation magic {other:#x}"))),
        }
    }

    /// ADD: the stored value is the decimal text of the sum (`LibUVStoreDaemon::add`).
    fn add(&mut self) -> Result<(), Closed> {
        let key = self.bytes(MAX_KEY_LEN)?;
        let delta = i64::from_le_bytes(self.array()?);
        let sum = self.shared.table.update(|t| {
            let old = match t.get(&key) {
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.trim().parse::<i64>().ok())
                    .ok_or_else(|| protocol_error("ADD to a value that is not an integer"))?,
                None => 0,
            };
            let sum = old.wrapping_add(delta);
            t.insert(key, sum.to_string().into_bytes());
            Ok::<i64, Closed>(sum)
        })?;
        self.reply(&sum.to_le_bytes())
    }

    /// COMPARE_SET (`LibUVStoreDaemon::compareAndSet`): an unset key with an empty expected
    /// value, or a key holding the expected value, takes the desired value; the reply is the
    /// value now stored (or the expected value, when the key is unset and stays so).
    fn compare_set(&mut self) -> Result<(), Closed> {
        let key = self.bytes(MAX_KEY_LEN)?;
        let (expected, desired) = (self.value()?, self.value()?);
        let now = self.shared.table.update(|t| match t.get(&key) {
            None if expected.is_empty() => {
                t.insert(key, desired.clone());
                desired
            }
            None => expected,
            Some(current) if *current == expected => {
                t.insert(key, desired.clone());
                desired
            }
            Some(current) => current.clone(),
        });
        self.reply_value(&now)
    }

    fn multi_get(&mut self) -> Result<(), Closed> {
        let keys = self.key_list()?;
        let mut out = Vec::new();
        for key in &keys {
            let value = self.shared.table.lock().get(key).cloned();
            let value = value.ok_or_else(|| protocol_error("MULTI_GET of a key not set"))?;
            out.extend_from_slice(&(value.len() as u64).to_le_bytes());
            out.extend_from_slice(&value);
        }
        self.reply(&out)
    }

    fn multi_set(&mut self) -> Result<(), Closed> {
        let count = self.count()?;
        for _ in 0..count {
            let (key, value) = (self.bytes(MAX_KEY_LEN)?, self.value()?);
            self.shared.table.update(|t| t.insert(key, value));
        }
        Ok(())
    }

    /// WAIT: answer STOP_WAITING once every key is set. Meanwhile the client may send
    /// CANCEL_WAIT (its timeout), or leave; poll for both between looks at the table.
    fn wait(&mut self, keys: &[Vec<u8>]) -> Result<(), Closed> {
        let shared = self.shared.clone();
        let table = &shared.table;
        loop {
            let values = table.lock();
            if keys.iter().all(|k| values.contains_key(k)) {
                drop(values);
                return self.reply(&[STOP_WAITING]);
            }
            if shared.stop.load(Ordering::SeqCst) {
                return Err(protocol_error("the server is stopping"));
            }
            let _ = table.changed.wait_timeout(values, POLL);
            if self.client_sent_something()? {
                return match self.u8()? {
                    query::CANCEL_WAIT => self.reply(&[WAIT_CANCELED]),
                    other => Err(protocol_error(format!("query {other} during WAIT"))),
                };
            }
        }
    }

    /// Whether a request byte is waiting to be read (an error once the client has gone).
    fn client_sent_something(&self) -> Result<bool, Closed> {
        self.stream.set_nonblocking(true)?;
        let peeked = self.stream.peek(&mut [0u8; 1]);
        self.stream.set_nonblocking(false)?;
        match peeked {
            Ok(0) => Err(ErrorKind::UnexpectedEof.into()),
            Ok(_) => Ok(true),
            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn reply(&mut self, bytes: &[u8]) -> Result<(), Closed> {
        self.stream.write_all(bytes)
    }

    fn reply_value(&mut self, value: &[u8]) -> Result<(), Closed> {
        let mut out = (value.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(value);
        self.reply(&out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Closed> {
        let mut buf = [0u8; N];
        self.stream.read_exact(&mut buf)?;
        Ok(buf)
    }

    fn u8(&mut self) -> Result<u8, Closed> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32, Closed> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    /// A u64 length and that many bytes, refused beyond `max`.
    fn bytes(&mut self, max: usize) -> Result<Vec<u8>, Closed> {
        let len = u64::from_le_bytes(self.array()?);
        if len > max as u64 {
            return Err(protocol_error(format!("a length of {len} exceeds {max}")));
        }
        let mut buf = vec![0u8; len as usize];
        self.stream.read_exact(&mut buf)?;
        Ok(buf)
    }

    fn value(&mut self) -> Result<Vec<u8>, Closed> {
        self.bytes(MAX_VALUE_LEN)
    }

    fn count(&mut self) -> Result<u64, Closed> {
        let n = u64::from_le_bytes(self.array()?);
        if n > MAX_KEY_COUNT {
            return Err(protocol_error(format!("{n} keys exceed {MAX_KEY_COUNT}")));
        }
        Ok(n)
    }

    fn key_list(&mut self) -> Result<Vec<Vec<u8>>, Closed> {
        let n = self.count()?;
        (0..n).map(|_| self.bytes(MAX_KEY_LEN)).collect()
    }
}

/// Which launcher started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun (torch.distributed.run) or another env:// launcher setting RANK / WORLD_SIZE.
    Torchrun,
    /// Slurm's srun.
    Slurm,
}

/// This rank's place in a multi-process launch, and where the store is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// Who set the environment.
    pub launcher: Launcher,
    /// The global rank (RANK / SLURM_PROCID).
    pub rank: usize,
    /// The number of ranks (WORLD_SIZE / SLURM_NTASKS).
    pub world_size: usize,
    /// The rank on this node (LOCAL_RANK / SLURM_LOCALID; 0 when unset).
    pub local_rank: usize,
    /// The store's host (MASTER_ADDR).
    pub master_addr: String,
    /// The store's port (MASTER_PORT).
    pub master_port: u16,
    /// Whether this rank hosts the store: Slurm's rank 0, or rank 0 under torchrun when the
    /// agent does not host one (TORCHELASTIC_USE_AGENT_STORE is not "True").
    pub hosts_store: bool,
    /// TORCHELASTIC_RESTART_COUNT: the agent's store outlives a restart of the workers, so
    /// keys are scoped by it ([`Launch::key`]).
    pub restart_count: u32,
}

/// The launch from this process's environment: `Ok(None)` when no launcher set it (neither
/// torchrun's RANK / WORLD_SIZE nor Slurm's SLURM_PROCID / SLURM_NTASKS) or it started one
/// rank alone, an error when its
/// values are missing or inconsistent.
pub fn from_launcher() -> Result<Option<Launch>> {
    Launch::from_env(|name| std::env::var(name).ok())
}

impl Launch {
    /// [`from_launcher`] over any source of environment variables.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
        let launcher = if var("RANK").is_some() || var("WORLD_SIZE").is_some() {
            Launcher::Torchrun
        } else if var("SLURM_PROCID").is_some() {
            Launcher::Slurm
        } else {
            return Ok(None);
        };
        let (rank, world, local) = match launcher {
            Launcher::Torchrun => ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
            Launcher::Slurm => ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
        };
        let number = |name: &str| -> Result<usize> {
            let text =
                var(name).ok_or_else(|| anyhow!("{name} is not set ({launcher:?} launch)"))?;
            text.trim()
                .parse()
                .map_err(|e| anyhow!("{name}={text:?} is not a rank count or index: {e}"))
        };
        let (rank, world_size) = (number(rank)?, number(world)?);
        // LOCAL_RANK is missing under plain env:// launches; only one rank per node is safe.
        let local_rank = if var(local).is_some() {
            number(local)?
        } else {
            0
        };
        if rank >= world_size {
            bail!("{launcher:?} launch: rank {rank} is not below the world size {world_size}");
        }
        // One rank alone needs no store (`srun -n1`, a single-process torchrun).
        if world_size == 1 {
            return Ok(None);
        }
        if local_rank > rank {
            bail!("{launcher:?} launch: local rank {local_rank} exceeds the global rank {rank}");
        }
        let (master_addr, master_port) = master(&var)?;
        let agent_store = var("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True");
        let restart_count = match var("TORCHELASTIC_RESTART_COUNT") {
            Some(n) => n
                .trim()
                .parse()
                .map_err(|e| anyhow!("TORCHELASTIC_RESTART_COUNT={n:?}: {e}"))?,
            None => 0,
        };
        Ok(Some(Launch {
            launcher,
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            hosts_store: rank == 0 && !agent_store,
            restart_count,
        }))
    }

    /// `name` scoped to this launch attempt, so a restarted group never reads the values a
    /// failed attempt left in the agent's store.
    pub fn key(&self, name: &str) -> String {
        format!("mindkit/attempt_{}/{name}", self.restart_count)
    }

    /// Host the store if this rank must (on every interface, as torch's server listens),
    /// then connect to it. Keep the server alive while any rank may still use the store.
    pub fn connect(&self, timeout: Duration) -> Result<(Option<StoreServer>, TcpStore)> {
        let server = if self.hosts_store {
            let (server, _) = StoreServer::bind("0.0.0.0", self.master_port)
                .with_context(|| format!("rank {} hosts the store", self.rank))?;
            Some(server)
        } else {
            None
        };
        let store = TcpStore::connect(&self.master_addr, self.master_port, timeout)?;
        Ok((server, store))
    }
}

/// MASTER_ADDR and MASTER_PORT, both required.
fn master(var: &impl Fn(&str) -> Option<String>) -> Result<(String, u16)> {
    let (Some(addr), Some(port)) = (var("MASTER_ADDR"), var("MASTER_PORT")) else {
        bail!(
            "MASTER_ADDR and MASTER_PORT must name the host and a free port of rank 0 \
             (torchrun sets them; under Slurm, export them in the batch script, e.g. \
             MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1) \
             MASTER_PORT=29500)"
        );
    };
    let port = port
        .trim()
        .parse::<u16>()
        .ok()
        .filter(|&p| p != 0)
        .ok_or_else(|| anyhow!("MASTER_PORT={port:?} is not a port number (1-65535)"))?;
    Ok((addr, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHORT: Duration = Duration::from_secs(5);

    fn server() -> (StoreServer, u16) {
        StoreServer::bind("127.0.0.1", 0).expect("bind")
    }

    #[test]
    fn set_on_one_client_get_on_another() {
        let (_server, port) = server();
        let mut a = TcpStore::connect("127.0.0.1", port, SHORT).unwrap();
        let mut b = TcpStore::connect("127.0.0.1", port, SHORT).unwrap();
        let root_info: Vec<u8> = (0..4108).map(|i| (i % 251) as u8).collect();
        a.set("hccl/root", &root_info).unwrap();
        assert_eq!(b.get("hccl/root").unwrap(), root_info);
        assert!(b.check(&["hccl/root"]).unwrap());
        assert!(!b.check(&["hccl/root", "other"]).unwrap());
    }

    #[test]
    fn get_waits_for_a_later_set() {
        let (_server, port) = server();
        let mut reader = TcpStore::connect("127.0.0.1", port, SHORT).unwrap();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            let mut w = TcpStore::connect("127.0.0.1", port, SHORT).unwrap();
            w.set("late", b"here").unwrap();
        });
        assert_eq!(reader.get("late").unwrap(), b"here");
        writer.join().unwrap();
    }

    #[test]
    fn connect_retries_until_the_server_is_up() {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let host = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let (server, _) = StoreServer::bind("127.0.0.1", port).unwrap();
            std::thread::sleep(Duration::from_millis(500));
            drop(server);
        });
        let mut c = TcpStore::connect("127.0.0.1", port, SHORT).unwrap();
        assert_eq!(c.add("n", 1).unwrap(), 1);
        host.join().unwrap();
    }

    #[test]
    fn add_counts_across_clients() {
        let (_server, port) = server();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(move || {
                    let mut c = TcpStore::connect("127.0.0.1", port, SHORT).unwrap();
                    for _ in 0..25 {
                        c.add("arrived", 1).unwrap();
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        let mut c = TcpStore::connect("127.0.0.1", port, SHORT).unwrap();
        assert_eq!(c.add("arrived", 0).unwrap(), 100);
        assert_eq!(c.add("arrived", -101).unwrap(), -1);
        // The server keeps the decimal text, as torch's does.
        assert_eq!(c.get("arrived").unwrap(), b"-1");
    }

    #[test]
    fn wait_times_out_with_the_address_and_key() {
        let (_server, port) = server();
        let timeout = Duration::from_millis(300);
        let mut c = TcpStore::connect("127.0.0.1", port, timeout).unwrap();
        let err = format!("{:#}", c.wait(&["never"]).unwrap_err());
        assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");
        assert!(
            err.contains("\"never\"") && err.contains("timed out after 0.3 s"),
            "{err}"
        );
        // The connection stays usable after a cancelled wait.
        c.set("now", b"1").unwrap();
        assert_eq!(c.get("now").unwrap(), b"1");
    }

    #[test]
    fn oversize_values_are_refused() {
        let (_server, port) = server();
        let mut c = TcpStore::connect("127.0.0.1", port, SHORT).unwrap();
        let err = c.set("big", &vec![0u8; MAX_VALUE_LEN + 1]).unwrap_err();
        assert!(
            err.to_string().contains("exceeds the 67108864-byte limit"),
            "{err}"
        );
    }

    #[test]
    fn oversize_reply_lengths_are_refused() {
        // A fake server: accepts the handshake, then answers GET with a 1 TiB length.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let fake = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut handshake = [0u8; 10];
            s.read_exact(&mut handshake).unwrap();
            s.write_all(&handshake[6..10]).unwrap(); // the ping nonce
            let mut wait = [0u8; 1 + 8 + 8 + 2];
            s.read_exact(&mut wait).unwrap();
            s.write_all(&[STOP_WAITING]).unwrap();
            let mut get = [0u8; 1 + 8 + 2];
            s.read_exact(&mut get).unwrap();
            s.write_all(&(1u64 << 40).to_le_bytes()).unwrap();
        });
        let mut c = TcpStore::connect("127.0.0.1", port, SHORT).unwrap();
        let err = format!("{:#}", c.get("k").unwrap_err());
        assert!(
            err.contains("refusing a malformed reply") && err.contains("\"k\""),
            "{err}"
        );
        fake.join().unwrap();
    }

    #[test]
    fn a_stopped_server_is_reported() {
        let (server, port) = server();
        let mut c = TcpStore::connect("127.0.0.1", port, SHORT).unwrap();
        drop(server);
        let err = c.add("k", 1).unwrap_err().to_string();
        assert!(err.contains("closed the connection"), "{err}");
    }

    #[test]
    fn launch_from_torchrun_and_slurm() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(Launch::from_env(env(&[])).unwrap(), None);
        let torchrun = Launch::from_env(env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "node1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ]))
        .unwrap()
        .unwrap();
        assert!(!torchrun.hosts_store);
        assert_eq!(torchrun.key("probe"), "mindkit/attempt_0/probe");
        let slurm = Launch::from_env(env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
            ("MASTER_ADDR", "node1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert!(slurm.hosts_store && slurm.launcher == Launcher::Slurm);
        let alone = Launch::from_env(env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]));
        assert_eq!(alone.unwrap(), None);
        let no_master = Launch::from_env(env(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "4")]));
        assert!(no_master.unwrap_err().to_string().contains("MASTER_ADDR"));
        let bad = Launch::from_env(env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1"),
        ]));
        assert!(bad.unwrap_err().to_string().contains("rank 2 is not below"));
        let garbled = Launch::from_env(env(&[("RANK", "x"), ("WORLD_SIZE", "2")]));
        assert!(garbled.unwrap_err().to_string().contains("RANK=\"x\""));
    }
}
