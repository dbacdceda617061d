//! [`RemoteExecutor`]: `ferrum_interfaces::ModelExecutor` over [`ExecutorClient`], so
//! Ferrum's own engine (`EngineBuilder::with_custom_executor`) runs its model on a
//! ferrum-rpc server.
//!
//! Sequences. Each remote sequence is a [`Lease`]: its latest server handle, released
//! (ReleaseCache) when the last reference to it goes, or at once by `release_cache`.
//! The engine names a sequence in two ways: by the handle a call returned (a
//! [`RemoteKvCacheHandle`], downcast through `as_any`), and by the `cache_id` of a
//! handle its own KV manager minted (its unified batches carry only that id as
//! `seq_id`). Sequences made for an engine-minted id are kept in a table under that id
//! until `release_cache(id)`; a sequence made without one lives as long as its handles.
//!
//! Logits come back as FULL float32 rows ([`LogitsTensor`], a `TensorLike` over the
//! reply's bytes); token ids are read from the engine's input tensors with
//! `to_vec_u32`. Where the engine's unified batch asks an item for its greedy token
//! only (`LogitsReturnPolicy::GreedyArgmax`, its token mask sent as the allowed-token
//! bitmask), the server chooses it (a greedy `TokenChoice`) and the item's result is the
//! one-element row holding the token id, as the engine takes a model-side argmax;
//! no logits cross the wire for it.
//!
//! Decode steps go over one long-lived DecodeSession stream rather than a BatchDecode
//! call each: a greedy step the server chooses decodes ahead (crate::ahead: a run
//! streams the sequence's next tokens and the engine's following steps are answered
//! from them), the others go in one plain step (one message each way, every item's
//! result in one reply). A client with a per-call deadline uses BatchDecode and does not
//! decode ahead (a session has no per-step deadline, and ending one early would undo
//! its sequences' last steps).
//!
//! The trait's synchronous methods (capabilities, status, kv_capacity,
//! kv_slot_capacity_snapshot) answer from a snapshot of GetCapabilities and GetStatus
//! refreshed in the background; see docs/contract.md for each mismatch between the
//! trait and the contract.

use crate::ahead::{Book, SeqAhead, MAX_RUNS, WINDOW};
use crate::client::{policy, ExecutorClient};
use crate::error::ExecutorError;
use crate::logits::LogitsView;
use crate::pb;
use async_trait::async_trait;
use ferrum_interfaces::kv_cache::{BlockTable, CacheHandleStats};
use crate::session::SharedSession;
use ferrum_interfaces::model_executor::{
    AttentionType, DecodeInput, DecodeOutput, ExecutorCapabilities, ExecutorMemoryUsage, ExecutorState,
    ExecutorStatus, KvSlotCapacitySnapshot, KvSlotRequest, KvSlotReservation, LogitsReturnPolicy,
    MemoryRequirements, PrefillInput, PrefillOutput, TokenSelectionMask, UnifiedBatch, UnifiedBatchItem,
};
use ferrum_interfaces::{KvCacheHandle, ModelExecutor, TensorLike, TensorRef};
use ferrum_types::{DataType, Device, FerrumError, ModelId, ModelInfo, ModelType, Result};
use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// How often the background task refreshes the GetStatus snapshot.
const STATUS_REFRESH: Duration = Duration::from_millis(500);

/// An executor error as Ferrum's error: the reason leads the message ("REASON:
/// message"), and the kind follows the table: capacity reasons are resource_exhausted
/// (Ferrum's engine defers the work), deadlines timeout, cancels cancelled, a lost
/// server network, malformed input invalid_request, the rest backend.
pub fn to_ferrum(err: ExecutorError) -> FerrumError {
    let text = err.to_string();
    match err.reason.as_deref() {
        Some("KV_CAPACITY_EXHAUSTED" | "SEQUENCE_LIMIT_EXCEEDED" | "TENANT_QUOTA_EXCEEDED") => {
            FerrumError::resource_exhausted(text)
        }
        Some("INVALID_INPUT" | "SEQUENCE_TOO_LONG") => FerrumError::invalid_request(text),
        Some(_) => FerrumError::backend(text),
        None => match err.code {
            tonic::Code::DeadlineExceeded => FerrumError::timeout(text),
            tonic::Code::Cancelled => FerrumError::cancelled(text),
            tonic::Code::Unavailable => FerrumError::network(text),
            _ => FerrumError::backend(text),
        },
    }
}

/// One remote sequence: its latest handle, released on the server when dropped.
pub struct Lease {
    client: ExecutorClient,
    runtime: tokio::runtime::Handle,
    handle: Mutex<pb::KvCacheHandle>,
    released: AtomicBool,
    /// Releases sent and not yet answered (shared by an executor's leases).
    pending: Arc<AtomicUsize>,
    /// The executor's decode-ahead runs: a sequence one of them decodes is settled
    /// (its run stopped and read to the sequence's end) before it is released.
    book: Option<Arc<tokio::sync::Mutex<Book>>>,
    /// The last change a DecodeSession step or run made to the sequence, until a later
    /// call moves it: the server undoes it if that stream ends before a later request on
    /// it names the sequence (server/rpc/session.py), so after a break the executor
    /// re-synchronises the sequence from it (`RemoteExecutor::resync`).
    unconfirmed: Mutex<Option<Unconfirmed>>,
}

/// A sequence's change on a DecodeSession stream that the server may still undo.
#[derive(Clone)]
pub(crate) struct Unconfirmed {
    /// The stream that made it: a change on a stream that is still up is confirmed by
    /// the next request naming the sequence (or stands when the stream ends cleanly).
    pub session: Weak<SharedSession>,
    /// The handle before the change, and the tokens that redo it (ForwardVerify).
    pub before: pb::KvCacheHandle,
    pub tokens: Vec<u32>,
}

impl Unconfirmed {
    /// True once its stream is gone: the server may have undone the change.
    fn lost(&self) -> bool {
        self.session.upgrade().map_or(true, |s| s.is_broken())
    }
}

impl Lease {
    fn new(
        client: &ExecutorClient,
        handle: pb::KvCacheHandle,
        pending: Arc<AtomicUsize>,
        book: Option<Arc<tokio::sync::Mutex<Book>>>,
    ) -> Arc<Self> {
        Arc::new(Lease {
            client: client.clone(),
            runtime: tokio::runtime::Handle::current(),
            handle: Mutex::new(handle),
            released: AtomicBool::new(false),
            pending,
            book,
            unconfirmed: Mutex::new(None),
        })
    }

    /// The server handle the next call sends.
    pub fn handle(&self) -> pb::KvCacheHandle {
        self.handle.lock().unwrap().clone()
    }

    /// The handle a call returned; a change made by a call other than a session's
    /// moves the sequence off the length an undo would apply at, so none is pending.
    pub(crate) fn set(&self, handle: pb::KvCacheHandle) {
        *self.handle.lock().unwrap() = handle;
        *self.unconfirmed.lock().unwrap() = None;
    }

    /// Records the handle a session step or run left (see [`Unconfirmed`]).
    pub(crate) fn set_unconfirmed(&self, handle: pb::KvCacheHandle, change: Unconfirmed) {
        *self.handle.lock().unwrap() = handle;
        *self.unconfirmed.lock().unwrap() = Some(change);
    }

    /// Forgets the pending change: a later request on its stream named the sequence.
    pub(crate) fn confirmed(&self) {
        *self.unconfirmed.lock().unwrap() = None;
    }

    fn unconfirmed(&self) -> Option<Unconfirmed> {
        self.unconfirmed.lock().unwrap().clone()
    }

    /// Tokens in the sequence.
    pub fn len(&self) -> usize {
        self.handle.lock().unwrap().sequence_length as usize
    }

    /// The server's id of the sequence.
    pub fn cache_id(&self) -> String {
        self.handle.lock().unwrap().cache_id.clone()
    }

    /// Releases the sequence now (once; in the background, its failure ignored: a
    /// sequence the server lost is gone anyway, and one it kept idles out).
    pub fn release(&self) {
        if self.released.swap(true, Ordering::SeqCst) {
            return;
        }
        let client = self.client.with_timeout(Some(Duration::from_secs(5)));
        let id = self.cache_id();
        let pending = self.pending.clone();
        let book = self.book.clone();
        pending.fetch_add(1, Ordering::SeqCst);
        self.runtime.spawn(async move {
            if let Some(book) = book {
                // A run still decoding the sequence is stopped and read to the
                // sequence's end first: the release follows the run's last forward on it.
                book.lock().await.forget(&id).await;
            }
            let _ = client.release_cache(&id).await;
            pending.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.release();
    }
}

/// A remote sequence as Ferrum's `KvCacheHandle`. Clones share the sequence (one
/// lease); its KV lives on the server, so `key_cache`/`value_cache` are None.
#[derive(Clone)]
pub struct RemoteKvCacheHandle {
    lease: Arc<Lease>,
    key: String,
    length: usize,
    block_table: BlockTable,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl std::fmt::Debug for RemoteKvCacheHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteKvCacheHandle").field("key", &self.key).field("length", &self.length).finish()
    }
}

impl RemoteKvCacheHandle {
    fn new(lease: Arc<Lease>, key: String) -> Self {
        let h = lease.handle();
        let block_size = h.block_table.as_ref().map(|b| b.block_size as usize).unwrap_or(16).max(1);
        let mut block_table = BlockTable::new(block_size);
        block_table.sequence_length = h.sequence_length as usize;
        RemoteKvCacheHandle {
            key,
            length: h.sequence_length as usize,
            block_table,
            layers: h.num_layers as usize,
            kv_heads: h.num_kv_heads as usize,
            head_dim: h.head_dim as usize,
            lease,
        }
    }

    /// The server handle of this sequence now.
    pub fn server_handle(&self) -> pb::KvCacheHandle {
        self.lease.handle()
    }

    /// The lease shared by every handle of this sequence.
    pub fn lease(&self) -> &Arc<Lease> {
        &self.lease
    }
}

impl KvCacheHandle for RemoteKvCacheHandle {
    fn block_table(&self) -> &BlockTable {
        &self.block_table
    }
    fn block_table_mut(&mut self) -> &mut BlockTable {
        &mut self.block_table
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn device(&self) -> Device {
        Device::CPU
    }
    fn num_tokens(&self) -> usize {
        self.length
    }
    fn num_layers(&self) -> usize {
        self.layers
    }
    fn num_heads(&self) -> usize {
        self.kv_heads
    }
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    fn key_cache(&self, _layer: usize) -> Result<Option<TensorRef>> {
        Ok(None)
    }
    fn value_cache(&self, _layer: usize) -> Result<Option<TensorRef>> {
        Ok(None)
    }
    fn clone_handle(&self) -> Result<Arc<dyn KvCacheHandle>> {
        Ok(Arc::new(self.clone()))
    }
    fn stats(&self) -> CacheHandleStats {
        CacheHandleStats {
            memory_bytes: 0,
            blocks_allocated: self.length.div_ceil(self.block_table.block_size.max(1)),
            tokens_stored: self.length,
            utilization: 0.0,
            last_access: std::time::Instant::now(),
        }
    }
    fn is_valid(&self) -> bool {
        !self.lease.released.load(Ordering::SeqCst)
    }
    fn cache_id(&self) -> String {
        self.key.clone()
    }
}

/// Float32 rows as Ferrum's `TensorLike`: logits read from a reply, or token ids.
#[derive(Clone)]
pub struct LogitsTensor {
    data: Arc<Vec<f32>>,
    offset: usize,
    shape: Vec<usize>,
}

impl std::fmt::Debug for LogitsTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LogitsTensor{:?}", self.shape)
    }
}

impl LogitsTensor {
    /// `rows` x `vocab` values shaped as `shape`.
    pub fn new(data: Vec<f32>, shape: Vec<usize>) -> Self {
        LogitsTensor { data: Arc::new(data), offset: 0, shape }
    }

    fn numel_of(shape: &[usize]) -> usize {
        shape.iter().product()
    }

    /// The values (row-major).
    pub fn values(&self) -> &[f32] {
        &self.data[self.offset..self.offset + Self::numel_of(&self.shape)]
    }
}

impl TensorLike for LogitsTensor {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn dtype(&self) -> DataType {
        DataType::FP32
    }
    fn device(&self) -> Device {
        Device::CPU
    }
    fn is_contiguous(&self) -> bool {
        true
    }
    /// A view along the leading dimensions that keeps whole last-dimension rows (what
    /// Ferrum takes: the last position of [batch, seq, vocab]).
    fn view(&self, start: &[usize], end: &[usize]) -> Result<TensorRef> {
        let n = self.shape.len();
        if start.len() != n || end.len() != n || start[n - 1] != 0 || end[n - 1] != self.shape[n - 1] {
            return Err(FerrumError::unsupported("LogitsTensor views keep whole rows"));
        }
        // Row-major: only a contiguous block of rows is a view; that holds when every
        // dimension but one leading range is taken whole or has size 1.
        let mut strides = vec![1usize; n];
        for d in (0..n - 1).rev() {
            strides[d] = strides[d + 1] * self.shape[d + 1];
        }
        let offset = self.offset + (0..n).map(|d| start[d] * strides[d]).sum::<usize>();
        let shape: Vec<usize> = (0..n).map(|d| end[d] - start[d]).collect();
        let contiguous = (1..n).all(|d| shape[d] == self.shape[d] || (0..d).all(|e| shape[e] == 1));
        if !contiguous {
            return Err(FerrumError::unsupported("LogitsTensor view is not contiguous"));
        }
        Ok(Arc::new(LogitsTensor { data: self.data.clone(), offset, shape }))
    }
    fn reshape(&self, shape: &[usize]) -> Result<TensorRef> {
        if Self::numel_of(shape) != Self::numel_of(&self.shape) {
            return Err(FerrumError::invalid_parameter("reshape changes the element count"));
        }
        Ok(Arc::new(LogitsTensor { data: self.data.clone(), offset: self.offset, shape: shape.to_vec() }))
    }
    fn to_cpu(&self) -> Result<TensorRef> {
        Ok(Arc::new(self.clone()))
    }
    fn to_device(&self, device: &Device) -> Result<TensorRef> {
        match device {
            Device::CPU => Ok(Arc::new(self.clone())),
            _ => Err(FerrumError::unsupported("remote logits live on the host")),
        }
    }
    fn to_dtype(&self, dtype: DataType) -> Result<TensorRef> {
        match dtype {
            DataType::FP32 => Ok(Arc::new(self.clone())),
            _ => Err(FerrumError::unsupported("remote logits are float32")),
        }
    }
    fn to_vec_f32(&self) -> Result<Vec<f32>> {
        Ok(self.values().to_vec())
    }
    fn to_vec_u32(&self) -> Result<Vec<u32>> {
        Ok(self.values().iter().map(|v| *v as u32).collect())
    }
    fn argmax_last_dim_u32(&self) -> Result<u32> {
        let v = self.values();
        let vocab = *self.shape.last().unwrap_or(&v.len());
        let row = &v[v.len() - vocab..];
        let mut best = (0usize, f32::NEG_INFINITY);
        for (i, x) in row.iter().enumerate() {
            if *x > best.1 {
                best = (i, *x);
            }
        }
        Ok(best.0 as u32)
    }
}

/// Token ids as a `[1, n]` tensor (for callers of the executor outside the engine).
pub fn token_tensor(ids: &[u32]) -> TensorRef {
    Arc::new(LogitsTensor::new(ids.iter().map(|&t| t as f32).collect(), vec![1, ids.len()]))
}

fn logits_rows(logits: Option<&pb::Logits>) -> Result<(Vec<f32>, usize, usize)> {
    let view = logits
        .and_then(LogitsView::of)
        .ok_or_else(|| FerrumError::backend("reply without full logits"))?;
    let mut out = Vec::with_capacity(view.rows() * view.vocab());
    for r in 0..view.rows() {
        match view.row_f32_slice(r) {
            Some(s) => out.extend_from_slice(s),
            None => out.extend(view.row_to_vec(r)),
        }
    }
    Ok((out, view.rows(), view.vocab()))
}

/// The last row of a reply's logits (copied once out of the reply's bytes).
fn last_row_vec(logits: Option<&pb::Logits>) -> Result<Vec<f32>> {
    let view = logits
        .and_then(LogitsView::of)
        .ok_or_else(|| FerrumError::backend("reply without full logits"))?;
    if view.rows() == 0 {
        return Err(FerrumError::backend("reply with no logits rows"));
    }
    let r = view.rows() - 1;
    Ok(match view.row_f32_slice(r) {
        Some(s) => s.to_vec(),
        None => view.row_to_vec(r),
    })
}

/// The last row of a reply's logits, shaped `shape_prefix + [vocab]`.
fn last_row(logits: Option<&pb::Logits>, shape_prefix: &[usize]) -> Result<LogitsTensor> {
    let row = last_row_vec(logits)?;
    let mut shape = shape_prefix.to_vec();
    shape.push(row.len());
    Ok(LogitsTensor::new(row, shape))
}

/// A unified-batch item's result: its last position's logits row, or, for an item
/// the server chose a greedy token for, the one-element row holding that id (the
/// engine's model-side argmax form).
fn item_result(logits: Option<&pb::Logits>, chosen: Option<&pb::ChosenToken>, greedy: bool) -> Result<Vec<f32>> {
    if greedy {
        let c = chosen.ok_or_else(|| FerrumError::backend("reply without the chosen token"))?;
        return Ok(vec![c.token_id as f32]);
    }
    last_row_vec(logits)
}

/// The logits policy of a call whose items are `greedy` (a token choice) or not: FULL
/// when an item needs its row; else ARGMAX (a few bytes) when an item has no choice
/// (a prompt's middle chunk, whose result is unused); else none (choices only).
fn policy_for(need_rows: bool, all_chosen: bool) -> Option<pb::LogitsPolicy> {
    if need_rows {
        Some(policy::full())
    } else if all_chosen {
        None
    } else {
        Some(policy::argmax())
    }
}

#[derive(Default)]
struct Counters {
    /// Trait calls by method: prefill, batch_prefill, decode/batch_decode, unified_decode,
    /// forward_verify, truncate_kv.
    calls: [AtomicU64; 6],
    prefills: AtomicU64,
    decodes: AtomicU64,
    prefill_ns: AtomicU64,
    decode_ns: AtomicU64,
    /// Tokens the server chose for the engine (greedy items), and decode steps sent
    /// over the DecodeSession stream.
    chosen: AtomicU64,
    session_steps: AtomicU64,
    /// Decode-ahead runs started, engine steps answered from a run's tokens (the runs'
    /// first tokens included), and settles that changed the server's sequence (a run's
    /// lead the engine never took cut off, or a failed run's taken tokens replayed).
    ahead_runs: AtomicU64,
    ahead_served: AtomicU64,
    ahead_cut: AtomicU64,
    /// Of those settles, the replays after a failed run.
    ahead_replayed: AtomicU64,
    /// Sequences brought back in line after the DecodeSession stream that last changed
    /// them broke (see `RemoteExecutor::resync`).
    resynced: AtomicU64,
}

/// Ferrum's `ModelExecutor` on a ferrum-rpc server.
pub struct RemoteExecutor {
    client: ExecutorClient,
    info: ModelInfo,
    caps: pb::Capabilities,
    status: Arc<Mutex<Option<pb::Status>>>,
    /// Sequences made for an engine-minted cache id, under that id.
    by_key: Mutex<HashMap<String, Arc<Lease>>>,
    /// Every live sequence under its server cache_id (weak: handles own them).
    by_id: Mutex<HashMap<String, Weak<Lease>>>,
    counters: Counters,
    /// The last failed call's error ("REASON: message"), for callers that see only the
    /// engine's outcome.
    last_error: Mutex<Option<String>>,
    pending: Arc<AtomicUsize>,
    refresher: tokio::task::JoinHandle<()>,
    /// The decode steps' stream, opened on the first step and again after it broke.
    session: Mutex<Option<Arc<SharedSession>>>,
    /// Decode-ahead runs and the sequences they decode (see crate::ahead).
    book: Arc<tokio::sync::Mutex<Book>>,
    /// Most tokens a run decodes per sequence (0: no decoding ahead), and the most the
    /// server and client allow (0: decoding ahead is not possible).
    ahead_window: u32,
    ahead_limit: u32,
    /// Forwards of a run the server answers in one response.
    ahead_batch: u32,
    /// The model's end-of-sequence ids: a run ends a sequence at one.
    stop_ids: Vec<u32>,
    /// The last token mask sent, by its fingerprint and length, as the contract's
    /// bitmask bytes (the engine's mask is the same every step of a request).
    mask_bits: Mutex<Option<(u64, usize, bytes::Bytes)>>,
}

impl Drop for RemoteExecutor {
    fn drop(&mut self) {
        self.refresher.abort();
    }
}

fn model_type(arch: &str) -> ModelType {
    let a = arch.to_ascii_lowercase();
    if a.contains("qwen") {
        ModelType::Qwen
    } else if a.contains("mistral") {
        ModelType::Mistral
    } else {
        ModelType::Llama
    }
}

fn data_type(d: i32) -> DataType {
    match pb::DType::try_from(d).unwrap_or(pb::DType::DtypeFloat32) {
        pb::DType::DtypeFloat16 => DataType::FP16,
        pb::DType::DtypeBfloat16 => DataType::BF16,
        _ => DataType::FP32,
    }
}

impl RemoteExecutor {
    /// Reads the model's facts and capabilities from the server and starts the status
    /// snapshot. Must run inside a tokio runtime (releases are spawned on it).
    pub async fn new(client: ExecutorClient) -> std::result::Result<Self, ExecutorError> {
        let mi = client.info().await?;
        let caps = client.capabilities().await?;
        let first = client.status().await.ok();
        let status = Arc::new(Mutex::new(first));
        let weak: Weak<Mutex<Option<pb::Status>>> = Arc::downgrade(&status);
        let c = client.with_timeout(Some(Duration::from_secs(2)));
        let refresher = tokio::spawn(async move {
            loop {
                tokio::time::sleep(STATUS_REFRESH).await;
                let Some(slot) = weak.upgrade() else { return };
                if let Ok(s) = c.status().await {
                    *slot.lock().unwrap() = Some(s);
                }
            }
        });
        let mut metadata = HashMap::new();
        metadata.insert("ferrum_arch".into(), serde_json::Value::String(mi.architecture.to_ascii_lowercase()));
        metadata.insert(
            "eos_token_ids".into(),
            serde_json::Value::Array(mi.eos_token_ids.iter().map(|&t| t.into()).collect()),
        );
        let info = ModelInfo {
            model_id: ModelId::new(mi.name.clone()),
            model_type: model_type(&mi.architecture),
            num_parameters: mi.parameter_count,
            hidden_size: mi.hidden_size as usize,
            num_layers: mi.num_layers as usize,
            num_heads: mi.num_attention_heads as usize,
            num_kv_heads: mi.num_kv_heads as usize,
            vocab_size: mi.vocab_size as usize,
            max_sequence_length: caps.max_sequence_length.min(mi.max_sequence_length).max(1) as usize,
            dtype: data_type(mi.dtype),
            device: Device::CPU,
            version: None,
            license: None,
            metadata,
        };
        // Decoding ahead needs the session, the server's token choice, and no per-call
        // deadline (a session step has none; such a client steps with BatchDecode).
        let ahead_limit = if caps.decode_session && caps.token_choice && client.options().timeout.is_none() {
            caps.max_decode_ahead
        } else {
            0
        };
        let ahead_window = WINDOW.min(ahead_limit);
        let vocab = mi.vocab_size;
        let mut stop_ids: Vec<u32> = mi.eos_token_ids.iter().copied().filter(|&t| t < vocab).collect();
        stop_ids.sort_unstable();
        stop_ids.dedup();
        stop_ids.truncate(64); // DecodeSessionRequest.stop_token_ids' bound
        Ok(RemoteExecutor {
            client,
            info,
            caps,
            status,
            by_key: Mutex::new(HashMap::new()),
            by_id: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            last_error: Mutex::new(None),
            pending: Arc::new(AtomicUsize::new(0)),
            refresher,
            session: Mutex::new(None),
            book: Arc::new(tokio::sync::Mutex::new(Book::default())),
            ahead_window,
            ahead_limit,
            ahead_batch: 1,
            stop_ids,
            mask_bits: Mutex::new(None),
        })
    }

    /// Decoding ahead with runs of at most `window` tokens per sequence (0: never);
    /// the server's `max_decode_ahead` bounds it, and a client with a per-call deadline
    /// never decodes ahead. The default is [`WINDOW`].
    pub fn with_decode_ahead(mut self, window: u32) -> Self {
        self.ahead_window = window.min(self.ahead_limit);
        self
    }

    /// A run's forwards the server answers in one response (at least 1, the default):
    /// 1 hands each token over as soon as it is chosen, for an engine streaming to users;
    /// more (e.g. [`crate::ahead::UNWATCHED_FORWARDS_PER_RESPONSE`]) cost both sides
    /// fewer messages where nobody watches the tokens come, and hold each up to that
    /// many forwards.
    pub fn with_ahead_batch(mut self, forwards: u32) -> Self {
        self.ahead_batch = forwards.max(1);
        self
    }

    /// The last failed call's error, as "REASON: message" (the code's name without a
    /// reason).
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().unwrap().clone()
    }

    fn failed(&self, err: ExecutorError) -> FerrumError {
        *self.last_error.lock().unwrap() = Some(err.to_string());
        to_ferrum(err)
    }

    /// How often the engine called each trait method, as "name=count" pairs.
    pub fn call_counts(&self) -> String {
        let names = ["prefill", "batch_prefill", "batch_decode", "unified_decode", "forward_verify", "truncate_kv"];
        let c = &self.counters;
        let mut pairs: Vec<String> =
            names.iter().zip(&c.calls).map(|(n, c)| format!("{n}={}", c.load(Ordering::Relaxed))).collect();
        pairs.push(format!("server_chosen={}", c.chosen.load(Ordering::Relaxed)));
        pairs.push(format!("session_steps={}", c.session_steps.load(Ordering::Relaxed)));
        pairs.push(format!("ahead_runs={}", c.ahead_runs.load(Ordering::Relaxed)));
        pairs.push(format!("ahead_served={}", c.ahead_served.load(Ordering::Relaxed)));
        pairs.push(format!("ahead_cut={}", c.ahead_cut.load(Ordering::Relaxed)));
        pairs.push(format!("ahead_replayed={}", c.ahead_replayed.load(Ordering::Relaxed)));
        pairs.push(format!("resynced={}", c.resynced.load(Ordering::Relaxed)));
        pairs.join(" ")
    }

    fn count(&self, method: usize) {
        self.counters.calls[method].fetch_add(1, Ordering::Relaxed);
    }

    /// The client this executor calls through.
    pub fn client(&self) -> &ExecutorClient {
        &self.client
    }

    /// The length the handle of the engine's sequence `key` names: the server's length
    /// of it, the engine's too once no decode-ahead run holds the sequence.
    pub fn sequence_len(&self, key: &str) -> Option<usize> {
        self.lease_for_key(key).map(|l| l.len())
    }

    /// Remote sequences this executor made that are not yet released.
    pub fn live_sequences(&self) -> usize {
        let ids = self.by_id.lock().unwrap();
        ids.values()
            .filter_map(|w| w.upgrade())
            .filter(|l| !l.released.load(Ordering::SeqCst))
            .count()
            + self.by_key.lock().unwrap().values().filter(|l| !l.released.load(Ordering::SeqCst)).count()
    }

    /// Releases every remote sequence this executor made, and waits (up to `within`)
    /// until the server answered each release.
    pub async fn release_all(&self, within: Duration) {
        let held: Vec<Arc<Lease>> = self.by_key.lock().unwrap().drain().map(|(_, l)| l).collect();
        let live: Vec<Arc<Lease>> = self.by_id.lock().unwrap().values().filter_map(|w| w.upgrade()).collect();
        for lease in held.iter().chain(&live) {
            lease.release();
        }
        let deadline = tokio::time::Instant::now() + within;
        while self.pending.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits (up to `within`) until the engine released every sequence it had and the
    /// server answered the releases. True when nothing is left.
    pub async fn wait_released(&self, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let quiet = self.live_sequences() == 0 && self.pending.load(Ordering::SeqCst) == 0;
            if quiet || tokio::time::Instant::now() >= deadline {
                return quiet;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The lease a handle names: one of ours (downcast), else one held under its id.
    fn lease_of(&self, handle: &Arc<dyn KvCacheHandle>) -> Option<Arc<Lease>> {
        if let Some(h) = handle.as_any().downcast_ref::<RemoteKvCacheHandle>() {
            return Some(h.lease.clone());
        }
        self.by_key.lock().unwrap().get(&handle.cache_id()).cloned()
    }

    fn lease_for_key(&self, key: &str) -> Option<Arc<Lease>> {
        self.by_key.lock().unwrap().get(key).cloned()
    }

    fn out_handle(&self, lease: &Arc<Lease>, key: Option<String>) -> Arc<dyn KvCacheHandle> {
        let key = key.unwrap_or_else(|| lease.cache_id());
        Arc::new(RemoteKvCacheHandle::new(lease.clone(), key))
    }

    fn key_of(handle: &Arc<dyn KvCacheHandle>) -> String {
        match handle.as_any().downcast_ref::<RemoteKvCacheHandle>() {
            Some(h) => h.key.clone(),
            None => handle.cache_id(),
        }
    }

    fn lease(&self, handle: pb::KvCacheHandle) -> Arc<Lease> {
        let lease = Lease::new(&self.client, handle, self.pending.clone(), Some(self.book.clone()));
        let mut ids = self.by_id.lock().unwrap();
        ids.retain(|_, w| w.strong_count() > 0);
        ids.insert(lease.cache_id(), Arc::downgrade(&lease));
        lease
    }

    /// The lease a prefill's reply ``handle`` belongs to: the continued sequence's (moved
    /// to the new handle), or a new one, held under the engine's ``key`` where it has one.
    fn adopt(&self, lease: Option<Arc<Lease>>, key: Option<&str>, handle: pb::KvCacheHandle) -> Arc<Lease> {
        match lease {
            Some(l) => {
                l.set(handle);
                l
            }
            None => {
                let l = self.lease(handle);
                if let Some(k) = key {
                    self.held(k, l.clone());
                }
                l
            }
        }
    }

    fn held(&self, key: &str, lease: Arc<Lease>) {
        if let Some(old) = self.by_key.lock().unwrap().insert(key.to_string(), lease) {
            old.release();
        }
    }

    /// The server's greedy choice standing for the engine's `policy`, when it asks for
    /// the argmax only and the contract can say the same: its token mask as the
    /// allowed-token bitmask (none where it forbids nothing), no repetition penalty (the
    /// engine's penalises its own token list, the server's the whole sequence: those rows
    /// keep full logits).
    fn greedy_choice(&self, policy: &LogitsReturnPolicy) -> Option<pb::TokenChoice> {
        let LogitsReturnPolicy::GreedyArgmax { token_mask, repetition_penalty } = policy else {
            return None;
        };
        if repetition_penalty.as_ref().is_some_and(|p| !p.is_empty()) {
            return None;
        }
        let vocab = self.info.vocab_size;
        if vocab == 0 || vocab > (1 << 24) {
            return None; // the id must be exact as the engine's f32
        }
        let allowed = match token_mask {
            None => bytes::Bytes::new(),
            Some(mask) => self.mask_bitmask(mask, vocab)?,
        };
        // A mask that forbids tokens goes as the bitmask: the server's greedy choice under
        // one costs about what plain greedy costs (its argmax stands where the mask allows
        // it), and its logprob is RAW, which the engine does not read.
        Some(pb::TokenChoice {
            temperature: Some(0.0),
            allowed_token_bitmask: allowed,
            ..Default::default()
        })
    }

    /// `mask` (one i8 per token, non-zero allowed) over the first `vocab` tokens as the
    /// contract's bitmask (empty when every token is allowed).
    fn mask_bitmask(&self, mask: &TokenSelectionMask, vocab: usize) -> Option<bytes::Bytes> {
        let valid = &mask.valid_token_mask;
        if valid.len() < vocab {
            return None;
        }
        if let Some((fp, len, bits)) = self.mask_bits.lock().unwrap().as_ref() {
            if *fp == mask.fingerprint && *len == valid.len() {
                return Some(bits.clone());
            }
        }
        let words = vocab.div_ceil(32);
        let mut bits = vec![0u32; words];
        let mut any = false;
        let mut all = true;
        for (i, v) in valid[..vocab].iter().enumerate() {
            if *v != 0 {
                bits[i / 32] |= 1 << (i % 32);
                any = true;
            } else {
                all = false;
            }
        }
        if !any {
            return None;
        }
        let bytes = if all {
            bytes::Bytes::new()
        } else {
            bytes::Bytes::from(bits.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>())
        };
        *self.mask_bits.lock().unwrap() = Some((mask.fingerprint, valid.len(), bytes.clone()));
        Some(bytes)
    }

    /// One decode step per input in ONE step (all or nothing): a DecodeSession step,
    /// or a BatchDecode where the client has a per-call deadline. An input with a token
    /// choice gets the server's token, the others their logits row.
    async fn decode_step(&self, inputs: &[(u32, Arc<Lease>, Option<pb::TokenChoice>)]) -> Result<Vec<Vec<f32>>> {
        let t0 = std::time::Instant::now();
        let need_rows = inputs.iter().any(|i| i.2.is_none());
        let greedy: Vec<bool> = inputs.iter().map(|i| i.2.is_some()).collect();
        let before: Vec<pb::KvCacheHandle> = inputs.iter().map(|i| i.1.handle()).collect();
        let items: Vec<pb::DecodeItem> = inputs
            .iter()
            .map(|(t, l, c)| pb::DecodeItem { token_id: *t, kv_cache: Some(l.handle()), token_choice: c.clone() })
            .collect();
        let logits = policy_for(need_rows, true);
        let mut session = None;
        let replies: Vec<(Option<pb::Logits>, Option<pb::KvCacheHandle>, Option<pb::ChosenToken>)> =
            if self.client.options().timeout.is_some() {
                let r = self.client.batch_decode(items, logits, true).await.map_err(|e| self.failed(e))?;
                r.into_iter().map(|r| (r.logits, r.kv_cache, r.chosen)).collect()
            } else {
                let (r, s) = self.session_step(items, logits).await?;
                session = Some(s);
                r.into_iter().map(|r| (r.logits, r.kv_cache, r.chosen)).collect()
            };
        if replies.len() != inputs.len() {
            return Err(FerrumError::backend(format!("a decode step answered {} of {} items", replies.len(), inputs.len())));
        }
        let mut out = Vec::with_capacity(inputs.len());
        for (((logits, handle, chosen), ((token, lease, _), greedy)), before) in
            replies.into_iter().zip(inputs.iter().zip(greedy)).zip(before)
        {
            match (handle, &session) {
                (Some(h), Some(s)) => {
                    let change = Unconfirmed { session: Arc::downgrade(s), before, tokens: vec![*token] };
                    lease.set_unconfirmed(h, change)
                }
                (Some(h), None) => lease.set(h),
                (None, _) => {}
            }
            out.push(item_result(logits.as_ref(), chosen.as_ref(), greedy)?);
            self.counters.chosen.fetch_add(greedy as u64, Ordering::Relaxed);
        }
        self.counters.decodes.fetch_add(inputs.len() as u64, Ordering::Relaxed);
        self.counters.decode_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(out)
    }

    /// One step on the executor's DecodeSession (opened here when there is none, or the
    /// last one broke). A step that failed on its own leaves the session open; one whose
    /// stream failed drops it, and the next step opens a new one.
    async fn session_step(
        &self,
        items: Vec<pb::DecodeItem>,
        logits: Option<pb::LogitsPolicy>,
    ) -> Result<(Vec<pb::DecodeSessionResponse>, Arc<SharedSession>)> {
        self.counters.session_steps.fetch_add(1, Ordering::Relaxed);
        let session = self.session();
        let replies = session.step(items, logits, true).await.map_err(|e| self.failed(e))?;
        Ok((replies, session))
    }

    /// Ends the executor's DecodeSession stream (a cancel: what a lost connection does
    /// to it) once no run still reads it; the next step opens a new one. Sequences whose
    /// last change the server may undo with it are re-synchronised before their next
    /// call (see `resync`).
    pub fn reset_session(&self) {
        self.session.lock().unwrap().take();
    }

    /// Brings `lease`'s sequence in line when the stream that last changed it broke
    /// before a later request on it named the sequence: the server undoes such a change
    /// when the stream ends (server/rpc/session.py), sooner or later. See `redo`.
    async fn resync(&self, lease: &Lease) -> std::result::Result<(), ExecutorError> {
        match lease.unconfirmed() {
            Some(u) if u.lost() => self.redo(lease, &u.before, &u.tokens).await,
            _ => Ok(()),
        }
    }

    /// Puts `lease`'s sequence at `before` plus `tokens`, whether the server undid the
    /// change since `before` or not yet: a TruncateKv to `before`'s length from the
    /// lease's handle (which moves the sequence off the length a later undo applies at,
    /// so that undo is skipped), or `before` as it is when the server answers
    /// LENGTH_MISMATCH (it undid the change already); then ForwardVerify appends `tokens`
    /// again (the same tokens: the same KV). On failure the sequence stays pending, so
    /// its next call tries again.
    async fn redo(&self, lease: &Lease, before: &pb::KvCacheHandle, tokens: &[u32]) -> std::result::Result<(), ExecutorError> {
        let done = async {
            match self.client.truncate_kv(&lease.handle(), before.sequence_length).await {
                Ok(h) => lease.set(h),
                Err(e) if e.reason.as_deref() == Some("LENGTH_MISMATCH") => lease.set(before.clone()),
                Err(e) => return Err(e),
            }
            if !tokens.is_empty() {
                let reply = self.client.forward_verify(tokens, &lease.handle(), Some(policy::argmax())).await?;
                if let Some(h) = reply.kv_cache {
                    lease.set(h);
                }
            }
            Ok(())
        }
        .await;
        match &done {
            Ok(()) => {
                self.counters.resynced.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                let change = Unconfirmed { session: Weak::new(), before: before.clone(), tokens: tokens.to_vec() };
                lease.set_unconfirmed(lease.handle(), change);
            }
        }
        done
    }

    /// The executor's DecodeSession (opened here when there is none, or the last one
    /// broke). Steps and runs share it; a step that failed on its own leaves it open.
    fn session(&self) -> Arc<SharedSession> {
        let mut slot = self.session.lock().unwrap();
        if slot.as_ref().map_or(true, |s| s.is_broken()) {
            *slot = Some(Arc::new(self.client.shared_session()));
        }
        slot.clone().unwrap()
    }

    /// Tokens a run started at `item`'s step may decode: the window, or fewer where the
    /// engine's item says how long the request may grow (Ferrum's
    /// `ferrum_kv_capacity_hint`: prompt plus max_tokens less one, so the run ends with
    /// the request's last token); 0 when this executor does not decode ahead.
    fn ahead_len(&self, item: &UnifiedBatchItem) -> u32 {
        if self.ahead_window == 0 {
            return 0;
        }
        let left = item
            .metadata
            .get("ferrum_kv_capacity_hint")
            .and_then(|v| v.as_u64())
            .map(|h| h as usize)
            .filter(|&h| h > item.pos_offset)
            .map(|h| h - item.pos_offset);
        left.map_or(self.ahead_window, |l| l.min(self.ahead_window as usize) as u32)
    }

    /// Takes `key` out of the book and brings the server's sequence to the engine's
    /// length: a run's tokens the engine never took are cut off (TruncateKv); after a
    /// failed run (undone by the server, for every sequence it covered) the tokens it
    /// did take are appended again (ForwardVerify). When that call fails, the sequence
    /// goes back in the book, so the next call on it settles it again.
    async fn settle(&self, book: &mut Book, key: &str) -> Result<()> {
        let Some(s) = book.detach(key).await else { return Ok(()) };
        let Some(lease) = s.lease.upgrade() else { return Ok(()) };
        if lease.released.load(Ordering::SeqCst) {
            return Ok(());
        }
        if let Err(e) = self.bring_level(&s, &lease).await {
            book.restore(key, s);
            return Err(self.failed(e));
        }
        let engine_len = s.engine_len();
        if lease.len() != engine_len {
            return Err(FerrumError::backend(format!(
                "sequence {key} holds {} tokens on the server after its decode-ahead run, the engine {engine_len}",
                lease.len()
            )));
        }
        Ok(())
    }

    /// The server call `settle` makes for `s`, if any: the replay after a failed run,
    /// or the cut after a run that went past the engine.
    async fn bring_level(&self, s: &SeqAhead, lease: &Lease) -> std::result::Result<(), ExecutorError> {
        let engine_len = s.engine_len();
        if s.tokens.is_empty() {
            // The run never answered: if its stream broke, the server may not have read
            // its request, so the sequence's change before it may be undone as well.
            self.resync(lease).await?;
        } else {
            lease.confirmed(); // the server read the run's request, which named the sequence
        }
        let lost = s.session.upgrade().map_or(true, |x| x.is_broken());
        if s.failed.is_some() {
            if s.taken > 0 {
                let tokens = s.taken_inputs();
                let reply = self.client.forward_verify(&tokens, &lease.handle(), Some(policy::argmax())).await?;
                if let Some(h) = reply.kv_cache {
                    lease.set(h);
                }
                self.counters.ahead_cut.fetch_add(1, Ordering::Relaxed);
                self.counters.ahead_replayed.fetch_add(1, Ordering::Relaxed);
            }
        } else if let Some(end) = &s.end {
            lease.set(end.clone());
            if lost {
                // The run's stream broke before a later request named the sequence: the
                // server undoes the run (now or later); the engine's tokens go back on.
                self.redo(lease, &s.base, &s.taken_inputs()).await?;
            } else if lease.len() > engine_len {
                match self.client.truncate_kv(&lease.handle(), engine_len as u32).await {
                    Ok(h) => lease.set(h),
                    // the stream broke and the server undid the run before this reader saw it
                    Err(e) if e.reason.as_deref() == Some("LENGTH_MISMATCH") => {
                        self.redo(lease, &s.base, &s.taken_inputs()).await?
                    }
                    Err(e) => return Err(e),
                }
                self.counters.ahead_cut.fetch_add(1, Ordering::Relaxed);
            } else {
                // Every token taken, no call to make: the run stands once a later request
                // on its stream names the sequence, or is redone if the stream breaks first.
                let change = Unconfirmed { session: s.session.clone(), before: s.base.clone(), tokens: s.taken_inputs() };
                lease.set_unconfirmed(end.clone(), change);
            }
        }
        Ok(())
    }

    /// Settles `lease`'s sequence when a run decodes it (before any call but a step).
    async fn settle_lease(&self, lease: &Arc<Lease>) -> Result<()> {
        let key = lease.cache_id();
        let mut book = self.book.lock().await;
        if book.holds(&key) {
            self.settle(&mut book, &key).await?;
        }
        self.resync(lease).await.map_err(|e| self.failed(e))
    }

    /// A unified batch's decode steps: `served` from their runs' tokens, `fresh` starting
    /// one run together (as long as the shortest of their lengths, so no sequence's run
    /// outlasts its request), the rest (`decode_idx`/`decode_work`) in one plain step.
    /// Steps that would pass the seats the server allows or [`MAX_RUNS`], or that the
    /// server refused a run for lack of seats, go in a plain step instead. On error no
    /// run token counts as taken: the engine steps those sequences again.
    async fn decode_ahead(
        &self,
        book: &mut Book,
        results: &mut [Option<Vec<f32>>],
        served: Vec<(usize, String)>,
        mut fresh: Vec<(usize, String, Arc<Lease>, u32, pb::TokenChoice, u32)>,
        mut decode_idx: Vec<usize>,
        mut decode_work: Vec<(u32, Arc<Lease>, Option<pb::TokenChoice>)>,
    ) -> Result<()> {
        let t0 = std::time::Instant::now();
        let room = if book.runs() >= MAX_RUNS { Some(0) } else { book.room() };
        if let Some(room) = room {
            while fresh.len() > room {
                let (i, _, lease, token, choice, _) = fresh.pop().unwrap();
                decode_idx.push(i);
                decode_work.push((token, lease, Some(choice)));
            }
        }
        if !fresh.is_empty() {
            let len = fresh.iter().map(|f| f.5).min().unwrap();
            let group: Vec<_> = fresh.iter().map(|f| (f.1.clone(), f.2.clone(), f.3, f.4.clone())).collect();
            book.start(&self.session(), group, len, self.stop_ids.clone(), self.ahead_batch).await.map_err(|e| self.failed(e))?;
            self.counters.ahead_runs.fetch_add(1, Ordering::Relaxed);
        }
        if !decode_work.is_empty() {
            let rows = self.decode_step(&decode_work).await?;
            for (row, i) in rows.into_iter().zip(&decode_idx) {
                results[*i] = Some(row);
            }
        }
        let waits = served
            .into_iter()
            .map(|(i, key)| (i, key, None))
            .chain(fresh.into_iter().map(|(i, key, lease, token, choice, _)| (i, key, Some((token, lease, choice)))));
        let mut took: Vec<String> = Vec::new();
        let mut refusals = 0;
        let mut retry_idx = Vec::new();
        let mut retry_work = Vec::new();
        let mut failure = None;
        for (i, key, start) in waits {
            if let Some(t) = book.take(&key).await {
                results[i] = Some(vec![t as f32]);
                took.push(key);
                continue;
            }
            let err = book.error(&key);
            let refused = err
                .as_ref()
                .is_some_and(|e| matches!(e.reason.as_deref(), Some("TENANT_QUOTA_EXCEEDED" | "SEQUENCE_LIMIT_EXCEEDED")));
            match start {
                // A run that never started (refused), or ended without this step's
                // token: the step goes plain.
                Some((token, lease, choice)) if refused || err.is_none() => {
                    refusals += usize::from(refused);
                    if let Err(e) = self.settle(book, &key).await {
                        for key in &took {
                            book.untake(key);
                        }
                        return Err(e);
                    }
                    retry_idx.push(i);
                    retry_work.push((token, lease, Some(choice)));
                }
                _ => {
                    failure = Some((key, err));
                    break;
                }
            }
        }
        if refusals > 0 {
            book.refused(refusals);
        }
        let retried = match (&failure, retry_work.is_empty()) {
            (None, false) => self.decode_step(&retry_work).await.map(Some),
            _ => Ok(None),
        };
        if failure.is_some() || retried.is_err() {
            for key in &took {
                book.untake(key);
            }
        }
        if let Some((key, err)) = failure {
            let settled = self.settle(book, &key).await;
            return Err(match err {
                Some(e) => self.failed(e),
                None => settled.err().unwrap_or_else(|| FerrumError::backend("a decode-ahead run ended early")),
            });
        }
        if let Some(rows) = retried? {
            for (row, i) in rows.into_iter().zip(&retry_idx) {
                results[*i] = Some(row);
            }
        }
        let n = took.len() as u64;
        self.counters.ahead_served.fetch_add(n, Ordering::Relaxed);
        self.counters.chosen.fetch_add(n, Ordering::Relaxed);
        self.counters.decodes.fetch_add(n, Ordering::Relaxed);
        self.counters.decode_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// One decode step per input, full logits rows (the trait's batch_decode).
    async fn decode_many(&self, inputs: &[(u32, Arc<Lease>)]) -> Result<Vec<LogitsTensor>> {
        let work: Vec<_> = inputs.iter().map(|(t, l)| (*t, l.clone(), None)).collect();
        Ok(self
            .decode_step(&work)
            .await?
            .into_iter()
            .map(|row| {
                let n = row.len();
                LogitsTensor::new(row, vec![1, n])
            })
            .collect())
    }
}

fn input_ids(t: &TensorRef) -> Result<Vec<u32>> {
    t.to_vec_u32()
}

#[async_trait]
impl ModelExecutor for RemoteExecutor {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn kv_capacity(&self) -> Option<usize> {
        Some(self.caps.max_sequence_length as usize)
    }

    /// The contract has no reservation call: the server takes blocks as a call needs
    /// them and refuses with KV_CAPACITY_EXHAUSTED (resource_exhausted here) when it
    /// cannot, before anything runs. So nothing is reserved ahead (None: "no
    /// model-owned paged KV"), and the engine meets capacity at the call.
    fn reserve_kv_slots(&self, _requests: &[KvSlotRequest]) -> Result<Option<KvSlotReservation>> {
        Ok(None)
    }

    fn kv_slot_capacity_snapshot(&self) -> Option<KvSlotCapacitySnapshot> {
        let s = self.status.lock().unwrap().clone()?;
        Some(KvSlotCapacitySnapshot {
            block_size: self.caps.kv_block_size as usize,
            total_blocks: s.kv_blocks_total as usize,
            free_blocks: s.kv_blocks_free as usize,
        })
    }

    /// A prompt (or a chunk of one): a new remote sequence, or a continuation when the
    /// input's handle names one. The output's logits are the LAST position only, shaped
    /// [1, 1, vocab]: that is what the engine samples from.
    async fn prefill(&self, input: &PrefillInput) -> Result<PrefillOutput> {
        self.count(0);
        let t0 = std::time::Instant::now();
        let ids = input_ids(&input.input_ids)?;
        let (lease, key) = match &input.kv_cache {
            Some(h) => (self.lease_of(h), Some(Self::key_of(h))),
            None => (None, None),
        };
        if let Some(l) = &lease {
            self.settle_lease(l).await?;
        }
        let reply = self
            .client
            .prefill(&ids, lease.as_ref().map(|l| l.handle()).as_ref(), Some(policy::full()), None)
            .await
            .map_err(|e| self.failed(e))?;
        let handle = reply.kv_cache.clone().ok_or_else(|| FerrumError::backend("Prefill reply without a handle"))?;
        let lease = self.adopt(lease, key.as_deref(), handle);
        let logits = last_row(reply.logits.as_ref(), &[1, 1])?;
        self.counters.prefills.fetch_add(1, Ordering::Relaxed);
        self.counters.prefill_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(PrefillOutput::new(Arc::new(logits), self.out_handle(&lease, key)))
    }

    /// Several prompts in ONE BatchPrefill (all or nothing).
    async fn batch_prefill(&self, inputs: &[PrefillInput]) -> Result<Vec<PrefillOutput>> {
        self.count(1);
        let t0 = std::time::Instant::now();
        let mut items = Vec::with_capacity(inputs.len());
        let mut known = Vec::with_capacity(inputs.len());
        for input in inputs {
            let (lease, key) = match &input.kv_cache {
                Some(h) => (self.lease_of(h), Some(Self::key_of(h))),
                None => (None, None),
            };
            if let Some(l) = &lease {
                self.settle_lease(l).await?;
            }
            items.push(pb::PrefillItem {
                token_ids: input_ids(&input.input_ids)?,
                kv_cache: lease.as_ref().map(|l| l.handle()),
                ..Default::default()
            });
            known.push((lease, key));
        }
        let replies = self.client.batch_prefill(items, Some(policy::full())).await.map_err(|e| self.failed(e))?;
        let mut out = Vec::with_capacity(inputs.len());
        for (r, (lease, key)) in replies.into_iter().zip(known) {
            let handle = r.kv_cache.clone().ok_or_else(|| FerrumError::backend("BatchPrefill reply without a handle"))?;
            let lease = self.adopt(lease, key.as_deref(), handle);
            let logits = last_row(r.logits.as_ref(), &[1, 1])?;
            out.push(PrefillOutput::new(Arc::new(logits), self.out_handle(&lease, key)));
        }
        self.counters.prefills.fetch_add(inputs.len() as u64, Ordering::Relaxed);
        self.counters.prefill_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(out)
    }

    /// One token appended; logits [1, vocab].
    async fn decode(&self, input: &DecodeInput) -> Result<DecodeOutput> {
        let mut out = self.batch_decode(std::slice::from_ref(input)).await?;
        Ok(out.remove(0))
    }

    /// One BatchDecode for every input (all or nothing, in order).
    async fn batch_decode(&self, inputs: &[DecodeInput]) -> Result<Vec<DecodeOutput>> {
        self.count(2);
        let mut work = Vec::with_capacity(inputs.len());
        for input in inputs {
            let ids = input_ids(&input.input_ids)?;
            let token = *ids.last().ok_or_else(|| FerrumError::invalid_request("decode without a token"))?;
            let lease = self
                .lease_of(&input.kv_cache)
                .ok_or_else(|| FerrumError::not_found(format!("no remote sequence for {}", input.kv_cache.cache_id())))?;
            self.settle_lease(&lease).await?;
            work.push((token, lease));
        }
        let logits = self.decode_many(&work).await?;
        Ok(logits
            .into_iter()
            .zip(inputs.iter().zip(&work))
            .map(|(l, (input, (_, lease)))| {
                DecodeOutput::new(Arc::new(l), self.out_handle(lease, Some(Self::key_of(&input.kv_cache))))
            })
            .collect())
    }

    /// The engine's mixed batch: prompt chunks in ONE BatchPrefill, then the decode
    /// steps. A greedy step the server chooses (see `greedy_choice`) decodes ahead (see
    /// crate::ahead): it starts a run, or takes the token its sequence's run already
    /// chose; the other steps go in ONE plain step. The prefills run first; when the
    /// decodes then fail, the sequences this call created are released, so a failed
    /// call leaves the server as it was (the engine falls back to its split path and
    /// prefills again).
    async fn unified_decode(&self, batch: &UnifiedBatch) -> Result<Vec<Option<Vec<f32>>>> {
        self.count(3);
        let mut book = self.book.lock().await;
        let mut results: Vec<Option<Vec<f32>>> = vec![None; batch.items.len()];
        let mut prefill_idx = Vec::new();
        let mut prefill_items = Vec::new();
        let mut prefill_leases = Vec::new();
        let mut decode_idx = Vec::new();
        let mut decode_work = Vec::new();
        // Steps a running run answers (item index, sequence), and steps that start one
        // (item index, sequence, lease, token, choice, tokens the run may decode).
        let mut served: Vec<(usize, String)> = Vec::new();
        let mut fresh: Vec<(usize, String, Arc<Lease>, u32, pb::TokenChoice, u32)> = Vec::new();
        let (mut prefill_rows, mut prefill_chosen) = (false, true);
        for (i, item) in batch.items.iter().enumerate() {
            let lease = self.lease_of(&item.kv_cache).or_else(|| self.lease_for_key(&item.seq_id));
            let choice = if item.is_final_chunk { self.greedy_choice(&item.logits_policy) } else { None };
            if let Some(l) = &lease {
                let key = l.cache_id();
                if book.holds(&key) {
                    let step = item.q_tokens.len() == 1 && item.is_final_chunk;
                    if step && choice.as_ref().is_some_and(|c| book.serves(&key, item.q_tokens[0], item.pos_offset, c)) {
                        served.push((i, key));
                        continue;
                    }
                    // Not the step its run predicted: the server's sequence is brought
                    // back to the engine's first.
                    self.settle(&mut book, &key).await?;
                }
                self.resync(l).await.map_err(|e| self.failed(e))?;
            }
            let lease = match lease {
                Some(l) if item.pos_offset > 0 => {
                    if l.len() != item.pos_offset {
                        return Err(FerrumError::backend(format!(
                            "sequence {} holds {} tokens on the server, the engine continues at {}",
                            item.seq_id,
                            l.len(),
                            item.pos_offset
                        )));
                    }
                    Some(l)
                }
                Some(_) | None if item.pos_offset == 0 => None,
                _ => return Err(FerrumError::not_found(format!("no remote sequence for {}", item.seq_id))),
            };
            let is_decode = item.q_tokens.len() == 1 && item.is_final_chunk && lease.is_some();
            if is_decode {
                let lease = lease.unwrap();
                let run_len = self.ahead_len(item);
                match choice {
                    Some(c) if run_len > 1 => fresh.push((i, lease.cache_id(), lease, item.q_tokens[0], c, run_len)),
                    choice => {
                        decode_idx.push(i);
                        decode_work.push((item.q_tokens[0], lease, choice));
                    }
                }
            } else {
                prefill_idx.push(i);
                prefill_rows |= item.is_final_chunk && choice.is_none();
                prefill_chosen &= choice.is_some();
                prefill_items.push(pb::PrefillItem {
                    token_ids: item.q_tokens.clone(),
                    kv_cache: lease.as_ref().map(|l| l.handle()),
                    token_choice: choice,
                    ..Default::default()
                });
                prefill_leases.push(lease);
            }
        }
        let mut created: Vec<String> = Vec::new();
        if !prefill_items.is_empty() {
            let t0 = std::time::Instant::now();
            let n = prefill_items.len();
            let greedy: Vec<bool> = prefill_items.iter().map(|p| p.token_choice.is_some()).collect();
            let logits = policy_for(prefill_rows, prefill_chosen);
            let replies = self.client.batch_prefill(prefill_items, logits).await.map_err(|e| self.failed(e))?;
            for (((r, i), lease), greedy) in replies.into_iter().zip(&prefill_idx).zip(prefill_leases).zip(greedy) {
                let item = &batch.items[*i];
                let handle = r.kv_cache.clone().ok_or_else(|| FerrumError::backend("BatchPrefill reply without a handle"))?;
                match lease {
                    Some(l) => l.set(handle),
                    None => {
                        self.held(&item.seq_id, self.lease(handle));
                        created.push(item.seq_id.clone());
                    }
                }
                if item.is_final_chunk {
                    results[*i] = Some(item_result(r.logits.as_ref(), r.chosen.as_ref(), greedy)?);
                    self.counters.chosen.fetch_add(greedy as u64, Ordering::Relaxed);
                }
            }
            self.counters.prefills.fetch_add(n as u64, Ordering::Relaxed);
            self.counters.prefill_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        let decoded = self
            .decode_ahead(&mut book, &mut results, served, fresh, decode_idx, decode_work)
            .await;
        if let Err(e) = decoded {
            for key in created {
                self.release_cache(&key);
            }
            return Err(e);
        }
        Ok(results)
    }

    /// Roll the sequence back to `new_len` tokens (TruncateKv).
    async fn truncate_kv(&self, kv_cache: &Arc<dyn KvCacheHandle>, new_len: usize) -> Result<()> {
        self.count(5);
        let lease = self
            .lease_of(kv_cache)
            .ok_or_else(|| FerrumError::not_found(format!("no remote sequence for {}", kv_cache.cache_id())))?;
        self.settle_lease(&lease).await?;
        let h = self.client.truncate_kv(&lease.handle(), new_len as u32).await.map_err(|e| self.failed(e))?;
        lease.set(h);
        Ok(())
    }

    /// The inputs' tokens (one sequence, in order) in ONE ForwardVerify; one output per
    /// input with its position's logits [1, vocab], each carrying the final handle.
    async fn forward_verify(&self, inputs: &[DecodeInput]) -> Result<Vec<DecodeOutput>> {
        self.count(4);
        let first = inputs.first().ok_or_else(|| FerrumError::invalid_request("forward_verify without inputs"))?;
        let lease = self
            .lease_of(&first.kv_cache)
            .ok_or_else(|| FerrumError::not_found(format!("no remote sequence for {}", first.kv_cache.cache_id())))?;
        self.settle_lease(&lease).await?;
        let mut tokens = Vec::with_capacity(inputs.len());
        for input in inputs {
            tokens.push(*input_ids(&input.input_ids)?.last().ok_or_else(|| FerrumError::invalid_request("empty input"))?);
        }
        let reply = self.client.forward_verify(&tokens, &lease.handle(), Some(policy::full())).await.map_err(|e| self.failed(e))?;
        if let Some(h) = reply.kv_cache.clone() {
            lease.set(h);
        }
        let (all, rows, vocab) = logits_rows(reply.logits.as_ref())?;
        if rows != inputs.len() {
            return Err(FerrumError::backend(format!("ForwardVerify answered {rows} rows for {} tokens", inputs.len())));
        }
        let key = Self::key_of(&first.kv_cache);
        Ok((0..rows)
            .map(|r| {
                let row = LogitsTensor::new(all[r * vocab..(r + 1) * vocab].to_vec(), vec![1, vocab]);
                DecodeOutput::new(Arc::new(row), self.out_handle(&lease, Some(key.clone())))
            })
            .collect())
    }

    fn capabilities(&self) -> ExecutorCapabilities {
        let c = &self.caps;
        let attention = c
            .attention_mechanisms
            .iter()
            .filter_map(|m| match m.to_ascii_lowercase().as_str() {
                "multi_head" | "multihead" => Some(AttentionType::MultiHead),
                "multi_query" | "multiquery" => Some(AttentionType::MultiQuery),
                "grouped_query" | "groupedquery" => Some(AttentionType::GroupedQuery),
                "flash" => Some(AttentionType::Flash),
                "paged" => Some(AttentionType::Paged),
                "sliding_window" | "slidingwindow" => Some(AttentionType::SlidingWindow),
                _ => None,
            })
            .collect();
        let m = c.memory.clone().unwrap_or_default();
        ExecutorCapabilities {
            max_batch_size: c.max_batch_size as usize,
            max_sequence_length: c.max_sequence_length as usize,
            attention_mechanisms: attention,
            supports_dynamic_batching: c.dynamic_batching,
            supports_continuous_batching: c.continuous_batching,
            supports_speculative_decoding: c.forward_verify && c.truncate_kv,
            supports_tensor_parallelism: c.tensor_parallel,
            supports_pipeline_parallelism: c.pipeline_parallel,
            supported_dtypes: c.supported_dtypes.iter().map(|d| data_type(*d)).collect(),
            supported_devices: vec![Device::CPU],
            memory_requirements: MemoryRequirements {
                parameter_memory: m.parameter_bytes,
                activation_memory_per_token: m.activation_bytes_per_token as usize,
                kv_cache_memory_per_token: m.kv_bytes_per_token_per_layer as usize,
                overhead_memory: m.overhead_bytes,
            },
        }
    }

    /// The server's state and memory from the latest GetStatus snapshot; operation
    /// counts and times are this executor's own calls.
    fn status(&self) -> ExecutorStatus {
        let s = self.status.lock().unwrap().clone().unwrap_or_default();
        let state = match pb::status::ExecutorState::try_from(s.executor_state).unwrap_or_default() {
            pb::status::ExecutorState::Initializing => ExecutorState::Initializing,
            pb::status::ExecutorState::Busy => ExecutorState::Busy,
            pb::status::ExecutorState::Error => ExecutorState::Error,
            pb::status::ExecutorState::Shutdown => ExecutorState::Shutdown,
            _ => match pb::status::State::try_from(s.state).unwrap_or_default() {
                pb::status::State::Loading => ExecutorState::Initializing,
                pb::status::State::Draining => ExecutorState::Shutdown,
                _ => ExecutorState::Ready,
            },
        };
        let ms = |ns: &AtomicU64, n: &AtomicU64| {
            let n = n.load(Ordering::Relaxed);
            if n == 0 {
                0.0
            } else {
                ns.load(Ordering::Relaxed) as f64 / n as f64 / 1e6
            }
        };
        ExecutorStatus {
            state,
            is_ready: matches!(state, ExecutorState::Ready | ExecutorState::Busy),
            current_batch_size: s.active_sequences as usize,
            prefill_operations: self.counters.prefills.load(Ordering::Relaxed),
            decode_operations: self.counters.decodes.load(Ordering::Relaxed),
            avg_prefill_time_ms: ms(&self.counters.prefill_ns, &self.counters.prefills),
            avg_decode_time_ms: ms(&self.counters.decode_ns, &self.counters.decodes),
            memory_usage: ExecutorMemoryUsage {
                allocated_bytes: s.memory_allocated_bytes as usize,
                used_bytes: s.memory_used_bytes as usize,
                peak_bytes: s.memory_peak_bytes as usize,
                utilization_percent: (s.memory_utilization * 100.0) as f32,
            },
            last_operation: None,
        }
    }

    /// Releases the sequence held under `cache_id` (an engine-minted id) now.
    fn release_cache(&self, cache_id: &str) {
        if let Some(lease) = self.by_key.lock().unwrap().remove(cache_id) {
            lease.release();
        }
        let weak = self.by_id.lock().unwrap().remove(cache_id);
        if let Some(lease) = weak.and_then(|w| w.upgrade()) {
            lease.release();
        }
    }
}
