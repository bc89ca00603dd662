//! Background collection on the tier's own runtime: a pass every `interval` by whichever
//! process holds the GC lease, as one task beside the tier's batches (no timer thread around
//! blocking calls). `close` stops it at once: a pass cut short leaves what a crashed collector
//! would, which the protocol allows (manifests go deepest first, blocks last).

use std::sync::{mpsc, Arc, Weak};
use std::time::Duration;

use tokio::sync::watch;

use super::error::{ObjectError, Result};
use super::gc::GcOptions;
use super::stats::bump;
use super::ObjectTier;

/// When and as whom the background passes run.
#[derive(Clone, Debug)]
pub struct GcSchedule {
    /// This process's name on the lease (host, pid, a random tag).
    pub holder: String,
    pub opts: GcOptions,
    pub interval: Duration,
    pub lease: Duration,
}

/// Longest `close` waits for a stopped task to let go (a request in flight ends at its
/// timeout anyway).
const STOP_WAIT: Duration = Duration::from_secs(30);

/// The running task's stop switch, and its end (the task drops its sender as it returns).
pub(super) struct GcTask {
    stop: watch::Sender<bool>,
    ended: mpsc::Receiver<()>,
}

impl GcTask {
    /// Stop the task and wait until it has returned: no GC request of this tier is sent after.
    pub(super) fn stop(self) {
        // No receiver left means the task already ended.
        let _ = self.stop.send(true);
        if let Err(mpsc::RecvTimeoutError::Timeout) = self.ended.recv_timeout(STOP_WAIT) {
            tracing::warn!("object tier GC task did not stop within {STOP_WAIT:?}");
        }
    }
}

impl ObjectTier {
    /// Start the background passes. The task holds the tier weakly: a tier dropped without
    /// `close` ends it at its next wake-up.
    pub fn start_gc(self: &Arc<Self>, schedule: GcSchedule) -> Result<()> {
        if schedule.lease < schedule.interval {
            return Err(ObjectError::Config(format!(
                "GC lease ({:?}) must be >= its interval ({:?}): the holder renews it once per interval",
                schedule.lease, schedule.interval
            )));
        }
        let (rt, _) = self.client()?;
        let mut slot = self.gc_task.lock();
        if slot.is_some() {
            return Err(ObjectError::Config("background GC is already running on this tier".into()));
        }
        let (stop, mut stopped) = watch::channel(false);
        let (ended_tx, ended) = mpsc::channel::<()>();
        let tier = Arc::downgrade(self);
        rt.spawn(async move {
            let _ended = ended_tx; // dropped as the task returns, cancelled or not
            loop {
                tokio::select! {
                    _ = stopped.changed() => return,
                    _ = tokio::time::sleep(schedule.interval) => {}
                }
                tokio::select! {
                    _ = stopped.changed() => return,
                    alive = pass(&tier, &schedule) => if !alive { return },
                }
            }
        });
        *slot = Some(GcTask { stop, ended });
        Ok(())
    }
}

/// One wake-up: take or renew the lease, collect if held. `false`: the tier is gone or closed.
async fn pass(tier: &Weak<ObjectTier>, schedule: &GcSchedule) -> bool {
    let Some(tier) = tier.upgrade() else { return false };
    let Ok((_, ctx)) = tier.client() else { return false };
    match tier.gc_lease_async(&ctx, &schedule.holder, schedule.lease).await {
        Ok(true) => match tier.gc_async(&ctx, &schedule.opts).await {
            Ok(report) => {
                bump(&tier.stats.gc_passes, 1);
                tracing::info!("object tier GC: {report:?}");
            }
            Err(msg) => {
                bump(&tier.stats.gc_pass_failures, 1);
                tracing::warn!("object tier GC pass failed (retried next interval): {msg}");
            }
        },
        Ok(false) => {}
        Err(e) => {
            bump(&tier.stats.gc_pass_failures, 1);
            tracing::warn!("object tier GC lease failed (retried next interval): {e}");
        }
    }
    true
}
