//! The store's devices, one per cache directory: its data file, the queue (thread + I/O engine)
//! bound to that file, and its lock. Store code addresses bytes as (device, offset, iovecs)
//! and never sees a file descriptor; this layer resolves the file, merges adjacent ops and
//! runs them on each device's queue in parallel.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use super::data_file::DataFile;
use super::dir_lock::DirLock;
use crate::error::{Result, StoreError};
use crate::io::fault::{FaultPlan, FaultyEngine};
use crate::io::queue::DeviceQueue;
use crate::io::{build_engine, coalesce, EngineChoice, IoFailure, IoOp, MergedOp};

/// Which device an extent lives on (the journal's `Location::dir`).
pub type DeviceId = u16;

pub struct Device {
    // Declared before `data`: fields drop in order, so the queue's thread is joined before the
    // file its ops target is closed.
    queue: DeviceQueue,
    data: DataFile,
    path: PathBuf,
    lock: Mutex<Option<DirLock>>,
}

impl Device {
    /// Start the queue for `data` (an `io_engine` engine, wrapped by the fault injector when a
    /// plan fails or delays reads/writes).
    pub fn start(
        path: PathBuf,
        data: DataFile,
        lock: Option<DirLock>,
        engine: EngineChoice,
        queue_depth: u32,
        faults: Option<FaultPlan>,
        name: String,
    ) -> Result<Self> {
        let mut engine = build_engine(engine, queue_depth)?;
        if let Some(plan) = faults.filter(|p| p.reads || p.writes) {
            engine = Box::new(FaultyEngine::new(engine, plan));
        }
        let queue = DeviceQueue::spawn(name, engine, data.fd())
            .map_err(|e| StoreError::io("starting I/O thread", e))?;
        Ok(Device { queue, data, path, lock: Mutex::new(lock) })
    }
}

pub struct DeviceSet {
    devices: Vec<Device>,
}

impl DeviceSet {
    pub fn new(devices: Vec<Device>) -> Self {
        DeviceSet { devices }
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// The cache directory of device `dev` (for messages; the journal lives in device 0's).
    pub fn path(&self, dev: DeviceId) -> &Path {
        self.devices.get(dev as usize).map_or(Path::new("?"), |d| d.path.as_path())
    }

    pub fn engine_name(&self) -> &'static str {
        self.devices.first().map_or("none", |d| d.queue.engine_name())
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.devices.iter().map(|d| d.data.len).sum()
    }

    /// Ops queued or in flight over every device.
    pub fn inflight(&self) -> usize {
        self.devices.iter().map(|d| d.queue.inflight()).sum()
    }

    /// Whether every device's file bypasses the page cache.
    pub fn all_direct(&self) -> bool {
        self.devices.iter().all(|d| d.data.direct)
    }

    /// Make the data written to `dev` durable (fdatasync).
    pub fn sync_data(&self, dev: DeviceId) -> Result<()> {
        let d =
            self.devices.get(dev as usize).ok_or_else(|| StoreError::Device(format!("no device {dev}")))?;
        d.data
            .file
            .sync_data()
            .map_err(|e| StoreError::io(format!("fdatasync of {}", d.data.path.display()), e))
    }

    /// Give up every directory lock (after close: another process may take the directories).
    pub fn release_locks(&self) {
        for d in &self.devices {
            d.lock.lock().take();
        }
    }

    /// Run ops (each tagged with the caller's id and its device): merge adjacent ones per
    /// device, submit every device's queue, wait, and give each op its own outcome.
    pub fn run(
        &self,
        ops: Vec<(usize, DeviceId, IoOp)>,
    ) -> HashMap<usize, std::result::Result<(), IoFailure>> {
        let mut per_dev: Vec<Vec<(usize, IoOp)>> = (0..self.devices.len()).map(|_| Vec::new()).collect();
        let mut outcomes = HashMap::new();
        for (id, dev, op) in ops {
            match per_dev.get_mut(dev as usize) {
                Some(list) => list.push((id, op)),
                None => {
                    outcomes.insert(id, Err(IoFailure::Errno(libc::ENODEV)));
                }
            }
        }
        let mut pending = Vec::new();
        for (d, ops) in per_dev.into_iter().enumerate() {
            if !ops.is_empty() {
                let (meta, ops): (Vec<_>, Vec<IoOp>) =
                    coalesce(ops).into_iter().map(|m| ((m.ids, m.lens), m.op)).unzip();
                pending.push((meta, self.devices[d].queue.submit(ops)));
            }
        }
        for (meta, rx) in pending {
            let mut done = rx.recv().unwrap_or_default().into_iter();
            for (ids, lens) in meta {
                let op = done.next().unwrap_or_else(|| {
                    let mut failed = IoOp::new(0, Vec::new(), false);
                    failed.result = Err(IoFailure::Errno(libc::EIO));
                    failed
                });
                outcomes.extend(MergedOp { ids, lens, op }.split_result());
            }
        }
        outcomes
    }
}
