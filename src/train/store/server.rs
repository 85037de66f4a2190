//! A minimal TCPStore server that torch's clients accept: the keys and values, an accept
//! thread, and one thread per connection serving its requests.

use super::{query, CHECK_NOT_READY, CHECK_READY, MAX_KEY_COUNT, MAX_KEY_LEN, MAX_VALUE_LEN};
use super::{STOP_WAITING, VALIDATION_MAGIC, WAIT_CANCELED};
use anyhow::{Context, Result};
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

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
