//! [`ExecutorClient`]: every RPC of the contract as an async method. Handles are plain
//! `pb::KvCacheHandle` values: the caller passes back the one the last reply returned.
//! Each call carries the client's deadline (gRPC's timeout and the
//! `ferrum-deadline-unix-ns` header) and its bearer token; errors are
//! [`ExecutorError`]s with the ErrorInfo reason and the table's flags.

use crate::error::{ExecutorError, Result};
use crate::pb;
use crate::pb::model_executor_client::ModelExecutorClient;
use crate::session::{DecodeSession, SharedSession};
use futures::Stream;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, Channel, Endpoint, Identity};
use tonic::Streaming;

/// The caller's absolute deadline, wall-clock ns since the Unix epoch (beside gRPC's
/// relative timeout, so a call that waited in a frozen server keeps its deadline).
pub const DEADLINE_HEADER: &str = "ferrum-deadline-unix-ns";
/// Above the server's default 256 MiB reply limit.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 512 << 20;
/// How long the release by request_id after a call with an unknown outcome may take.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// HTTP/2 keepalive pings: a server that stops answering is noticed within
/// `time + timeout`, and calls on the connection end UNAVAILABLE. The server accepts
/// a ping a second at most, so keep `time` at 1 s or more.
#[derive(Debug, Clone, Copy)]
pub struct Keepalive {
    /// A ping after this long without one.
    pub time: Duration,
    /// How long an unanswered ping waits before the connection is closed.
    pub timeout: Duration,
    /// Ping idle connections too.
    pub without_calls: bool,
}

impl Default for Keepalive {
    fn default() -> Self {
        Keepalive { time: Duration::from_secs(2), timeout: Duration::from_secs(2), without_calls: true }
    }
}

/// TLS to the server: its CA, optionally a client certificate (mTLS).
#[derive(Debug, Clone, Default)]
pub struct ClientTls {
    /// PEM of the CA that signed the server's certificate.
    pub ca_pem: Vec<u8>,
    /// The name to check the server's certificate against (default: the host).
    pub domain: Option<String>,
    /// PEM certificate and key of the client (mTLS).
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

/// How a client connects and what each call carries.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Bearer token sent on every call ("authorization: Bearer <token>").
    pub token: Option<String>,
    /// Deadline of each call (None: no deadline).
    pub timeout: Option<Duration>,
    /// TLS (None: plaintext).
    pub tls: Option<ClientTls>,
    /// Keepalive pings (None: none).
    pub keepalive: Option<Keepalive>,
    /// The model each request names ("" = the server's default).
    pub model: String,
    /// Largest message sent or received.
    pub max_message_bytes: usize,
    /// How long connecting may take.
    pub connect_timeout: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            token: None,
            timeout: None,
            tls: None,
            keepalive: Some(Keepalive::default()),
            model: String::new(),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// The async client of one server. Cloning shares the connection.
#[derive(Clone)]
pub struct ExecutorClient {
    stub: ModelExecutorClient<Channel>,
    opts: ClientOptions,
}

fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

/// A fresh request id for a Prefill (the name it may be released by when its outcome
/// is unknown).
pub fn new_request_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!("rs-{:x}-{:x}-{:x}", std::process::id(), now_ns(), N.fetch_add(1, Ordering::Relaxed))
}

impl ExecutorClient {
    /// Connects to `addr` ("host:port", or a URL with http:// or https://).
    pub async fn connect(addr: &str, opts: ClientOptions) -> Result<Self> {
        let scheme = if opts.tls.is_some() { "https" } else { "http" };
        let url = if addr.contains("://") { addr.to_string() } else { format!("{scheme}://{addr}") };
        let mut ep = Endpoint::from_shared(url)
            .map_err(|e| ExecutorError::local(tonic::Code::InvalidArgument, e.to_string()))?
            .connect_timeout(opts.connect_timeout)
            .tcp_nodelay(true);
        if let Some(ka) = opts.keepalive {
            ep = ep
                .http2_keep_alive_interval(ka.time)
                .keep_alive_timeout(ka.timeout)
                .keep_alive_while_idle(ka.without_calls);
        }
        if let Some(tls) = &opts.tls {
            let mut cfg = tonic::transport::ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&tls.ca_pem));
            if let Some(d) = &tls.domain {
                cfg = cfg.domain_name(d.clone());
            }
            if let Some((cert, key)) = &tls.identity {
                cfg = cfg.identity(Identity::from_pem(cert, key));
            }
            ep = ep.tls_config(cfg).map_err(|e| ExecutorError::local(tonic::Code::InvalidArgument, e.to_string()))?;
        }
        let channel = ep
            .connect()
            .await
            .map_err(|e| ExecutorError::local(tonic::Code::Unavailable, format!("connect {addr}: {e}")))?;
        Ok(Self::from_channel(channel, opts))
    }

    /// A client over an existing channel.
    pub fn from_channel(channel: Channel, opts: ClientOptions) -> Self {
        let stub = ModelExecutorClient::new(channel)
            .max_decoding_message_size(opts.max_message_bytes)
            .max_encoding_message_size(opts.max_message_bytes);
        ExecutorClient { stub, opts }
    }

    /// The same connection with another per-call deadline.
    pub fn with_timeout(&self, timeout: Option<Duration>) -> Self {
        let mut c = self.clone();
        c.opts.timeout = timeout;
        c
    }

    /// The same connection naming another model.
    pub fn with_model(&self, model: impl Into<String>) -> Self {
        let mut c = self.clone();
        c.opts.model = model.into();
        c
    }

    /// The options this client was made with.
    pub fn options(&self) -> &ClientOptions {
        &self.opts
    }

    /// The generated tonic stub, for what the typed methods do not cover.
    pub fn raw(&self) -> ModelExecutorClient<Channel> {
        self.stub.clone()
    }

    /// The model requests name.
    pub fn model(&self) -> &str {
        &self.opts.model
    }

    /// A request with the client's deadline and token.
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(message);
        if let Some(t) = self.opts.timeout {
            req.set_timeout(t);
            let deadline = now_ns() + t.as_nanos();
            req.metadata_mut().insert(DEADLINE_HEADER, MetadataValue::try_from(deadline.to_string()).unwrap());
        }
        if let Some(token) = &self.opts.token {
            if let Ok(v) = MetadataValue::try_from(format!("Bearer {token}")) {
                req.metadata_mut().insert("authorization", v);
            }
        }
        req
    }

    async fn collect<T>(stream: std::result::Result<tonic::Response<Streaming<T>>, tonic::Status>) -> Result<Vec<T>> {
        let mut stream = stream?.into_inner();
        let mut out = Vec::new();
        while let Some(m) = stream.message().await? {
            out.push(m);
        }
        Ok(out)
    }

    /// Releases what a call with an unknown outcome may have created under `request_id`
    /// (bounded; its own failure is ignored: the server's idle timeout reclaims it).
    async fn release_request_id(&self, request_id: &str) {
        let c = self.with_timeout(Some(RELEASE_TIMEOUT));
        let req = c.request(pb::ReleaseCacheRequest {
            cache_id: String::new(),
            model: self.opts.model.clone(),
            request_id: request_id.to_string(),
        });
        let _ = tokio::time::timeout(RELEASE_TIMEOUT, c.stub.clone().release_cache(req)).await;
    }

    // ---- Static facts and live state ----

    /// GetModelInfo.
    pub async fn info(&self) -> Result<pb::ModelInfo> {
        let req = self.request(pb::GetModelInfoRequest { model: self.opts.model.clone() });
        Ok(self.stub.clone().get_model_info(req).await?.into_inner())
    }

    /// GetCapabilities.
    pub async fn capabilities(&self) -> Result<pb::Capabilities> {
        let req = self.request(pb::GetCapabilitiesRequest { model: self.opts.model.clone() });
        Ok(self.stub.clone().get_capabilities(req).await?.into_inner())
    }

    /// GetStatus.
    pub async fn status(&self) -> Result<pb::Status> {
        let req = self.request(pb::GetStatusRequest { model: self.opts.model.clone() });
        Ok(self.stub.clone().get_status(req).await?.into_inner())
    }

    // ---- Sequences ----

    /// Prefill: `token_ids` as a new sequence, or continuing `kv_cache`. `logits` says
    /// what comes back per position; `choice` has the server choose the next token
    /// (reply.chosen). A new sequence's call carries a fresh request_id: when its outcome is unknown
    /// (deadline, cancel, lost connection) the sequence it may have made is released by
    /// that id before the error returns.
    pub async fn prefill(
        &self,
        token_ids: &[u32],
        kv_cache: Option<&pb::KvCacheHandle>,
        logits: Option<pb::LogitsPolicy>,
        choice: Option<pb::TokenChoice>,
    ) -> Result<pb::PrefillResponse> {
        self.prefill_request(pb::PrefillRequest {
            model: self.opts.model.clone(),
            token_ids: token_ids.to_vec(),
            kv_cache: kv_cache.cloned(),
            logits,
            token_choice: choice,
            ..Default::default()
        })
        .await
    }

    /// Prefill with the whole request given (adapter, hidden states, request_id); a
    /// prompt that makes a new sequence gets a request_id when it has none (a request_id
    /// names the sequence a Prefill creates: a continuation carries none).
    pub async fn prefill_request(&self, mut message: pb::PrefillRequest) -> Result<pb::PrefillResponse> {
        if message.request_id.is_empty() && message.kv_cache.is_none() {
            message.request_id = new_request_id();
        }
        let id = message.request_id.clone();
        match self.stub.clone().prefill(self.request(message)).await {
            Ok(r) => Ok(r.into_inner()),
            Err(status) => {
                let err = ExecutorError::from_status(&status);
                if err.outcome_unknown() && !id.is_empty() {
                    self.release_request_id(&id).await;
                }
                Err(err)
            }
        }
    }

    /// Decode: appends `token_id` to the sequence and returns the next position's
    /// logits (or, with `choice`, the server's token in `chosen`).
    pub async fn decode(
        &self,
        token_id: u32,
        kv_cache: &pb::KvCacheHandle,
        logits: Option<pb::LogitsPolicy>,
        choice: Option<pb::TokenChoice>,
    ) -> Result<pb::DecodeResponse> {
        let req = self.request(pb::DecodeRequest {
            model: self.opts.model.clone(),
            token_id,
            kv_cache: Some(kv_cache.clone()),
            logits,
            token_choice: choice,
        });
        Ok(self.stub.clone().decode(req).await?.into_inner())
    }

    /// BatchDecode: one forward over many sequences; replies in request order (one
    /// message with `single_reply`, flattened here either way).
    pub async fn batch_decode(
        &self,
        items: Vec<pb::DecodeItem>,
        logits: Option<pb::LogitsPolicy>,
        single_reply: bool,
    ) -> Result<Vec<pb::BatchDecodeResponse>> {
        let req = self.request(pb::BatchDecodeRequest { model: self.opts.model.clone(), items, logits, single_reply });
        let replies = Self::collect(self.stub.clone().batch_decode(req).await).await?;
        let mut out = Vec::new();
        for mut r in replies {
            if r.results.is_empty() {
                out.push(r);
            } else {
                out.append(&mut r.results);
            }
        }
        Ok(out)
    }

    /// BatchPrefill: several prompts in shared forwards, all or nothing. Items making a
    /// new sequence without a request_id get one, released when the outcome is unknown.
    pub async fn batch_prefill(
        &self,
        mut items: Vec<pb::PrefillItem>,
        logits: Option<pb::LogitsPolicy>,
    ) -> Result<Vec<pb::BatchPrefillResponse>> {
        for it in items.iter_mut() {
            if it.request_id.is_empty() && it.kv_cache.is_none() {
                it.request_id = new_request_id();
            }
        }
        let ids: Vec<String> = items.iter().filter(|i| !i.request_id.is_empty()).map(|i| i.request_id.clone()).collect();
        let req = self.request(pb::BatchPrefillRequest { model: self.opts.model.clone(), items, logits });
        match Self::collect(self.stub.clone().batch_prefill(req).await).await {
            Ok(v) => Ok(v),
            Err(err) => {
                if err.outcome_unknown() {
                    for id in &ids {
                        self.release_request_id(id).await;
                    }
                }
                Err(err)
            }
        }
    }

    /// ForwardVerify: N+1 tokens in one forward, a logits row per position.
    pub async fn forward_verify(
        &self,
        token_ids: &[u32],
        kv_cache: &pb::KvCacheHandle,
        logits: Option<pb::LogitsPolicy>,
    ) -> Result<pb::ForwardVerifyResponse> {
        let req = self.request(pb::ForwardVerifyRequest {
            model: self.opts.model.clone(),
            token_ids: token_ids.to_vec(),
            kv_cache: Some(kv_cache.clone()),
            logits,
        });
        Ok(self.stub.clone().forward_verify(req).await?.into_inner())
    }

    /// SpeculativeDecode (the whole request: drafts, sampling).
    pub async fn speculative_decode(&self, mut message: pb::SpeculativeDecodeRequest) -> Result<pb::SpeculativeDecodeResponse> {
        if message.model.is_empty() {
            message.model = self.opts.model.clone();
        }
        Ok(self.stub.clone().speculative_decode(self.request(message)).await?.into_inner())
    }

    /// TruncateKv: shortens the sequence to `new_length`; returns the new handle.
    pub async fn truncate_kv(&self, kv_cache: &pb::KvCacheHandle, new_length: u32) -> Result<pb::KvCacheHandle> {
        let req = self.request(pb::TruncateKvRequest { kv_cache: Some(kv_cache.clone()), new_length });
        let reply = self.stub.clone().truncate_kv(req).await?.into_inner();
        reply.kv_cache.ok_or_else(|| ExecutorError::local(tonic::Code::Internal, "TruncateKv reply without a handle"))
    }

    /// ReleaseCache by cache_id; returns the blocks freed.
    pub async fn release_cache(&self, cache_id: &str) -> Result<u32> {
        let model = self.opts.model.clone();
        let req = self.request(pb::ReleaseCacheRequest { cache_id: cache_id.to_string(), model, request_id: String::new() });
        Ok(self.stub.clone().release_cache(req).await?.into_inner().blocks_freed)
    }

    /// ReleaseCache by the request_id a Prefill carried.
    pub async fn release_request(&self, request_id: &str) -> Result<u32> {
        let model = self.opts.model.clone();
        let req = self.request(pb::ReleaseCacheRequest { cache_id: String::new(), model, request_id: request_id.to_string() });
        Ok(self.stub.clone().release_cache(req).await?.into_inner().blocks_freed)
    }

    /// ForkCache: `num_children` handles sharing the parent's blocks.
    pub async fn fork_cache(&self, kv_cache: &pb::KvCacheHandle, num_children: u32) -> Result<Vec<pb::KvCacheHandle>> {
        let req = self.request(pb::ForkCacheRequest { kv_cache: Some(kv_cache.clone()), num_children });
        Ok(self.stub.clone().fork_cache(req).await?.into_inner().children)
    }

    /// Forward (the trait's default: the server answers UNIMPLEMENTED).
    pub async fn forward(&self, message: pb::ForwardRequest) -> Result<pb::ForwardResponse> {
        Ok(self.stub.clone().forward(self.request(message)).await?.into_inner())
    }

    /// DecodeSession: a long-lived stream of decode steps (see [`DecodeSession`]).
    pub async fn decode_session(&self) -> Result<DecodeSession> {
        DecodeSession::open(self).await
    }

    /// DecodeSession as one stream several steps use at once (see [`SharedSession`]).
    pub fn shared_session(&self) -> SharedSession {
        SharedSession::open(self)
    }

    // ---- Models, adapters, weights ----

    /// ListModels.
    pub async fn list_models(&self) -> Result<pb::ListModelsResponse> {
        Ok(self.stub.clone().list_models(self.request(pb::ListModelsRequest {})).await?.into_inner())
    }

    /// LoadModel; the progress messages, the last one saying it serves.
    pub async fn load_model(&self, message: pb::LoadModelRequest) -> Result<Vec<pb::LoadModelResponse>> {
        Self::collect(self.stub.clone().load_model(self.request(message)).await).await
    }

    /// UnloadModel.
    pub async fn unload_model(&self, message: pb::UnloadModelRequest) -> Result<pb::UnloadModelResponse> {
        Ok(self.stub.clone().unload_model(self.request(message)).await?.into_inner())
    }

    /// LoadAdapter.
    pub async fn load_adapter(&self, message: pb::LoadAdapterRequest) -> Result<pb::AdapterEntry> {
        Ok(self.stub.clone().load_adapter(self.request(message)).await?.into_inner())
    }

    /// UnloadAdapter.
    pub async fn unload_adapter(&self, message: pb::UnloadAdapterRequest) -> Result<pb::UnloadAdapterResponse> {
        Ok(self.stub.clone().unload_adapter(self.request(message)).await?.into_inner())
    }

    /// ListAdapters.
    pub async fn list_adapters(&self, message: pb::ListAdaptersRequest) -> Result<pb::ListAdaptersResponse> {
        Ok(self.stub.clone().list_adapters(self.request(message)).await?.into_inner())
    }

    /// UpdateWeights: header, safetensors bytes, trailer, as the chunks given.
    pub async fn update_weights(&self, chunks: Vec<pb::WeightsChunk>) -> Result<pb::UpdateWeightsResponse> {
        let req = self.request(futures::stream::iter(chunks));
        Ok(self.stub.clone().update_weights(req).await?.into_inner())
    }

    // ---- Shared memory ----

    /// RegisterSharedMemory: the registration lives while the returned stream is held
    /// (its first message is the server's answer; dropping the stream unregisters).
    pub async fn register_shared_memory(
        &self,
        message: pb::RegisterSharedMemoryRequest,
    ) -> Result<(pb::RegisterSharedMemoryResponse, Streaming<pb::RegisterSharedMemoryResponse>)> {
        let mut stream = self.stub.clone().register_shared_memory(self.request(message)).await?.into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| ExecutorError::local(tonic::Code::Internal, "RegisterSharedMemory ended without an answer"))?;
        Ok((first, stream))
    }

    /// UnregisterSharedMemory.
    pub async fn unregister_shared_memory(
        &self,
        message: pb::UnregisterSharedMemoryRequest,
    ) -> Result<pb::UnregisterSharedMemoryResponse> {
        Ok(self.stub.clone().unregister_shared_memory(self.request(message)).await?.into_inner())
    }

    // ---- Sequences that move ----

    /// ExportSequence: header, KV chunks, trailer.
    pub async fn export_sequence(&self, message: pb::ExportSequenceRequest) -> Result<Vec<pb::SequenceChunk>> {
        Self::collect(self.stub.clone().export_sequence(self.request(message)).await).await
    }

    /// ImportSequence of exported chunks.
    pub async fn import_sequence(&self, chunks: Vec<pb::SequenceChunk>) -> Result<pb::ImportSequenceResponse> {
        let req = self.request(futures::stream::iter(chunks));
        Ok(self.stub.clone().import_sequence(req).await?.into_inner())
    }

    /// CreateImportTicket.
    pub async fn create_import_ticket(&self, message: pb::CreateImportTicketRequest) -> Result<pb::ImportTicket> {
        Ok(self.stub.clone().create_import_ticket(self.request(message)).await?.into_inner())
    }

    /// PushSequence.
    pub async fn push_sequence(&self, message: pb::PushSequenceRequest) -> Result<pb::PushSequenceResponse> {
        Ok(self.stub.clone().push_sequence(self.request(message)).await?.into_inner())
    }

    /// WatchKvEvents: the hello, then event batches, as a stream.
    pub async fn watch_kv_events(
        &self,
        message: pb::WatchKvEventsRequest,
    ) -> Result<impl Stream<Item = std::result::Result<pb::KvEventBatch, tonic::Status>>> {
        Ok(self.stub.clone().watch_kv_events(self.request(message)).await?.into_inner())
    }
}

/// LogitsPolicy helpers.
pub mod policy {
    use crate::pb;

    /// Full logits in float32.
    pub fn full() -> pb::LogitsPolicy {
        pb::LogitsPolicy { kind: pb::LogitsKind::Full as i32, dtype: pb::DType::DtypeFloat32 as i32, ..Default::default() }
    }

    /// The largest logit only.
    pub fn argmax() -> pb::LogitsPolicy {
        pb::LogitsPolicy { kind: pb::LogitsKind::Argmax as i32, ..Default::default() }
    }

    /// The k largest.
    pub fn top_k(k: u32) -> pb::LogitsPolicy {
        pb::LogitsPolicy { kind: pb::LogitsKind::TopK as i32, top_k: k, ..Default::default() }
    }
}
