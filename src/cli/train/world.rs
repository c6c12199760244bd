//! The ranks of `mpirun -np N qatc train`: the world read from MPI (this process's rank and the
//! number of ranks), checked against `--ranks`, and the check that every rank was started alike.
//!
//! Whether this process was started by an MPI launcher is the one thing read from the
//! environment (the launcher's own variables, never a qatc setting): MPI is initialized only
//! then, so a plain `qatc train` never touches it.

use std::sync::Arc;

use qatc_runtime::comm::{Communicator, OneRank};
use sha2::{Digest, Sha256};

use crate::config::RunConfig;

/// The variables an MPI launcher sets in each rank's environment: Open MPI's, then MPICH's
/// Hydra and PMIx's.
const LAUNCHED_BY: [&str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"];

/// This process's place in the run's world.
pub struct World {
    pub comm: Arc<dyn Communicator>,
}

impl World {
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
    pub fn size(&self) -> usize {
        self.comm.size()
    }
    /// Whether this rank prints, logs and writes (rank 0).
    pub fn leads(&self) -> bool {
        self.rank() == 0
    }
}

/// Joins MPI's world when an MPI launcher started this process, else the world of one; `ranks`
/// (`--ranks`, when given) must agree with it.
pub fn join(ranks: Option<usize>) -> anyhow::Result<World> {
    let launched = LAUNCHED_BY.iter().any(|v| std::env::var_os(v).is_some());
    let comm: Arc<dyn Communicator> = if launched { mpi_world()? } else { Arc::new(OneRank) };
    let size = comm.size();
    match ranks {
        Some(n) if n != size && size == 1 => {
            anyhow::bail!("--ranks {n}: this process is the only rank; start the ranks with `mpirun -np {n} qatc train ...`")
        }
        Some(n) if n != size => anyhow::bail!("--ranks {n}, but mpirun started {size} ranks: give the same number (or leave --ranks out)"),
        _ => Ok(World { comm }),
    }
}

#[cfg(feature = "mpi")]
fn mpi_world() -> anyhow::Result<Arc<dyn Communicator>> {
    Ok(Arc::new(qatc_runtime::comm::mpi::MpiComm::init()?))
}

#[cfg(not(feature = "mpi"))]
fn mpi_world() -> anyhow::Result<Arc<dyn Communicator>> {
    anyhow::bail!("started by an MPI launcher, but this qatc was built without MPI (the `mpi` feature): build it with `make build`")
}

/// Refuses, on every rank, a run whose ranks were started with different options or models:
/// each rank's configuration and a checksum of its model file are gathered, and a rank that
/// differs from rank 0 is named with the first option that differs.
pub fn check_alike(world: &World, cfg: &RunConfig, model_sum: [u8; 32]) -> anyhow::Result<()> {
    if world.size() == 1 {
        return Ok(());
    }
    let json = cfg.to_json();
    let lens = gather(world, &(json.len() as u64).to_le_bytes())?;
    let longest = lens.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).max().unwrap_or(0) as usize;
    let mut mine = json.into_bytes();
    mine.resize(longest, b' ');
    mine.extend_from_slice(&model_sum);
    let all = gather(world, &mine)?;
    let each: Vec<&[u8]> = all.chunks_exact(mine.len()).collect();
    let lead = each[0];
    for (r, other) in each.iter().enumerate().skip(1) {
        if other == &lead {
            continue;
        }
        let parse = |b: &[u8]| RunConfig::from_json(String::from_utf8_lossy(&b[..longest]).trim_end(), std::path::Path::new("rank"));
        let (a, b) = (parse(lead)?, parse(other)?);
        let why = match crate::config::first_difference(&a, &b) {
            Some((field, was, is)) => {
                format!("rank {r} was started with {field} {is}, rank 0 with {was}: start every rank with the same options")
            }
            None => format!("rank {r}'s model file differs from rank 0's (their checksums differ): start every rank on the same model"),
        };
        refuse_together(world, &why);
    }
    Ok(())
}

/// Every rank prints `why` as the one line of a refusal (main's form: `error:`, exit code 2),
/// then waits for the others before exiting: the first to exit would have mpirun end the rest
/// before they said why.
fn refuse_together(world: &World, why: &str) -> ! {
    crate::cli::print_error(why);
    let _ = gather(world, &[0]);
    std::process::exit(2)
}

/// Every rank's `text` (of any length), in rank order.
pub fn gather_text(world: &World, text: &str) -> anyhow::Result<Vec<String>> {
    if world.size() == 1 {
        return Ok(vec![text.to_string()]);
    }
    let lens = gather(world, &(text.len() as u64).to_le_bytes())?;
    let lens: Vec<usize> = lens.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as usize).collect();
    // at least a byte: MPI refuses a gather of none
    let longest = lens.iter().copied().max().unwrap_or(0).max(1);
    let mut mine = text.as_bytes().to_vec();
    mine.resize(longest, 0);
    let all = gather(world, &mine)?;
    Ok(all.chunks_exact(longest).zip(&lens).map(|(c, &n)| String::from_utf8_lossy(&c[..n]).into_owned()).collect())
}

/// What each rank did on its own (read or wrote its shard), agreed on: when any rank failed,
/// every rank refuses with the first failure's line (`refuse_together`: exit code 2), so that a
/// rank never goes on alone to wait in a collective for one that stopped.
pub fn agree(world: &World, outcome: anyhow::Result<()>) -> anyhow::Result<()> {
    if world.size() == 1 {
        return outcome;
    }
    let mine = match &outcome {
        Ok(()) => String::new(),
        Err(e) => format!("rank {}: {e:#}", world.rank()).replace('\n', " "),
    };
    let all = gather_text(world, &mine)?;
    match all.into_iter().find(|s| !s.is_empty()) {
        Some(why) => refuse_together(world, &why),
        None => Ok(()),
    }
}

/// Every rank's `bytes` (the same length on all), in rank order.
pub fn gather(world: &World, bytes: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut all = vec![0u8; bytes.len() * world.size()];
    world.comm.all_gather_bytes(bytes, &mut all)?;
    Ok(all)
}

/// A SHA-256 of the model file at `path` (a directory: its files in name order).
pub fn model_checksum(path: &std::path::Path) -> anyhow::Result<[u8; 32]> {
    let mut h = Sha256::new();
    let mut files = vec![path.to_path_buf()];
    if path.is_dir() {
        files = std::fs::read_dir(path)?.map(|e| e.map(|e| e.path())).collect::<Result<_, _>>()?;
        files.retain(|p| p.is_file());
        files.sort();
    }
    for f in files {
        let mut r = std::io::BufReader::new(std::fs::File::open(&f).map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?);
        std::io::copy(&mut r, &mut h)?;
    }
    Ok(h.finalize().into())
}
