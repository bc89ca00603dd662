//! One task per block request: a batch's requests run as tasks of their own on the tier's
//! runtime, so the per-block CPU work (copying and hashing the body, encoding an upload) spreads
//! over its worker threads. Polled inside the batch's one task instead (`buffer_unordered` of
//! plain futures), every body of the batch was copied and hashed by one thread at a time.

use std::future::Future;

use futures::future;
use futures::stream::{self, Stream, StreamExt};

/// `work(item)` for every item, each spawned on the current runtime, at most `width` at once;
/// their outputs in completion order. A task that panicked yields nothing (its block stays
/// unanswered, and the batch reports it as failed).
pub fn fan_out<I, F, Fut, T>(items: I, width: usize, mut work: F) -> impl Stream<Item = T>
where
    I: IntoIterator,
    F: FnMut(I::Item) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let spawned = stream::iter(items).map(move |item| tokio::spawn(work(item)));
    spawned.buffer_unordered(width.max(1)).filter_map(|joined| future::ready(ok_or_log(joined)))
}

fn ok_or_log<T>(joined: Result<T, tokio::task::JoinError>) -> Option<T> {
    match joined {
        Ok(out) => Some(out),
        Err(e) => {
            tracing::error!("object tier request task failed: {e}");
            None
        }
    }
}
