//! Device selection: the one place that turns `--device` / `--npu-id` into a backend (the
//! CPU's, or an Ascend NPU's through CANN: [`crate::npu::Npu`]) and runs work on it. The work
//! is written once, generic over [`Backend`], as a [`Job`]; [`run`] compiles it for each
//! backend and calls it on the one named. `mindkit selftest` is dispatched here too
//! ([`selftest`]): on the CPU it checks other things than on an NPU.

use crate::engine::cpu::Cpu;
use crate::engine::{selftest as checks, Backend, Device};
use crate::npu::Npu;

/// The devices `--device` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceKind {
    /// The host CPU ([`Cpu`]).
    #[default]
    Cpu,
    /// Ascend NPU number `.0` through CANN ([`Npu`]).
    Npu(i32),
}

impl std::str::FromStr for DeviceKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceKind::Cpu),
            "npu" => Ok(DeviceKind::Npu(0)),
            other => Err(format!("unknown device {other:?} (cpu or npu)")),
        }
    }
}

impl DeviceKind {
    /// The device with `--npu-id` applied: an NPU's number; an error with another device,
    /// where it would mean nothing.
    pub fn with_npu_id(self, id: Option<i32>) -> Result<Self, String> {
        match (self, id) {
            (_, None) => Ok(self),
            (DeviceKind::Npu(_), Some(id)) if id >= 0 => Ok(DeviceKind::Npu(id)),
            (DeviceKind::Npu(_), Some(id)) => Err(format!("--npu-id {id}: not a device number")),
            (DeviceKind::Cpu, Some(_)) => Err("--npu-id needs --device npu".into()),
        }
    }
}

/// `--device` and `--npu-id`, as every subcommand that computes takes them (`train` reads the
/// same two flags among Megatron's and applies [`DeviceKind::with_npu_id`] alike). A
/// subcommand with another default or help text changes them with clap's `mut_arg`.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct DeviceArgs {
    /// Compute device: cpu, or npu (Ascend, through CANN's libraries found at run time).
    #[arg(long, default_value = "cpu")]
    pub device: DeviceKind,
    /// Which NPU with --device npu (as `npu info` numbers them; default 0).
    #[arg(long)]
    pub npu_id: Option<i32>,
}

impl DeviceArgs {
    /// The device named, `--npu-id` applied ([`DeviceKind::with_npu_id`]).
    pub fn kind(&self) -> anyhow::Result<DeviceKind> {
        self.device
            .with_npu_id(self.npu_id)
            .map_err(anyhow::Error::msg)
    }
}

/// Work written once for every backend.
pub trait Job {
    /// What the work gives.
    type Output;
    /// Do the work on `backend`.
    fn run<B: Backend>(self, backend: B) -> anyhow::Result<Self::Output>;
}

/// Run `job` on the backend `device` names: the CPU's, or the NPU it numbers, opened first
/// (its error, e.g. no CANN, returned as it is).
pub fn run<J: Job>(device: DeviceKind, job: J) -> anyhow::Result<J::Output> {
    match device {
        DeviceKind::Cpu => job.run(Cpu),
        DeviceKind::Npu(id) => job.run(Npu::open(id)?),
    }
}

/// `mindkit selftest`: the report and whether every check passed. On `npu`, every operator of
/// the NPU backend against the CPU backend; on `cpu`, the CPU backend's backward operators
/// against finite differences ([`crate::engine::selftest`]).
pub fn selftest(device: DeviceKind) -> anyhow::Result<(String, bool)> {
    let (title, name, checks) = match device {
        DeviceKind::Npu(id) => {
            let npu = Npu::open(id)?;
            let checks = checks::run(&npu)?;
            let name = npu.describe();
            (format!("{name} against the cpu backend"), name, checks)
        }
        DeviceKind::Cpu => (
            "cpu: backward operators against finite differences of the forward ones".into(),
            "cpu".into(),
            checks::gradients()?,
        ),
    };
    let passed = checks.iter().all(checks::Check::passed);
    Ok((checks::report(&title, &name, &checks), passed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        device: DeviceArgs,
    }

    fn kind(args: &[&str]) -> Result<DeviceKind, String> {
        let cli = Cli::try_parse_from([&["mindkit"], args].concat()).map_err(|e| e.to_string())?;
        cli.device.kind().map_err(|e| e.to_string())
    }

    #[test]
    fn device_args_name_the_cpu_by_default_and_an_npu_by_number() {
        assert_eq!(kind(&[]), Ok(DeviceKind::Cpu));
        assert_eq!(kind(&["--device", "npu"]), Ok(DeviceKind::Npu(0)));
        assert_eq!(
            kind(&["--device", "npu", "--npu-id", "3"]),
            Ok(DeviceKind::Npu(3))
        );
    }

    #[test]
    fn device_args_refuse_an_npu_id_that_means_nothing() {
        assert_eq!(
            kind(&["--npu-id", "1"]),
            Err("--npu-id needs --device npu".into())
        );
        assert_eq!(
            kind(&["--device", "npu", "--npu-id=-1"]),
            Err("--npu-id -1: not a device number".into())
        );
        let err = kind(&["--device", "gpu"]).unwrap_err();
        assert!(err.contains("unknown device \"gpu\" (cpu or npu)"), "{err}");
    }

    #[test]
    fn a_job_runs_on_the_cpu_backend() {
        struct Describe;
        impl Job for Describe {
            type Output = String;
            fn run<B: Backend>(self, backend: B) -> anyhow::Result<String> {
                Ok(backend.describe())
            }
        }
        assert_eq!(run(DeviceKind::Cpu, Describe).unwrap(), Cpu.describe());
    }
}
