//! The open-time probe, callable again as `check`: one listing request proves the endpoint,
//! bucket and credentials work, and a failure names which (never the secret).

use super::error::{ObjectError, Result};
use super::ObjectTier;

impl ObjectTier {
    /// Prove with one listing request that the store answers and accepts the credentials
    /// (what `open` does for a remote store; callable again, e.g. by a health check).
    pub fn check(&self) -> Result<()> {
        self.probe()
    }

    pub(super) fn probe(&self) -> Result<()> {
        let (rt, ctx) = self.client()?;
        let probe = self.prefix.clone().join("b");
        rt.block_on(ctx.probe(probe)).map_err(|e| {
            let text = e.to_string();
            let has = |needles: &[&str]| needles.iter().any(|n| text.contains(n));
            let why = match &e {
                object_store::Error::PermissionDenied { .. }
                | object_store::Error::Unauthenticated { .. } => "the credentials were refused",
                _ if has(&[
                    "403 Forbidden",
                    "401 Unauthorized",
                    "SignatureDoesNotMatch",
                    "InvalidAccessKeyId",
                ]) =>
                {
                    "the credentials were refused"
                }
                object_store::Error::NotFound { .. } => "the bucket does not exist",
                _ if has(&["NoSuchBucket", "404 Not Found"]) => "the bucket does not exist",
                _ => "the store did not answer",
            };
            ObjectError::Config(ctx.message(format!("{why}: {}", text.replace('\n', " "))))
        })
    }
}
