//! What an object tier is opened with, and the `object_store` client it builds: the backend is
//! chosen by the URL's scheme (`s3://bucket/prefix`, `gs://`, `az://`, `file:///path`,
//! `memory://`). Credentials live only here; `Debug` and every message redact them.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, RetryConfig};

use super::error::{ObjectError, Result};
use crate::compression::Compression;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    S3,
    Gcs,
    Azure,
    File,
    Memory,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::S3 => "s3",
            Backend::Gcs => "gs",
            Backend::Azure => "az",
            Backend::File => "file",
            Backend::Memory => "memory",
        }
    }

    pub fn is_remote(self) -> bool {
        matches!(self, Backend::S3 | Backend::Gcs | Backend::Azure)
    }
}

#[derive(Clone)]
pub struct ObjectConfig {
    pub url: String,
    /// S3 only: a custom endpoint (MinIO, SeaweedFS, Ceph RGW); requests are path-style then.
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    /// Plain-HTTP endpoints are refused unless this is set (or `AWS_ALLOW_HTTP=true`).
    pub allow_http: bool,
    /// Without static credentials (arguments or `AWS_*`), S3 would ask the cloud's metadata
    /// address for them; only when this is set.
    pub allow_instance_metadata: bool,
    /// Requests in flight at once, across all batches of the tier.
    pub concurrency: usize,
    /// One request attempt's limit; a block's whole budget is `(retries + 1)` of them.
    pub timeout: Duration,
    /// Retries of transient failures (5xx, connection errors), with exponential backoff.
    pub retries: usize,
    pub compression: Compression,
    /// A process records a manifest's use (for GC) at most this often.
    pub touch_interval: Duration,
    /// How long a segment's upload claim holds off racing writers; `None`: derived from the
    /// block budget and the segment's size (`chain_put`).
    pub claim_lease: Option<Duration>,
}

impl fmt::Debug for ObjectConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectConfig")
            .field("url", &self.url)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("credentials", &self.secret_access_key.as_ref().map(|_| "<redacted>"))
            .field("allow_http", &self.allow_http)
            .field("concurrency", &self.concurrency)
            .field("timeout", &self.timeout)
            .field("retries", &self.retries)
            .field("compression", &self.compression)
            .field("claim_lease", &self.claim_lease)
            .finish()
    }
}

impl ObjectConfig {
    pub fn new(url: impl Into<String>) -> Self {
        ObjectConfig {
            url: url.into(),
            endpoint: None,
            region: None,
            access_key_id: None,
            secret_access_key: None,
            allow_http: false,
            allow_instance_metadata: false,
            concurrency: 32,
            timeout: Duration::from_secs(10),
            retries: 3,
            compression: Compression::None,
            touch_interval: Duration::from_secs(300),
            claim_lease: None,
        }
    }

    /// The longest a single block may take, retries and backoff included.
    pub fn block_budget(&self) -> Duration {
        self.timeout * (self.retries as u32 + 1) + self.backoff().max_backoff * self.retries as u32
    }

    fn backoff(&self) -> BackoffConfig {
        BackoffConfig {
            init_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(1),
            base: 2.0,
        }
    }

    fn retry(&self) -> RetryConfig {
        RetryConfig {
            backoff: self.backoff(),
            max_retries: self.retries,
            retry_timeout: self.timeout * (self.retries as u32 + 1),
        }
    }

    /// Every client option in one place: `with_client_options` replaces them all, so
    /// `allow_http` is set here and nowhere else.
    fn client_options(&self, allow_http: bool) -> ClientOptions {
        ClientOptions::new()
            .with_allow_http(allow_http)
            .with_timeout(self.timeout)
            .with_connect_timeout(self.timeout.min(Duration::from_secs(3)))
            .with_pool_max_idle_per_host(self.concurrency.max(1))
    }

    /// Where requests go, for messages: the endpoint or the URL, never a credential.
    pub fn target(&self) -> String {
        match &self.endpoint {
            Some(ep) => format!("{} at {ep}", self.url),
            None => self.url.clone(),
        }
    }

    /// Remove the secret from a message (defence in depth: `object_store` never prints it).
    pub fn scrub(&self, msg: String) -> String {
        match &self.secret_access_key {
            Some(s) if s.len() >= 4 => msg.replace(s.as_str(), "<redacted>"),
            _ => msg,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.concurrency == 0 {
            return Err(ObjectError::Config("concurrency: must be at least 1".into()));
        }
        if self.timeout.is_zero() {
            return Err(ObjectError::Config("timeout_s: must be > 0".into()));
        }
        Ok(())
    }
}

/// The backend, its client and the key prefix inside the bucket / directory.
pub struct Built {
    pub backend: Backend,
    pub store: Arc<dyn ObjectStore>,
    pub prefix: Path,
}

fn bad_url(cfg: &ObjectConfig, why: impl fmt::Display) -> ObjectError {
    ObjectError::Config(format!("object store url {:?}: {why}", cfg.url))
}

pub fn build(cfg: &ObjectConfig) -> Result<Built> {
    cfg.validate()?;
    let parsed = url::Url::parse(&cfg.url).map_err(|e| bad_url(cfg, e))?;
    let config_err =
        |e: object_store::Error| ObjectError::Config(cfg.scrub(format!("{}: {e}", cfg.target())));
    let trimmed = parsed.path().trim_matches('/').to_string();
    let (backend, store, prefix): (Backend, Arc<dyn ObjectStore>, String) = match parsed.scheme() {
        "s3" | "s3a" => (Backend::S3, Arc::new(build_s3(cfg, &parsed)?), trimmed),
        "gs" => {
            let b = GoogleCloudStorageBuilder::from_env().with_url(cfg.url.as_str());
            let keys = [GoogleConfigKey::ServiceAccount, GoogleConfigKey::ServiceAccountKey];
            let adc = std::env::var_os("HOME").map(|h| {
                std::path::Path::new(&h).join(".config/gcloud/application_default_credentials.json")
            });
            let has_own = keys.iter().any(|k| b.get_config_value(k).is_some())
                || b.get_config_value(&GoogleConfigKey::ApplicationCredentials).is_some()
                || adc.is_some_and(|p| p.exists());
            refuse_metadata(cfg, has_own, "GOOGLE_SERVICE_ACCOUNT or GOOGLE_APPLICATION_CREDENTIALS")?;
            let b = b.with_retry(cfg.retry()).with_client_options(cfg.client_options(cfg.allow_http));
            (Backend::Gcs, Arc::new(b.build().map_err(config_err)?), trimmed)
        }
        "az" | "azure" | "abfs" | "abfss" => {
            let b = MicrosoftAzureBuilder::from_env().with_url(cfg.url.as_str());
            let keys = [
                AzureConfigKey::AccessKey,
                AzureConfigKey::SasKey,
                AzureConfigKey::Token,
                AzureConfigKey::ClientSecret,
                AzureConfigKey::FederatedTokenFile,
            ];
            let flags =
                [AzureConfigKey::UseEmulator, AzureConfigKey::UseAzureCli, AzureConfigKey::SkipSignature];
            let has_own = keys.iter().any(|k| b.get_config_value(k).is_some())
                || flags.iter().any(|k| b.get_config_value(k).is_some_and(|v| v == "true"));
            refuse_metadata(cfg, has_own, "AZURE_STORAGE_ACCOUNT_KEY, a SAS token or a client secret")?;
            let b = b.with_retry(cfg.retry()).with_client_options(cfg.client_options(cfg.allow_http));
            (Backend::Azure, Arc::new(b.build().map_err(config_err)?), trimmed)
        }
        "file" => {
            let dir = parsed.to_file_path().map_err(|_| bad_url(cfg, "not an absolute local path"))?;
            std::fs::create_dir_all(&dir)
                .map_err(|e| ObjectError::io(format!("creating {}", dir.display()), e))?;
            let fs = LocalFileSystem::new_with_prefix(&dir).map_err(config_err)?;
            (Backend::File, Arc::new(fs), String::new())
        }
        "memory" => (Backend::Memory, Arc::new(InMemory::new()), trimmed),
        other => {
            return Err(bad_url(
                cfg,
                format!("unknown scheme {other:?} (expected s3, gs, az, file or memory)"),
            ))
        }
    };
    Ok(Built { backend, store, prefix: Path::from(prefix) })
}

fn env_flag(name: &str) -> bool {
    std::env::var(name)
        .map(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
        .unwrap_or(false)
}

/// Without credentials of its own, a cloud client asks the instance-metadata address: only when
/// the operator said so.
fn refuse_metadata(cfg: &ObjectConfig, has_own: bool, how: &str) -> Result<()> {
    if has_own || cfg.allow_instance_metadata {
        return Ok(());
    }
    Err(ObjectError::Config(format!(
        "{}: no credentials (give {how}); the cloud metadata address is only asked with \
         allow_instance_metadata",
        cfg.target()
    )))
}

fn build_s3(cfg: &ObjectConfig, url: &url::Url) -> Result<object_store::aws::AmazonS3> {
    let bucket = url.host_str().filter(|b| !b.is_empty()).ok_or_else(|| bad_url(cfg, "no bucket name"))?;
    // The usual AWS_* environment first; explicit arguments override it.
    let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
    if let Some(ep) = &cfg.endpoint {
        b = b.with_endpoint(ep.as_str()).with_virtual_hosted_style_request(false);
    }
    if let Some(region) = &cfg.region {
        b = b.with_region(region.as_str());
    }
    match (&cfg.access_key_id, &cfg.secret_access_key) {
        (Some(id), Some(secret)) => {
            b = b.with_access_key_id(id.as_str()).with_secret_access_key(secret.as_str())
        }
        (None, None) => {}
        _ => {
            return Err(ObjectError::Config(
                "access_key_id and secret_access_key: give both or neither".into(),
            ))
        }
    }
    let has_static = b.get_config_value(&AmazonS3ConfigKey::AccessKeyId).is_some()
        && b.get_config_value(&AmazonS3ConfigKey::SecretAccessKey).is_some();
    refuse_metadata(
        cfg,
        has_static,
        "access_key_id/secret_access_key, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
    )?;
    let allow_http = cfg.allow_http || env_flag("AWS_ALLOW_HTTP");
    let endpoint = b.get_config_value(&AmazonS3ConfigKey::Endpoint).unwrap_or_default();
    if !allow_http && endpoint.starts_with("http://") {
        return Err(ObjectError::Config(format!(
            "{}: the endpoint is plain HTTP; pass allow_http=True (or set AWS_ALLOW_HTTP=true) to use it",
            cfg.target()
        )));
    }
    b = b.with_retry(cfg.retry()).with_client_options(cfg.client_options(allow_http));
    b.build().map_err(|e| ObjectError::Config(cfg.scrub(format!("{}: {e}", cfg.target()))))
}
