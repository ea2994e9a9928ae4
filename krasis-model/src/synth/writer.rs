//! Streaming safetensors writer: shards planned up front (all sizes are known), each file written
//! to `<name>.tmp`, synced and renamed. Chunks are generated in parallel and written in order by
//! the caller's thread through a bounded reorder window, so memory stays at a couple of chunks per
//! worker whatever the model size.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard};

use super::init::{layer_of, SynthTensor};
use crate::error::{ModelError, Result};

/// One output file: a contiguous run of the tensor list.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ShardPlan {
    pub file_name: String,
    pub tensors: std::ops::Range<usize>,
    /// Bytes of the data section.
    pub data_bytes: u64,
}

/// Group key of a tensor: its layer, with the embedding before and the tail after all layers.
fn group_of(name: &str, num_layers: usize) -> usize {
    match layer_of(name) {
        Some(l) => l + 1,
        None if name.contains("model.embed_tokens") => 0,
        None => num_layers + 1,
    }
}

/// Cut the tensor list into shards: a new shard starts at a group (layer) boundary once the
/// current one holds at least `limit` bytes.
pub(crate) fn plan_shards(tensors: &[SynthTensor], num_layers: usize, limit: u64) -> Vec<ShardPlan> {
    let mut runs: Vec<(std::ops::Range<usize>, u64)> = Vec::new();
    let mut start = 0;
    let mut bytes = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        if i > start && bytes >= limit {
            let prev = group_of(&tensors[i - 1].spec.name, num_layers);
            if group_of(&t.spec.name, num_layers) != prev {
                runs.push((start..i, bytes));
                start = i;
                bytes = 0;
            }
        }
        bytes += t.bytes();
    }
    runs.push((start..tensors.len(), bytes));
    let n = runs.len();
    runs.into_iter()
        .enumerate()
        .map(|(k, (tensors, data_bytes))| ShardPlan {
            file_name: format!("model-{:05}-of-{:05}.safetensors", k + 1, n),
            tensors,
            data_bytes,
        })
        .collect()
}

/// The header of a shard: 8-byte length + JSON padded with spaces to a multiple of 8.
pub(crate) fn shard_header(tensors: &[SynthTensor]) -> Vec<u8> {
    let mut json = String::from("{\"__metadata__\":{\"format\":\"pt\"}");
    let mut off = 0u64;
    for t in tensors {
        let end = off + t.bytes();
        let name = serde_json::to_string(&t.spec.name).expect("string serialises");
        let shape: Vec<String> = t.spec.shape.iter().map(|d| d.to_string()).collect();
        json.push_str(&format!(
            ",{name}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{off},{end}]}}",
            t.dtype.name(),
            shape.join(",")
        ));
        off = end;
    }
    json.push('}');
    let padded = json.len().next_multiple_of(8);
    json.extend(std::iter::repeat_n(' ', padded - json.len()));
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out
}

pub(crate) fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(".tmp");
    PathBuf::from(s)
}

/// Write `bytes` to `path` via `path.tmp` + fsync + rename.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = tmp_path(path);
    let mut f = File::create(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
    f.write_all(bytes).map_err(|e| ModelError::io(&tmp, e))?;
    f.sync_all().map_err(|e| ModelError::io(&tmp, e))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| ModelError::io(path, e))
}

/// Chunks in flight between the generators and the writer.
struct Pipeline {
    /// Next job a generator may take.
    next_job: usize,
    /// Jobs the writer has taken (all below are written or being written).
    taken: usize,
    /// Finished chunks waiting for their turn, by job index.
    ready: BTreeMap<usize, Vec<u8>>,
    /// Written buffers, for reuse (no page-fault churn on fresh allocations).
    free: Vec<Vec<u8>>,
    /// The writer is gone (done or failed): generators stop.
    stop: bool,
}

fn lock(m: &Mutex<Pipeline>) -> MutexGuard<'_, Pipeline> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sets `stop` when the writer leaves, however it leaves, so no generator waits forever.
struct StopOnDrop<'a>(&'a (Mutex<Pipeline>, Condvar));

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        let (m, cv) = self.0;
        lock(m).stop = true;
        cv.notify_all();
    }
}

/// Write every shard of `plan` into `dir`. `progress(n)` is told about each `n` bytes written.
///
/// One generator thread per rayon worker (`rayon::current_num_threads()`) takes chunk jobs in
/// file order, at most `2 × threads` ahead of the writer; the caller's thread writes them in
/// order as each becomes ready. Peak memory ≈ two chunks (4 MiB) per worker.
pub(crate) fn write_shards(
    dir: &Path,
    tensors: &[SynthTensor],
    plan: &[ShardPlan],
    seed: u64,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<u64> {
    // Every chunk of every tensor, in file order.
    let jobs: Vec<(usize, usize)> =
        tensors.iter().enumerate().flat_map(|(i, t)| (0..t.chunks()).map(move |c| (i, c))).collect();
    let threads = rayon::current_num_threads().max(1);
    let window = 2 * threads;
    let shared = (
        Mutex::new(Pipeline { next_job: 0, taken: 0, ready: BTreeMap::new(), free: Vec::new(), stop: false }),
        Condvar::new(),
    );
    let mut written = 0u64;
    std::thread::scope(|scope| -> Result<()> {
        let _stop = StopOnDrop(&shared);
        for _ in 0..threads {
            let (shared, jobs) = (&shared, &jobs);
            scope.spawn(move || {
                let (m, cv) = shared;
                loop {
                    let (j, mut buf) = {
                        let mut st = lock(m);
                        loop {
                            if st.stop || st.next_job >= jobs.len() {
                                return;
                            }
                            if st.next_job < st.taken + window {
                                break;
                            }
                            st = cv.wait(st).unwrap_or_else(|e| e.into_inner());
                        }
                        st.next_job += 1;
                        (st.next_job - 1, st.free.pop().unwrap_or_default())
                    };
                    let (i, c) = jobs[j];
                    buf.clear();
                    tensors[i].gen_chunk(seed, c, &mut buf);
                    lock(m).ready.insert(j, buf);
                    cv.notify_all();
                }
            });
        }
        // The writer: takes job j once it is ready; jobs are in file order.
        let (m, cv) = &shared;
        let mut next = 0usize;
        let mut take = || -> Vec<u8> {
            let mut st = lock(m);
            let buf = loop {
                if let Some(b) = st.ready.remove(&next) {
                    break b;
                }
                st = cv.wait(st).unwrap_or_else(|e| e.into_inner());
            };
            next += 1;
            st.taken = next;
            drop(st);
            cv.notify_all();
            buf
        };
        let give_back = |buf: Vec<u8>| lock(m).free.push(buf);
        let mut job = 0usize;
        // The previous shard's fsync + rename, overlapped with writing the next shard.
        let mut finishing: Option<std::thread::ScopedJoinHandle<'_, Result<()>>> = None;
        for shard in plan {
            let path = dir.join(&shard.file_name);
            let tmp = tmp_path(&path);
            let io = |e| ModelError::io(&tmp, e);
            let mut f = File::create(&tmp).map_err(io)?;
            let header = shard_header(&tensors[shard.tensors.clone()]);
            f.write_all(&header).map_err(io)?;
            written += header.len() as u64;
            progress(header.len() as u64);
            // The jobs of this shard's tensors.
            while job < jobs.len() && shard.tensors.contains(&jobs[job].0) {
                let buf = take();
                job += 1;
                f.write_all(&buf).map_err(io)?;
                written += buf.len() as u64;
                progress(buf.len() as u64);
                give_back(buf);
            }
            if let Some(h) = finishing.take() {
                h.join().expect("fsync thread does not panic")?;
            }
            finishing = Some(scope.spawn(move || {
                f.sync_all().map_err(|e| ModelError::io(&tmp, e))?;
                drop(f);
                std::fs::rename(&tmp, &path).map_err(|e| ModelError::io(&path, e))
            }));
        }
        match finishing {
            Some(h) => h.join().expect("fsync thread does not panic"),
            None => Ok(()),
        }
    })?;
    Ok(written)
}
