//! The rank table file `HcclCommInitClusterInfo` joins by (CANN's A2 format: `server_list[]`
//! of servers, each with a `device[]` list whose `rank_id`s, strings, number the ranks 0..n-1),
//! read as strictly as HCCL does.

use hccl_sys::{HcclResult, HCCL_E_OPEN_FILE_FAILURE, HCCL_E_PARA};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// A valid rank table: its ranks, and its canonical path (what every rank of the job names
/// alike, whatever path it was given).
pub(crate) struct RankTable {
    pub size: u32,
    pub canonical: PathBuf,
}

/// Read and check the rank table at `path`; failures as `(code, message)` naming the file.
pub(crate) fn read(path: &Path) -> Result<RankTable, (HcclResult, String)> {
    let shown = path.display();
    let unreadable = |e: std::io::Error| {
        let why = format!("cannot read rank table {shown}: {e}");
        (HCCL_E_OPEN_FILE_FAILURE, why)
    };
    let text = std::fs::read_to_string(path).map_err(unreadable)?;
    let canonical = path.canonicalize().map_err(unreadable)?;
    let invalid = |why: String| (HCCL_E_PARA, format!("rank table {shown}: {why}"));
    let json: Value = serde_json::from_str(&text).map_err(|e| invalid(format!("not JSON: {e}")))?;
    let ranks = rank_ids(&json).map_err(invalid)?;
    let size = u32::try_from(ranks.len()).map_err(|_| invalid("too many ranks".into()))?;
    Ok(RankTable { size, canonical })
}

/// The `rank_id`s of every server's devices, checked to be exactly 0..n-1.
fn rank_ids(json: &Value) -> Result<BTreeSet<u32>, String> {
    let servers = json["server_list"]
        .as_array()
        .ok_or("no \"server_list\" array")?;
    if let Some(count) = json.get("server_count") {
        let stated = count.as_str().and_then(|c| c.parse::<usize>().ok());
        if stated != Some(servers.len()) {
            return Err(format!(
                "\"server_count\" {count} is not the {} servers of \"server_list\"",
                servers.len()
            ));
        }
    }
    let mut ranks = BTreeSet::new();
    for (s, server) in servers.iter().enumerate() {
        let devices = server["device"]
            .as_array()
            .ok_or(format!("server_list[{s}] has no \"device\" array"))?;
        for (d, device) in devices.iter().enumerate() {
            let key = format!("server_list[{s}].device[{d}].rank_id");
            let id = device["rank_id"]
                .as_str()
                .and_then(|id| id.parse::<u32>().ok())
                .ok_or(format!("{key} is not a rank number as a string"))?;
            if !ranks.insert(id) {
                return Err(format!("{key}: rank_id {id} appears twice"));
            }
        }
    }
    match (0..ranks.len() as u32).find(|r| !ranks.contains(r)) {
        Some(missing) => Err(format!(
            "rank_id {missing} is missing: the rank_ids must be 0..{}",
            ranks.len()
        )),
        None if ranks.is_empty() => Err("no devices".into()),
        None => Ok(ranks),
    }
}
