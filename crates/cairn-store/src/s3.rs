//! [`S3Store`]: objects in an S3-compatible bucket (AWS S3, MinIO, Ceph,
//! R2, Garage) through the `object_store` crate.
//!
//! ```text
//! s3://BUCKET/PREFIX/LAYOUT                 framed S3Layout marker
//! s3://BUCKET/PREFIX/objects/3f2a…(64 hex)  one object per chunk
//! ```
//!
//! Objects are immutable and named by their content hash, so a rewrite is
//! harmless and no conditional PUT is needed (Garage ignores
//! `If-None-Match`). A PUT is atomic on every S3 server: a reader sees the
//! old object or the new one, never part of it. Objects larger than
//! [`MULTIPART_THRESHOLD`] go up as a multipart upload.
//!
//! The trait is synchronous; requests run on one private tokio runtime per
//! store, so a caller inside another runtime is never asked to nest one.
//!
//! S3 cannot touch an object's modification time without rewriting it, so
//! [`BlobStore::refresh`] reports an object as present only while it was
//! written within [`REFRESH_WINDOW`]; an older one is written again by the
//! caller, which renews its time. A GC over S3 must therefore use a grace
//! period longer than `REFRESH_WINDOW` plus the longest time a writer takes
//! from storing a chunk to committing the root that references it.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::{
    BackoffConfig, ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig, WriteMultipart,
};
use serde::{Deserialize, Serialize};

use crate::blob::{BlobError, BlobStore, IncompleteWrites, ObjectInfo, PutOutcome, MAX_OBJECT};
use crate::frame::{self, Framed};
use crate::hash::ChunkHash;

/// Objects at least this large are uploaded in parts.
pub const MULTIPART_THRESHOLD: usize = 32 << 20;
/// Size of one part of a multipart upload.
const PART_SIZE: usize = 16 << 20;
/// Parts of one multipart upload in flight at once.
const PART_CONCURRENCY: usize = 4;

/// Largest stored object a read accepts: zstd's worst case for
/// [`MAX_OBJECT`] bytes of content. A larger object in the bucket is
/// foreign or corrupt and is refused before its body is read.
pub const MAX_STORED_OBJECT: u64 = MAX_OBJECT + (MAX_OBJECT >> 7) + (1 << 20);

/// How recently an object must have been written for `refresh` to count it
/// as present (see the module documentation).
pub const REFRESH_WINDOW: Duration = Duration::from_secs(15 * 60);

const LAYOUT_KEY: &str = "LAYOUT";
const OBJECTS_DIR: &str = "objects";

/// The layout marker at the root of an S3 store's prefix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct S3Layout {
    /// Objects live flat under `objects/`, named by their 64-digit hash.
    flat_objects: bool,
}

impl Framed for S3Layout {
    const MAGIC: [u8; 8] = *b"CAIRNS3L";
    const VERSION: u32 = 1;
    const MAX_PAYLOAD: u64 = 4096;
    const NAME: &'static str = "S3 chunk store layout marker";
}

/// Where an S3 store lives and how to reach it.
#[derive(Clone, PartialEq, Eq)]
pub struct S3Config {
    pub bucket: String,
    /// Key prefix inside the bucket, without leading or trailing `/`; may be empty.
    pub prefix: String,
    /// `http://HOST:PORT` or `https://…`; `None` for AWS itself.
    pub endpoint: Option<String>,
    pub region: String,
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
    /// Bounds every request, the probe at open included.
    pub request_timeout: Duration,
}

/// The secret is never printed.
impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .finish_non_exhaustive()
    }
}

/// `s3://bucket/prefix` (credentials are never part of it).
impl fmt::Display for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s3://{}/{}", self.bucket, self.prefix)?;
        if let Some(endpoint) = &self.endpoint {
            write!(f, "?endpoint={endpoint}&region={}", self.region)?;
        }
        Ok(())
    }
}

impl S3Config {
    /// Parses `s3://BUCKET/PREFIX?endpoint=URL&region=REGION`; credentials
    /// come from `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and
    /// `AWS_SESSION_TOKEN`, the region from `region=`, else `AWS_REGION`,
    /// else `us-east-1`.
    pub fn from_url(url: &str) -> Result<Self, BlobError> {
        Self::from_url_with_env(url, |name| std::env::var(name).ok())
    }

    /// [`Self::from_url`] with the environment given as a function.
    pub fn from_url_with_env(url: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self, BlobError> {
        let bad = |reason: String| BlobError::S3Url {
            url: url.to_string(),
            reason,
        };
        let parsed = url::Url::parse(url).map_err(|e| bad(e.to_string()))?;
        if parsed.scheme() != "s3" {
            return Err(bad(format!("the scheme is {:?}, not s3", parsed.scheme())));
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(bad(
                "credentials do not belong in the URL; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY".into(),
            ));
        }
        let bucket = parsed.host_str().unwrap_or("").to_string();
        if !valid_bucket(&bucket) {
            return Err(bad(format!(
                "{bucket:?} is not a bucket name (3 to 63 lowercase letters, digits, '.' and '-')"
            )));
        }
        let prefix = parsed.path().trim_matches('/').to_string();
        for part in prefix.split('/').filter(|_| !prefix.is_empty()) {
            let allowed = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-');
            if part.is_empty() || part == "." || part == ".." || !part.bytes().all(allowed) {
                return Err(bad(format!(
                    "the prefix {prefix:?} must be segments of letters, digits, '.', '_' and '-' (not empty, '.' or '..') joined by '/'"
                )));
            }
        }
        let mut query: HashMap<String, String> = HashMap::new();
        for (k, v) in parsed.query_pairs() {
            if query.insert(k.to_string(), v.to_string()).is_some() {
                return Err(bad(format!("the parameter {k} is given twice")));
            }
        }
        let endpoint = query.remove("endpoint");
        if let Some(e) = &endpoint {
            let u = url::Url::parse(e).map_err(|err| bad(format!("the endpoint {e:?} is not a URL ({err})")))?;
            if !matches!(u.scheme(), "http" | "https") || u.host_str().is_none() {
                return Err(bad(format!("the endpoint {e:?} is not an http:// or https:// URL")));
            }
        }
        let region = query
            .remove("region")
            .or_else(|| env("AWS_REGION"))
            .or_else(|| env("AWS_DEFAULT_REGION"))
            .unwrap_or_else(|| "us-east-1".to_string());
        if let Some(unknown) = query.keys().next() {
            return Err(bad(format!("unknown parameter {unknown:?} (known: endpoint, region)")));
        }
        let (Some(access_key_id), Some(secret_access_key)) = (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY"))
        else {
            return Err(BlobError::S3Credentials { url: url.to_string() });
        };
        Ok(Self {
            bucket,
            prefix,
            endpoint,
            region,
            access_key_id,
            secret_access_key,
            session_token: env("AWS_SESSION_TOKEN"),
            request_timeout: Duration::from_secs(30),
        })
    }

    /// Where the store is: its endpoint's URL, or `AWS S3 (REGION)`.
    pub fn endpoint_name(&self) -> String {
        self.endpoint
            .clone()
            .unwrap_or_else(|| format!("AWS S3 ({})", self.region))
    }
}

fn valid_bucket(name: &str) -> bool {
    (3..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
}

/// What an S3 store's prefix holds when it is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum S3Prefix {
    /// A Cairn chunk store (its layout marker).
    Store,
    /// Nothing yet: the first open writes the layout marker.
    Empty,
}

/// A chunk store backend in an S3 bucket.
pub struct S3Store {
    config: S3Config,
    client: Arc<AmazonS3>,
    runtime: tokio::runtime::Runtime,
}

impl fmt::Debug for S3Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Store")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl S3Store {
    /// Opens the store, creating its layout marker in an empty prefix.
    /// One request (reading the marker) proves that the endpoint answers,
    /// the credentials are accepted and the bucket exists; each failure is
    /// its own error saying what to fix.
    pub fn open(config: S3Config) -> Result<Self, BlobError> {
        let store = Self::connect(config)?;
        if store.layout()? == S3Prefix::Empty {
            store.mark()?;
        }
        Ok(store)
    }

    /// What the prefix holds, read without writing anything (what `cairn
    /// doctor` reports): the same first request as [`S3Store::open`], with
    /// the same errors.
    pub fn inspect(config: S3Config) -> Result<S3Prefix, BlobError> {
        Self::connect(config)?.layout()
    }

    /// The client and its runtime; no request is made.
    fn connect(config: S3Config) -> Result<Self, BlobError> {
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(&config.bucket)
            .with_region(&config.region)
            .with_access_key_id(&config.access_key_id)
            .with_secret_access_key(&config.secret_access_key)
            .with_virtual_hosted_style_request(false)
            .with_client_options(
                ClientOptions::new()
                    .with_timeout(config.request_timeout)
                    .with_connect_timeout(Duration::from_secs(5)),
            )
            .with_retry(RetryConfig {
                backoff: BackoffConfig::default(),
                max_retries: 3,
                retry_timeout: config.request_timeout,
            });
        if let Some(token) = &config.session_token {
            builder = builder.with_token(token);
        }
        if let Some(endpoint) = &config.endpoint {
            builder = builder
                .with_endpoint(endpoint)
                .with_allow_http(endpoint.starts_with("http://"));
        }
        let client = builder.build().map_err(|e| BlobError::S3Url {
            url: config.to_string(),
            reason: e.to_string(),
        })?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("cairn-s3")
            .enable_all()
            .build()
            .map_err(|e| BlobError::io("start the S3 client runtime", "(threads)", e))?;
        Ok(Self {
            config,
            client: Arc::new(client),
            runtime,
        })
    }

    pub fn config(&self) -> &S3Config {
        &self.config
    }

    fn path(&self, rel: &str) -> ObjectPath {
        if self.config.prefix.is_empty() {
            ObjectPath::from(rel)
        } else {
            ObjectPath::from(format!("{}/{rel}", self.config.prefix))
        }
    }

    fn object_path(&self, key: &ChunkHash) -> ObjectPath {
        self.path(&format!("{OBJECTS_DIR}/{}", key.to_hex()))
    }

    /// Runs `fut` on the private runtime and waits for it from any thread,
    /// one inside another runtime included.
    fn run<T: Send + 'static>(&self, fut: impl Future<Output = T> + Send + 'static) -> T {
        let handle = self.runtime.spawn(fut);
        match futures::executor::block_on(handle) {
            Ok(v) => v,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }

    /// Reads the layout marker: a Cairn store's, or an empty prefix (one
    /// holding anything else is refused).
    fn layout(&self) -> Result<S3Prefix, BlobError> {
        let client = self.client.clone();
        let marker = self.path(LAYOUT_KEY);
        let read = self.run(async move { client.get(&marker).await?.bytes().await });
        match read {
            Ok(bytes) => {
                let layout: S3Layout = frame::decode(&bytes).map_err(|source| BlobError::S3Layout {
                    store: self.config.to_string(),
                    source,
                })?;
                if !layout.flat_objects {
                    return Err(BlobError::S3NotAStore {
                        store: self.config.to_string(),
                    });
                }
                Ok(S3Prefix::Store)
            }
            Err(object_store::Error::NotFound { source, .. }) if !is_no_such_bucket(&source.to_string()) => {
                // No marker: the prefix must hold nothing else.
                let client = self.client.clone();
                let prefix = self.path("");
                let first = self.run(async move { client.list(Some(&prefix)).next().await });
                match first {
                    None => {}
                    Some(Ok(_)) => {
                        return Err(BlobError::S3NotAStore {
                            store: self.config.to_string(),
                        })
                    }
                    Some(Err(e)) => return Err(self.open_error(e)),
                }
                Ok(S3Prefix::Empty)
            }
            Err(e) => Err(self.open_error(e)),
        }
    }

    /// Writes the layout marker into an empty prefix.
    fn mark(&self) -> Result<(), BlobError> {
        let bytes = frame::encode(&S3Layout { flat_objects: true }).expect("layout marker is tiny");
        let client = self.client.clone();
        let marker = self.path(LAYOUT_KEY);
        self.run(async move { client.put(&marker, PutPayload::from(bytes)).await })
            .map_err(|e| self.open_error(e))?;
        Ok(())
    }

    /// Names what is wrong when the first requests fail.
    fn open_error(&self, e: object_store::Error) -> BlobError {
        let endpoint = self.config.endpoint_name();
        let detail = e.to_string();
        match e {
            object_store::Error::NotFound { .. } => BlobError::S3NoBucket {
                bucket: self.config.bucket.clone(),
                endpoint,
            },
            object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. } => {
                BlobError::S3Denied {
                    store: self.config.to_string(),
                    key_id: self.config.access_key_id.clone(),
                    detail,
                }
            }
            _ if is_no_such_bucket(&detail) => BlobError::S3NoBucket {
                bucket: self.config.bucket.clone(),
                endpoint,
            },
            _ if detail.contains("InvalidAccessKeyId") || detail.contains("SignatureDoesNotMatch") => {
                BlobError::S3Denied {
                    store: self.config.to_string(),
                    key_id: self.config.access_key_id.clone(),
                    detail,
                }
            }
            _ => BlobError::S3Unreachable { endpoint, detail },
        }
    }

    fn remote_error(&self, action: &'static str, key: &ChunkHash, source: object_store::Error) -> BlobError {
        BlobError::S3 {
            action,
            what: format!("object {} in {}", key.short(), self.config),
            source: Box::new(source),
        }
    }

    /// The object's last write time, or `None` when it is absent.
    fn head(&self, key: &ChunkHash) -> Result<Option<SystemTime>, BlobError> {
        let client = self.client.clone();
        let path = self.object_path(key);
        match self.run(async move { client.head(&path).await }) {
            Ok(meta) => Ok(Some(SystemTime::from(meta.last_modified))),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.remote_error("HEAD", key, e)),
        }
    }

    /// Writes the object whether or not it exists.
    pub fn put_unconditionally(&self, key: &ChunkHash, bytes: &[u8]) -> Result<(), BlobError> {
        let client = self.client.clone();
        let path = self.object_path(key);
        let data = bytes::Bytes::copy_from_slice(bytes);
        let result = self.run(async move {
            if data.len() < MULTIPART_THRESHOLD {
                return client.put(&path, PutPayload::from(data)).await.map(|_| ());
            }
            let upload = client.put_multipart(&path).await?;
            let mut writer = WriteMultipart::new_with_chunk_size(upload, PART_SIZE);
            for part in data.chunks(PART_SIZE) {
                if let Err(e) = writer.wait_for_capacity(PART_CONCURRENCY).await {
                    // Leaves no parts behind on the server.
                    let _ = writer.abort().await;
                    return Err(e);
                }
                writer.put(data.slice_ref(part));
            }
            writer.finish().await.map(|_| ())
        });
        result.map_err(|e| self.remote_error("PUT", key, e))
    }
}

fn is_no_such_bucket(detail: &str) -> bool {
    detail.contains("NoSuchBucket") || detail.contains("bucket does not exist") || detail.contains("Bucket not found")
}

impl BlobStore for S3Store {
    fn put(&self, key: &ChunkHash, bytes: &[u8]) -> Result<PutOutcome, BlobError> {
        if self.refresh(key)? {
            return Ok(PutOutcome::AlreadyPresent);
        }
        self.put_unconditionally(key, bytes)?;
        Ok(PutOutcome::Stored)
    }

    fn get(&self, key: &ChunkHash) -> Result<Vec<u8>, BlobError> {
        let client = self.client.clone();
        let path = self.object_path(key);
        let got = self.run(async move {
            let result = client.get(&path).await?;
            if result.meta.size > MAX_STORED_OBJECT {
                return Ok(Err(result.meta.size));
            }
            result.bytes().await.map(Ok)
        });
        match got {
            Ok(Ok(bytes)) => Ok(bytes.to_vec()),
            Ok(Err(size)) => Err(BlobError::S3ObjectTooLarge {
                what: format!("object {} in {}", key.short(), self.config),
                size,
                cap: MAX_STORED_OBJECT,
            }),
            Err(object_store::Error::NotFound { .. }) => Err(BlobError::NotFound { key: *key }),
            Err(e) => Err(self.remote_error("GET", key, e)),
        }
    }

    fn contains(&self, key: &ChunkHash) -> Result<bool, BlobError> {
        Ok(self.head(key)?.is_some())
    }

    /// True only for an object written within [`REFRESH_WINDOW`]; an
    /// older one must be written again to renew its time.
    fn refresh(&self, key: &ChunkHash) -> Result<bool, BlobError> {
        Ok(match self.head(key)? {
            Some(modified) => SystemTime::now()
                .duration_since(modified)
                .map(|age| age < REFRESH_WINDOW)
                .unwrap_or(true),
            None => false,
        })
    }

    fn delete(&self, key: &ChunkHash) -> Result<bool, BlobError> {
        // S3 DELETE succeeds on an absent key; HEAD first to say which.
        if self.head(key)?.is_none() {
            return Ok(false);
        }
        let client = self.client.clone();
        let path = self.object_path(key);
        match self.run(async move { client.delete(&path).await }) {
            Ok(()) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.remote_error("DELETE", key, e)),
        }
    }

    fn list(&self) -> Result<Vec<ObjectInfo>, BlobError> {
        let client = self.client.clone();
        let dir = self.path(OBJECTS_DIR);
        let metas = self.run(async move {
            let mut out = Vec::new();
            let mut stream = client.list(Some(&dir));
            while let Some(item) = stream.next().await {
                out.push(item?);
            }
            Ok::<_, object_store::Error>(out)
        });
        let metas = metas.map_err(|source| BlobError::S3 {
            action: "LIST",
            what: format!("the objects of {}", self.config),
            source: Box::new(source),
        })?;
        let mut out = Vec::with_capacity(metas.len());
        for meta in metas {
            // Only names that are exactly a hash directly under objects/.
            let Some(name) = meta.location.filename() else { continue };
            if meta.location.as_ref() != self.path(&format!("{OBJECTS_DIR}/{name}")).as_ref() {
                continue;
            }
            let Ok(key) = name.parse::<ChunkHash>() else { continue };
            out.push(ObjectInfo {
                key,
                size: meta.size,
                modified: SystemTime::from(meta.last_modified),
            });
        }
        Ok(out)
    }

    /// A failed multipart upload is aborted by its writer; one whose
    /// writer was killed is left to the bucket's lifecycle rule
    /// (`AbortIncompleteMultipartUpload`): the S3 client used here cannot
    /// list in-progress uploads, so nothing is removed here.
    fn remove_incomplete_writes(&self) -> Result<IncompleteWrites, BlobError> {
        Ok(IncompleteWrites::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blob::URL_FORM;

    fn env(name: &str) -> Option<String> {
        match name {
            "AWS_ACCESS_KEY_ID" => Some("GK0123".into()),
            "AWS_SECRET_ACCESS_KEY" => Some("secret".into()),
            _ => None,
        }
    }

    #[test]
    fn a_store_url_gives_bucket_prefix_endpoint_and_region() {
        let c = S3Config::from_url_with_env(
            "s3://cairn-chunks/team/a?endpoint=http://127.0.0.1:3900&region=garage",
            env,
        )
        .unwrap();
        assert_eq!(c.bucket, "cairn-chunks");
        assert_eq!(c.prefix, "team/a");
        assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:3900"));
        assert_eq!(c.region, "garage");
        assert_eq!(c.access_key_id, "GK0123");
        assert!(!format!("{c:?}").contains("secret"), "{c:?}");
        let bare = S3Config::from_url_with_env("s3://bucket", env).unwrap();
        assert_eq!((bare.prefix.as_str(), bare.region.as_str()), ("", "us-east-1"));
    }

    #[test]
    fn a_bad_store_url_is_refused_with_what_to_fix() {
        let cases = [
            ("http://bucket/x", "not s3"),
            ("s3://B!/x", "not a bucket name"),
            ("s3://bucket/a//b", "empty"),
            ("s3://bucket/a%20b", "must be segments"),
            ("s3://bucket/x?endpoint=ftp://h", "not an http"),
            ("s3://bucket/x?endpoint=http://h&endpoint=http://i", "twice"),
            ("s3://bucket/x?regoin=garage", "unknown parameter"),
            ("s3://key:secret@bucket/x", "do not belong in the URL"),
            ("not a url", "s3://BUCKET/PREFIX"),
        ];
        for (url, says) in cases {
            let err = S3Config::from_url_with_env(url, env).unwrap_err().to_string();
            assert!(err.contains(says), "{url}: {err}");
            assert!(err.contains(URL_FORM), "{url}: {err}");
        }
        let err = S3Config::from_url_with_env("s3://bucket/x", |_| None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("AWS_ACCESS_KEY_ID"), "{err}");
    }
}
