//! One block's request, with the tier's bounds: a permit from the tier-wide semaphore, the
//! per-block time budget (retries included), and `object_store` errors mapped to statuses.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{
    GetResultPayload, ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload,
};
use tokio::sync::Semaphore;

use super::codec::{decode_into, DecodeError};
use super::stats::{bump, ObjectStats};
use super::stream_decode::StreamDecode;
use crate::tier::{BlockResult, RawBuf, Status};

/// What every request of one tier shares.
#[derive(Clone)]
pub struct Ctx {
    pub store: Arc<dyn ObjectStore>,
    pub permits: Arc<Semaphore>,
    /// Lookups submitted to the runtime that may run at once (`lookup_task`); closed by `close`.
    pub lookups: Arc<Semaphore>,
    pub stats: Arc<ObjectStats>,
    pub budget: Duration,
    /// Where requests go, for messages (no credentials).
    pub target: Arc<str>,
    pub secret: Option<Arc<str>>,
    pub inflight: Arc<InFlight>,
}

/// Batches of this process still running: `close` waits for them (each request is bounded).
#[derive(Default)]
pub struct InFlight {
    count: parking_lot::Mutex<usize>,
    idle: parking_lot::Condvar,
}

pub struct InFlightGuard(Arc<InFlight>);

impl InFlight {
    pub fn enter(self: &Arc<Self>) -> InFlightGuard {
        *self.count.lock() += 1;
        InFlightGuard(self.clone())
    }

    pub fn wait_idle(&self) {
        let mut n = self.count.lock();
        while *n > 0 {
            self.idle.wait(&mut n);
        }
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        let mut n = self.0.count.lock();
        *n -= 1;
        if *n == 0 {
            self.0.idle.notify_all();
        }
    }
}

pub enum Outcome<T> {
    Done(T),
    Failed(String),
    TimedOut,
}

impl Ctx {
    pub fn message(&self, e: impl std::fmt::Display) -> String {
        let msg = format!("{}: {e}", self.target);
        match &self.secret {
            Some(s) if s.len() >= 4 => msg.replace(&**s, "<redacted>"),
            _ => msg,
        }
    }

    /// Run one request under a permit and the block's budget.
    async fn bounded<T, F>(&self, fut: F) -> Outcome<object_store::Result<T>>
    where
        F: Future<Output = object_store::Result<T>>,
    {
        let Ok(_permit) = self.permits.acquire().await else {
            return Outcome::Failed("the object tier is closed".into());
        };
        match tokio::time::timeout(self.budget, fut).await {
            Ok(r) => Outcome::Done(r),
            Err(_) => {
                bump(&self.stats.timeouts, 1);
                Outcome::TimedOut
            }
        }
    }

    fn io_error(&self, msg: String) -> BlockResult {
        bump(&self.stats.io_errors, 1);
        BlockResult::failed(Status::IoError, msg)
    }

    fn timed_out(&self, what: &str) -> BlockResult {
        self.io_error(self.message(format!("{what} timed out after {:.3}s", self.budget.as_secs_f64())))
    }

    /// Create the object unless it exists: the first writer of a key wins.
    pub async fn put(&self, path: Path, body: Vec<u8>, raw_len: u64) -> BlockResult {
        let sent = body.len() as u64;
        let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
        let payload = PutPayload::from(body);
        bump(&self.stats.put_requests, 1);
        bump(&self.stats.put_body_bytes, sent);
        match self.bounded(self.store.put_opts(&path, payload, opts)).await {
            Outcome::Done(Ok(_)) => {
                bump(&self.stats.puts_ok, 1);
                BlockResult::new(Status::Ok, raw_len)
            }
            Outcome::Done(Err(
                object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. },
            )) => {
                bump(&self.stats.puts_exists, 1);
                BlockResult::new(Status::Deduped, raw_len)
            }
            Outcome::Done(Err(e)) => self.io_error(self.message(e)),
            Outcome::Failed(msg) => self.io_error(msg),
            Outcome::TimedOut => self.timed_out("put"),
        }
    }

    /// Fetch, verify and copy one block into `out`. A streamed body is decoded as it arrives,
    /// straight into `out` (`stream_decode`: one copy of the payload); a local file's is read
    /// whole. Any failure leaves `out` zeroed: no plausible bytes behind a failed read.
    pub async fn get(&self, path: Path, key: &[u8], out: RawBuf) -> BlockResult {
        bump(&self.stats.get_requests, 1);
        let outcome = self.bounded(self.fetch_into(&path, key, out)).await;
        let zero = || {
            if out.len > 0 {
                // SAFETY: as in `fetch_into`; the fetch future is finished or dropped here.
                unsafe { out.as_mut_slice() }.fill(0);
            }
        };
        match outcome {
            Outcome::Done(Ok(Ok(n))) => {
                bump(&self.stats.gets_ok, 1);
                BlockResult::new(Status::Ok, n as u64)
            }
            Outcome::Done(Ok(Err(DecodeError::Corrupt(why)))) => {
                zero();
                bump(&self.stats.gets_corrupt, 1);
                BlockResult::failed(Status::Corrupt, self.message(format!("{path}: {why}")))
            }
            Outcome::Done(Ok(Err(DecodeError::BadBuffer(why)))) => {
                zero();
                BlockResult::failed(Status::BadBuffer, why)
            }
            Outcome::Done(Err(object_store::Error::NotFound { .. })) => {
                bump(&self.stats.gets_not_found, 1);
                BlockResult::new(Status::NotFound, 0)
            }
            Outcome::Done(Err(e)) => {
                zero();
                self.io_error(self.message(e))
            }
            Outcome::Failed(msg) => self.io_error(msg),
            Outcome::TimedOut => {
                zero();
                self.timed_out("get")
            }
        }
    }

    /// The request and the decode of one get: an `object_store` error, or the decode's answer.
    async fn fetch_into(
        &self,
        path: &Path,
        key: &[u8],
        out: RawBuf,
    ) -> object_store::Result<Result<usize, DecodeError>> {
        let got = self.store.get(path).await?;
        // SAFETY: the submitter keeps `out` valid and unaliased until the batch completes,
        // and the batch completes only after this future has finished (or was dropped).
        // An empty buffer may come with a null address: never made a slice.
        let dst: &mut [u8] = if out.len == 0 { &mut [] } else { unsafe { out.as_mut_slice() } };
        if matches!(got.payload, GetResultPayload::Stream(_)) {
            let mut body = got.into_stream();
            let mut decode = StreamDecode::new(key, dst);
            while let Some(chunk) = body.next().await {
                let chunk = chunk?;
                bump(&self.stats.get_body_bytes, chunk.len() as u64);
                if let Err(e) = decode.feed(&chunk) {
                    return Ok(Err(e));
                }
            }
            return Ok(decode.finish());
        }
        let body = got.bytes().await?;
        bump(&self.stats.get_body_bytes, body.len() as u64);
        Ok(decode_into(key, &body, dst))
    }

    /// Whether the object exists: `Ok(bool)`, or the error that kept us from knowing.
    pub async fn exists(&self, path: Path) -> Result<bool, String> {
        bump(&self.stats.head_requests, 1);
        match self.bounded(self.store.head(&path)).await {
            Outcome::Done(Ok(_)) => Ok(true),
            Outcome::Done(Err(object_store::Error::NotFound { .. })) => Ok(false),
            Outcome::Done(Err(e)) => Err(self.message(e)),
            Outcome::Failed(msg) => Err(msg),
            Outcome::TimedOut => Err(self.message("head timed out")),
        }
    }

    pub async fn delete(&self, path: Path) -> Result<(), String> {
        bump(&self.stats.delete_requests, 1);
        match self.bounded(self.store.delete(&path)).await {
            Outcome::Done(Ok(())) | Outcome::Done(Err(object_store::Error::NotFound { .. })) => Ok(()),
            Outcome::Done(Err(e)) => Err(self.message(e)),
            Outcome::Failed(msg) => Err(msg),
            Outcome::TimedOut => Err(self.message("delete timed out")),
        }
    }

    /// One listing request at open: proves the endpoint, bucket and credentials work.
    pub async fn probe(&self, prefix: Path) -> Result<(), object_store::Error> {
        bump(&self.stats.list_requests, 1);
        match self.bounded(self.store.list_with_delimiter(Some(&prefix))).await {
            Outcome::Done(r) => r.map(|_| ()),
            Outcome::Failed(msg) => Err(object_store::Error::Generic { store: "flexkv", source: msg.into() }),
            Outcome::TimedOut => Err(object_store::Error::Generic {
                store: "flexkv",
                source: format!("no answer within {:.3}s", self.budget.as_secs_f64()).into(),
            }),
        }
    }

    /// A small object's bytes (manifests, the GC lease): `Ok(None)` when absent.
    pub async fn get_small(&self, path: &Path) -> Result<Option<bytes::Bytes>, String> {
        bump(&self.stats.get_requests, 1);
        let fetch = async { self.store.get(path).await?.bytes().await };
        match self.bounded(fetch).await {
            Outcome::Done(Ok(b)) => {
                bump(&self.stats.get_body_bytes, b.len() as u64);
                Ok(Some(b))
            }
            Outcome::Done(Err(object_store::Error::NotFound { .. })) => Ok(None),
            Outcome::Done(Err(e)) => Err(self.message(e)),
            Outcome::Failed(msg) => Err(msg),
            Outcome::TimedOut => Err(self.message("get timed out")),
        }
    }

    /// Write a small object; `create` makes it conditional. `Ok(false)`: it already existed.
    pub async fn put_small(&self, path: &Path, body: Vec<u8>, create: bool) -> Result<bool, String> {
        bump(&self.stats.put_requests, 1);
        bump(&self.stats.put_body_bytes, body.len() as u64);
        let mode = if create { PutMode::Create } else { PutMode::Overwrite };
        let opts = PutOptions { mode, ..Default::default() };
        match self.bounded(self.store.put_opts(path, PutPayload::from(body), opts)).await {
            Outcome::Done(Ok(_)) => Ok(true),
            Outcome::Done(Err(
                object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. },
            )) => Ok(false),
            Outcome::Done(Err(e)) => Err(self.message(e)),
            Outcome::Failed(msg) => Err(msg),
            Outcome::TimedOut => Err(self.message("put timed out")),
        }
    }

    /// Every object under `prefix` (the listing's pages count as one request each).
    pub async fn list(&self, prefix: &Path) -> Result<Vec<ObjectMeta>, String> {
        bump(&self.stats.list_requests, 1);
        let listing = self.store.list(Some(prefix)).try_collect::<Vec<_>>();
        match self.bounded(listing).await {
            Outcome::Done(Ok(v)) => Ok(v),
            Outcome::Done(Err(e)) => Err(self.message(e)),
            Outcome::Failed(msg) => Err(msg),
            Outcome::TimedOut => Err(self.message("list timed out")),
        }
    }
}
