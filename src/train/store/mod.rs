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
//!
//! Here the wire protocol's constants, shared by the client (`client`) and the server
//! (`server`); the launcher's environment is `launcher`.

mod client;
mod launcher;
mod server;

pub use client::TcpStore;
pub use launcher::{from_launcher, Launch, Launcher};
pub use server::StoreServer;

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::time::Duration;

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
}
