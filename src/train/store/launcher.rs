//! The launcher's environment: which launcher (torchrun, Slurm) started this process, its
//! rank, and where the store is.

use super::{StoreServer, TcpStore};
use anyhow::{anyhow, bail, Context, Result};
use std::time::Duration;

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
