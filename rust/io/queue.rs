//! A device queue: one thread per directory that owns an engine and runs batches sent to it.
//! Jobs that queue up while a batch runs are merged into the next run (deeper queue, fewer
//! syscalls).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use super::{IoEngine, IoFailure, IoOp};

struct Job {
    ops: Vec<IoOp>,
    reply: Sender<Vec<IoOp>>,
}

pub struct DeviceQueue {
    tx: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    inflight: Arc<AtomicUsize>,
    engine_name: &'static str,
}

/// Most ops merged into one engine run.
const MAX_MERGED_OPS: usize = 4096;

impl DeviceQueue {
    pub fn spawn(name: String, mut engine: Box<dyn IoEngine>) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let inflight = Arc::new(AtomicUsize::new(0));
        let engine_name = engine.name();
        let gauge = inflight.clone();
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            while let Ok(first) = rx.recv() {
                let mut jobs = vec![first];
                let mut count = jobs[0].ops.len();
                while count < MAX_MERGED_OPS {
                    match rx.try_recv() {
                        Ok(job) => {
                            count += job.ops.len();
                            jobs.push(job);
                        }
                        Err(_) => break,
                    }
                }
                let sizes: Vec<usize> = jobs.iter().map(|j| j.ops.len()).collect();
                let mut all: Vec<IoOp> = Vec::with_capacity(count);
                let mut replies = Vec::with_capacity(jobs.len());
                for job in jobs {
                    all.extend(job.ops);
                    replies.push(job.reply);
                }
                engine.run(&mut all);
                gauge.fetch_sub(count, Ordering::Relaxed);
                let mut rest = all.into_iter();
                for (n, reply) in sizes.into_iter().zip(replies) {
                    let _ = reply.send(rest.by_ref().take(n).collect());
                }
            }
        })?;
        Ok(DeviceQueue { tx: Some(tx), thread: Some(thread), inflight, engine_name })
    }

    pub fn engine_name(&self) -> &'static str {
        self.engine_name
    }

    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Queue ops; the returned receiver yields them back with results filled in.
    pub fn submit(&self, ops: Vec<IoOp>) -> Receiver<Vec<IoOp>> {
        let (reply, rx) = crossbeam_channel::bounded(1);
        self.inflight.fetch_add(ops.len(), Ordering::Relaxed);
        if let Some(tx) = &self.tx {
            if let Err(err) = tx.send(Job { ops, reply: reply.clone() }) {
                // The device thread is gone: hand the ops back failed.
                let mut ops = err.into_inner().ops;
                self.inflight.fetch_sub(ops.len(), Ordering::Relaxed);
                for op in ops.iter_mut() {
                    op.result = Err(IoFailure::Errno(libc::EIO));
                }
                let _ = reply.send(ops);
            }
        }
        rx
    }
}

impl Drop for DeviceQueue {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
