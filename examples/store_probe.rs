//! Exercise mindkit's c10d TCPStore ([`mindkit::train::store`]) against torch's.
//!
//! - Under a launcher (`torchrun --no-python … store_probe`, or srun with MASTER_ADDR /
//!   MASTER_PORT exported): rank 0 sets a 4108-byte value (the size of HCCL's root info),
//!   every rank gets and checks it, then all meet at a counter; each prints `rank R of W: ok`.
//! - `store_probe peer HOST PORT`: a client of a store someone else hosts (the interop tests'
//!   Python TCPStore): get `py/to_rust`, add 1 to `shared/count`, set `rust/to_py` to
//!   "rust saw " + it (last: once Python sees it, the count is in), then wait for `py/done`.
//! - `store_probe wait HOST PORT KEY SECONDS`: wait for KEY with that timeout (the tests check
//!   the timeout's error against torch's server), then set `rust/after_wait` to show the
//!   connection survived a cancelled wait.
//! - `store_probe serve`: host a store on 127.0.0.1 at a free port, print `port N`, and serve
//!   until stdin closes.

use anyhow::{anyhow, bail, Result};
use mindkit::train::store::{from_launcher, Launch, StoreServer, TcpStore};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(60);
/// The size of HCCL's `HcclRootInfo`.
const ROOT_INFO_LEN: usize = 4108;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        [] => launched(),
        ["peer", host, port] => peer(host, port.parse()?),
        ["wait", host, port, key, seconds] => wait(
            host,
            port.parse()?,
            key,
            Duration::from_secs_f64(seconds.parse()?),
        ),
        ["serve"] => serve(),
        _ => bail!("usage: store_probe [peer HOST PORT | wait HOST PORT KEY SECONDS | serve]"),
    }
}

fn launched() -> Result<()> {
    let launch = from_launcher()?.ok_or_else(|| {
        anyhow!("store_probe: no launcher environment (run it under torchrun or srun)")
    })?;
    // Rank 0 keeps a self-hosted server alive until every rank has passed the last wait.
    let (_server, mut store) = launch.connect(TIMEOUT)?;
    let expected: Vec<u8> = (0..ROOT_INFO_LEN).map(|i| (i % 251) as u8).collect();
    let probe = launch.key("probe");
    if launch.rank == 0 {
        store.set(&probe, &expected)?;
    }
    let got = store.get(&probe)?;
    if got != expected {
        bail!(
            "rank {}: {probe} holds {} other bytes",
            launch.rank,
            got.len()
        );
    }
    meet(&launch, &mut store)?;
    println!("rank {} of {}: ok", launch.rank, launch.world_size);
    Ok(())
}

/// Count in at `arrived` and wait until every rank has; then count out at `left`, the rank
/// hosting the store waiting for the rest, so that its server outlives every last request.
fn meet(launch: &Launch, store: &mut TcpStore) -> Result<()> {
    let world = launch.world_size as i64;
    let (arrived, left) = (launch.key("arrived"), launch.key("left"));
    store.add(&arrived, 1)?;
    let start = Instant::now();
    while store.add(&arrived, 0)? < world {
        if start.elapsed() > TIMEOUT {
            bail!("rank {}: not every rank arrived at {arrived}", launch.rank);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if store.add(&left, 1)? == world {
        store.set(&launch.key("all_left"), b"1")?;
    }
    if launch.hosts_store {
        store.wait(&[&launch.key("all_left")])?;
    }
    Ok(())
}

fn peer(host: &str, port: u16) -> Result<()> {
    let mut store = TcpStore::connect(host, port, TIMEOUT)?;
    let from_python = store.get("py/to_rust")?;
    let count = store.add("shared/count", 1)?;
    store.set(
        "rust/to_py",
        &[b"rust saw ".as_slice(), &from_python].concat(),
    )?;
    store.wait(&["py/done"])?;
    println!("count {count}");
    Ok(())
}

fn wait(host: &str, port: u16, key: &str, timeout: Duration) -> Result<()> {
    let mut store = TcpStore::connect(host, port, timeout)?;
    let waited = store.wait(&[key]);
    store.set("rust/after_wait", b"1")?;
    waited
}

fn serve() -> Result<()> {
    let (_server, port) = StoreServer::bind("127.0.0.1", 0)?;
    println!("port {port}");
    std::io::stdout().flush()?;
    // Serve until whoever started us closes our stdin.
    std::io::stdin().read_to_end(&mut Vec::new())?;
    Ok(())
}
