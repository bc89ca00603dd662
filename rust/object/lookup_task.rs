//! Lookups submitted to the tier's runtime instead of run on the caller's thread: the scheduler
//! asks, gets a `LookupHandle` at once and polls it (`done`) between steps. At most
//! `LOOKUPS_AT_ONCE` lookups of one tier run at a time (the rest wait for a permit on the
//! runtime, not on a thread); each is the blocking call's work exactly (`lookup_chain`), and a
//! handle dropped before its answer aborts its lookup. `close` fails the queued ones and waits
//! for the running ones (each request is bounded by the tier's budget).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{self, StreamExt};
use parking_lot::{Condvar, Mutex};
use tokio::task::AbortHandle;

use super::error::{ObjectError, Result};
use super::ops::Ctx;
use super::{ObjectTier, Shared};
use crate::tier::TimedOut;

/// Lookups of one tier running at once, chains and probes alike (the width of the thread pool
/// they replace).
pub const LOOKUPS_AT_ONCE: usize = 4;
/// One-block chains one presence probe asks at once.
pub const PROBE_WIDTH: usize = 8;

/// A finished lookup's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Leading blocks of the chain that are stored (`lookup_chain`).
    Matched(usize),
    /// Per key: the one-block chain is stored (`lookup_chain([key]) == 1`).
    Present(Vec<bool>),
}

/// Why a lookup has no answer (kept to be reported on every ask: `ObjectError` is not `Clone`).
#[derive(Clone, Debug)]
enum Failed {
    /// The tier was closed before the lookup could start.
    Closed,
    /// The lookup's task ended without answering (it panicked, or the runtime went away).
    Lost,
}

impl From<Failed> for ObjectError {
    fn from(f: Failed) -> Self {
        match f {
            Failed::Closed => ObjectError::Closed,
            Failed::Lost => ObjectError::Request("object tier lookup ended without an answer".into()),
        }
    }
}

type Outcome = std::result::Result<Answer, Failed>;

#[derive(Default)]
struct Slot {
    outcome: Mutex<Option<Outcome>>,
    cond: Condvar,
}

impl Slot {
    fn set(&self, outcome: Outcome) {
        let mut slot = self.outcome.lock();
        if slot.is_none() {
            *slot = Some(outcome);
            self.cond.notify_all();
        }
    }
}

/// The task's side: answers the slot, or `Lost` if the task is dropped first (a waiter never
/// waits for a task that no longer exists).
struct Answering(Arc<Slot>);

impl Drop for Answering {
    fn drop(&mut self) {
        self.0.set(Err(Failed::Lost));
    }
}

/// One submitted lookup. Dropping it before the answer aborts the lookup.
pub struct LookupHandle {
    slot: Arc<Slot>,
    task: AbortHandle,
}

impl LookupHandle {
    /// The answer is in (never blocks).
    pub fn done(&self) -> bool {
        self.slot.outcome.lock().is_some()
    }

    /// Wait for the answer, at most `timeout` (`None`: until it comes).
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Answer> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut outcome = self.slot.outcome.lock();
        loop {
            if let Some(o) = outcome.as_ref() {
                return o.clone().map_err(ObjectError::from);
            }
            match deadline {
                None => self.slot.cond.wait(&mut outcome),
                Some(d) => {
                    if self.slot.cond.wait_until(&mut outcome, d).timed_out() && outcome.is_none() {
                        let waited = timeout.unwrap_or_default().as_secs_f64();
                        return Err(ObjectError::Timeout(TimedOut(waited)));
                    }
                }
            }
        }
    }
}

impl Drop for LookupHandle {
    fn drop(&mut self) {
        if !self.done() {
            self.task.abort();
        }
    }
}

impl ObjectTier {
    /// `lookup_chain(keys)` on the runtime: returns at once; the handle answers `Matched`.
    pub fn submit_lookup_chain(&self, keys: Vec<Vec<u8>>) -> Result<LookupHandle> {
        self.spawn_lookup(move |ctx, shared| async move {
            Answer::Matched(shared.lookup_matched(&ctx, &keys).await)
        })
    }

    /// Whether each key is stored as a one-block chain (`lookup_chain([key]) == 1`), at most
    /// `PROBE_WIDTH` at once, on the runtime: returns at once; the handle answers `Present`.
    pub fn submit_present(&self, keys: Vec<Vec<u8>>) -> Result<LookupHandle> {
        self.spawn_lookup(move |ctx, shared| async move {
            let (ctx, shared) = (&ctx, &shared);
            let found: Vec<bool> = stream::iter(keys)
                .map(|key| async move { shared.lookup_matched(ctx, std::slice::from_ref(&key)).await == 1 })
                .buffered(PROBE_WIDTH)
                .collect()
                .await;
            Answer::Present(found)
        })
    }

    /// Run `work` on the runtime once a lookup permit is free; `close` waits for it (the
    /// in-flight guard) and fails it if it had not started.
    fn spawn_lookup<W, F>(&self, work: W) -> Result<LookupHandle>
    where
        W: FnOnce(Ctx, Arc<Shared>) -> F,
        F: std::future::Future<Output = Answer> + Send + 'static,
    {
        let (rt, ctx) = self.client()?;
        let slot = Arc::new(Slot::default());
        let answering = Answering(slot.clone());
        let running = ctx.inflight.enter();
        let permits = ctx.lookups.clone();
        let work = work(ctx, self.shared.clone());
        let task = rt.spawn(async move {
            let _running = running;
            let outcome = match permits.acquire_owned().await {
                Ok(_permit) => Ok(work.await),
                Err(_) => Err(Failed::Closed), // closed while queued
            };
            answering.0.set(outcome);
        });
        Ok(LookupHandle { slot, task: task.abort_handle() })
    }
}
