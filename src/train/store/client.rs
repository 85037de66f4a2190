//! The TCPStore client, as `torch.distributed.TCPStore(is_master=False)` speaks to a server.

use super::{query, CHECK_NOT_READY, CHECK_READY, KEY_PREFIX, MAX_VALUE_LEN, STOP_WAITING};
use super::{VALIDATION_MAGIC, WAIT_CANCELED};
use anyhow::{anyhow, bail, Context, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

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
