//! A device queue: one thread per directory that owns an engine. Ops from every batch sent to
//! it are pushed as soon as there is room and each batch is handed back when its last op
//! completes, so the device stays busy across batch boundaries.
//!
//! Reads go first: they have their own backlog, pushed before any write, and a quarter of the
//! engine's depth that writes never take, and the thread never blocks on completions for longer
//! than `WAKE`, so a read that arrives while a write is slow (or stuck) is pushed at once instead
//! of waiting for that write (a load never waits behind a background write-behind).

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TryRecvError};

use super::{Completion, IoEngine, IoFailure, IoOp};

struct Job {
    ops: Vec<IoOp>,
    reply: Sender<Vec<IoOp>>,
}

struct Active {
    job: Job,
    /// Outcomes land here, not in `job.ops`, while engine threads may still read sibling ops;
    /// they are copied into the ops once the last one completed.
    results: Vec<Option<Result<(), IoFailure>>>,
    remaining: usize,
}

pub struct DeviceQueue {
    tx: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    inflight: Arc<AtomicUsize>,
    engine_name: &'static str,
}

/// Bytes of reads, and of writes, kept in flight per device (at least one op always is).
const MAX_INFLIGHT_BYTES: usize = 64 << 20;
/// Longest wait for completions before the thread looks for newly submitted ops.
const WAKE: std::time::Duration = std::time::Duration::from_millis(2);

/// Ops waiting to be pushed and the bytes in flight, for one direction.
#[derive(Default)]
struct Lane {
    backlog: VecDeque<(usize, usize)>,
    inflight: usize,
    bytes: usize,
}

impl Lane {
    fn has_room(&self, cap: usize) -> bool {
        self.inflight < cap && (self.inflight == 0 || self.bytes < MAX_INFLIGHT_BYTES)
    }
}

fn tag(slot: usize, op: usize) -> u64 {
    ((slot as u64) << 32) | op as u64
}

fn untag(tag: u64) -> (usize, usize) {
    ((tag >> 32) as usize, (tag & 0xffff_ffff) as usize)
}

fn serve(rx: Receiver<Job>, mut engine: Box<dyn IoEngine>, fd: RawFd, gauge: Arc<AtomicUsize>) {
    let mut slots: Vec<Option<Active>> = Vec::new();
    // [reads, writes]
    let mut lanes: [Lane; 2] = Default::default();
    let mut done: Vec<Completion> = Vec::new();
    let mut open = true;
    let capacity = engine.capacity();
    // Writes never take the last quarter of the depth: a read always finds room.
    let write_cap = (capacity - capacity / 4).max(1);
    let admit = |job: Job, slots: &mut Vec<Option<Active>>, lanes: &mut [Lane; 2]| {
        let n = job.ops.len();
        if n == 0 {
            let _ = job.reply.send(job.ops);
            return;
        }
        let slot = slots.iter().position(Option::is_none).unwrap_or_else(|| {
            slots.push(None);
            slots.len() - 1
        });
        for (i, op) in job.ops.iter().enumerate() {
            lanes[op.write as usize].backlog.push_back((slot, i));
        }
        slots[slot] = Some(Active { job, results: vec![None; n], remaining: n });
    };
    loop {
        let idle = lanes.iter().all(|l| l.inflight == 0 && l.backlog.is_empty());
        if idle {
            if !open {
                return;
            }
            match rx.recv() {
                Ok(job) => admit(job, &mut slots, &mut lanes),
                Err(_) => return,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(job) => admit(job, &mut slots, &mut lanes),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        // Bounded by ops (the engine's depth) and by bytes per direction: a few large merged
        // ops already keep a device busy, and queueing hundreds of MiB more only adds latency.
        for (w, cap) in [(0usize, capacity), (1, write_cap)] {
            while lanes[0].inflight + lanes[1].inflight < capacity && lanes[w].has_room(cap) {
                let Some(&(slot, op)) = lanes[w].backlog.front() else { break };
                let Some(active) = slots[slot].as_ref() else {
                    lanes[w].backlog.pop_front();
                    continue;
                };
                let io = &active.job.ops[op];
                if !engine.push(fd, io, tag(slot, op)) {
                    break;
                }
                lanes[w].backlog.pop_front();
                lanes[w].inflight += 1;
                lanes[w].bytes += io.expected_len();
            }
        }
        if lanes[0].inflight + lanes[1].inflight == 0 {
            continue;
        }
        engine.reap_for(1, &mut done, WAKE);
        for (t, result) in done.drain(..) {
            let (slot, op) = untag(t);
            // Only an op that is in flight may complete (never count one twice).
            let in_flight =
                slots.get(slot).and_then(Option::as_ref).is_some_and(|a| a.results.get(op) == Some(&None));
            if !in_flight {
                tracing::error!("completion for an op that is not in flight ({slot}/{op}) ignored");
                continue;
            }
            gauge.fetch_sub(1, Ordering::Relaxed);
            let finished = match slots[slot].as_mut() {
                Some(active) => {
                    let io = &active.job.ops[op];
                    let lane = &mut lanes[io.write as usize];
                    lane.inflight -= 1;
                    lane.bytes -= io.expected_len();
                    active.results[op] = Some(result);
                    active.remaining -= 1;
                    active.remaining == 0
                }
                None => false,
            };
            if finished {
                if let Some(mut active) = slots[slot].take() {
                    for (op, r) in active.job.ops.iter_mut().zip(active.results) {
                        op.result = r.unwrap_or(Err(IoFailure::Errno(libc::EIO)));
                    }
                    let _ = active.job.reply.send(active.job.ops);
                }
            }
        }
    }
}

impl DeviceQueue {
    /// Start the queue's thread; every op submitted runs on `fd`, which must stay open until
    /// the queue is dropped.
    pub fn spawn(name: String, engine: Box<dyn IoEngine>, fd: RawFd) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let inflight = Arc::new(AtomicUsize::new(0));
        let engine_name = engine.name();
        let gauge = inflight.clone();
        let thread = std::thread::Builder::new().name(name).spawn(move || serve(rx, engine, fd, gauge))?;
        Ok(DeviceQueue { tx: Some(tx), thread: Some(thread), inflight, engine_name })
    }

    pub fn engine_name(&self) -> &'static str {
        self.engine_name
    }

    /// Ops queued or in flight on this device.
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
