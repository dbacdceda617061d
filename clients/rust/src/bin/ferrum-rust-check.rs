//! ferrum-rust-check: the Rust client's side of tests/contract/test_rust_client.py. Each
//! subcommand runs against a live server and prints `name value...` lines the test
//! compares with the Python client's results on the same server.
//!
//!   greedy  ADDR N IDS          greedy ids (ARGMAX logits, prefill then decode)
//!   seeded  ADDR N IDS          server-chosen ids (temperature 0.8, top_k 40, top_p 0.9,
//!                               seed 7): prefill with the choice, then decode ahead
//!   logits  ADDR IDS OUTDIR     prefill.f32 (every position) and decode.f32 (the argmax
//!                               token's step), float32 bytes as received
//!   errors  ADDR ROWS           each row: `row CODE REASON retryable outcome_unknown`
//!   rpcs    ADDR                every RPC of the contract: `rpc NAME OK|REASON`
//!   engine-release ADDR IDS     RemoteExecutor: prefill, decode, drop; then active sequences
//!   engine-ahead ADDR N IDS     RemoteExecutor's decode-ahead through unified_decode
//!                               (runs of 4 tokens): N greedy steps, a step on another
//!                               token, a full-logits step; the counts, and the active
//!                               sequences after release
//!   engine-ahead-fail ADDR A B  RemoteExecutor's decode-ahead when a run of two
//!                               sequences fails part way, on a server whose KV pool
//!                               holds A, B and one more block and whose sequences end at
//!                               A's length + 3 (see engine_ahead_fail)
//!   engine-break ADDR A B       RemoteExecutor when its DecodeSession stream ends after a
//!                               run (A) or a plain step (B) the server then undoes, on a
//!                               server with 4-token blocks (see engine_break)

use ferrum_interfaces::kv_cache::{BlockTable, CacheHandleStats};
use ferrum_interfaces::model_executor::{DecodeInput, LogitsReturnPolicy, PrefillInput, UnifiedBatch, UnifiedBatchItem};
use ferrum_interfaces::{KvCacheHandle, ModelExecutor, TensorRef};
use std::sync::Arc;
use ferrum_rpc_client::client::policy;
use ferrum_rpc_client::error::code_name;
use ferrum_rpc_client::executor::token_tensor;
use ferrum_rpc_client::{pb, ClientOptions, ExecutorClient, ExecutorError, LogitsView, RemoteExecutor};
use std::time::Duration;

type R<T> = Result<T, ExecutorError>;

fn ids(s: &str) -> Vec<u32> {
    s.split(',').filter(|x| !x.is_empty()).map(|x| x.parse().unwrap()).collect()
}

fn join(v: &[u32]) -> String {
    v.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(" ")
}

fn seeded() -> pb::TokenChoice {
    pb::TokenChoice { temperature: Some(0.8), top_k: 40, top_p: Some(0.9), seed: Some(7), ..Default::default() }
}

async fn greedy(c: &ExecutorClient, n: usize, prompt: &[u32]) -> R<Vec<u32>> {
    let out = c.prefill(prompt, None, Some(policy::argmax()), None).await?;
    let mut got = vec![out.logits.as_ref().unwrap().token_ids[0]];
    let mut h = out.kv_cache.unwrap();
    while got.len() < n {
        let step = c.decode(*got.last().unwrap(), &h, Some(policy::argmax()), None).await?;
        got.push(step.logits.as_ref().unwrap().token_ids[0]);
        h = step.kv_cache.unwrap();
    }
    c.release_cache(&h.cache_id).await?;
    Ok(got)
}

async fn seeded_ids(c: &ExecutorClient, n: usize, prompt: &[u32]) -> R<Vec<u32>> {
    let out = c.prefill(prompt, None, None, Some(seeded())).await?;
    let mut got = vec![out.chosen.as_ref().unwrap().token_id];
    let h = out.kv_cache.unwrap();
    let mut session = c.decode_session().await?;
    let item = pb::DecodeItem { token_id: got[0], kv_cache: Some(h), token_choice: Some(seeded()) };
    let mut run = session.decode_ahead(vec![item], (n - 1) as u32, vec![]).await?;
    let mut last = None;
    while let Some(t) = run.next().await? {
        got.push(t.chosen.token_id);
        if let Some((h, _)) = t.end {
            last = Some(h);
        }
    }
    if let Some(h) = last {
        c.release_cache(&h.cache_id).await?;
    }
    Ok(got)
}

async fn logits(c: &ExecutorClient, prompt: &[u32], dir: &str) -> R<()> {
    let mut all = policy::full();
    all.all_positions = true;
    let pre = c.prefill(prompt, None, Some(all), None).await?;
    let view = LogitsView::of(pre.logits.as_ref().unwrap()).unwrap();
    println!("prefill_shape {} {}", view.rows(), view.vocab());
    println!("view_in_place {}", u8::from(view.row_f32_slice(0).is_some()));
    std::fs::write(format!("{dir}/prefill.f32"), view.bytes()).unwrap();
    let next = view.argmax(view.rows() - 1);
    let dec = c.decode(next, pre.kv_cache.as_ref().unwrap(), Some(policy::full()), None).await?;
    let dv = LogitsView::of(dec.logits.as_ref().unwrap()).unwrap();
    std::fs::write(format!("{dir}/decode.f32"), dv.bytes()).unwrap();
    c.release_cache(&dec.kv_cache.unwrap().cache_id).await?;
    Ok(())
}

fn show<T>(name: &str, r: R<T>) {
    match r {
        Ok(_) => println!("{name} OK"),
        Err(e) => {
            eprintln!("{name}: {e}");
            println!(
            "{name} {} {} {} {}",
            code_name(e.code),
            e.reason.clone().unwrap_or_else(|| "-".into()),
            e.retryable(),
            e.outcome_unknown()
        )
        }
    }
}

async fn errors(addr: &str, c: &ExecutorClient, rows: &[&str]) -> R<()> {
    let info = c.info().await?;
    let vocab = info.vocab_size;
    // The sequence the rows aim at; a server that refuses new sequences (draining)
    // leaves an empty one, for rows that need none.
    let subject = match c.prefill(&[1, 17, 42, 99, 7, 256], None, Some(policy::argmax()), None).await {
        Ok(p) => p.kv_cache.unwrap(),
        Err(_) => pb::KvCacheHandle::default(),
    };
    let changed = |f: &dyn Fn(&mut pb::KvCacheHandle)| {
        let mut h = subject.clone();
        f(&mut h);
        h
    };
    let greedy_choice = pb::TokenChoice { temperature: Some(0.0), ..Default::default() };
    for row in rows {
        let name = *row;
        match name {
            "cache_not_found" => {
                show(name, c.decode(5, &changed(&|h| h.cache_id = "no-such-sequence".into()), None, None).await)
            }
            "stale_handle" => show(
                name,
                c.decode(5, &changed(&|h| h.server_instance_id = "another-server".into()), None, None).await,
            ),
            "length_mismatch" => {
                show(name, c.decode(5, &changed(&|h| h.sequence_length += 1), None, None).await)
            }
            "empty_prefill" => show(name, c.prefill(&[], None, None, None).await),
            "empty_verify" => show(name, c.forward_verify(&[], &subject, None).await),
            "token_outside_vocab" => show(name, c.decode(vocab, &subject, None, None).await),
            "bad_top_k" => show(name, c.decode(5, &subject, Some(policy::top_k(0)), None).await),
            "bad_temperature" => {
                let choice = pb::TokenChoice { temperature: Some(f32::NAN), ..Default::default() };
                show(name, c.decode(5, &subject, None, Some(choice)).await)
            }
            "truncate_past_end" => show(name, c.truncate_kv(&subject, subject.sequence_length + 1).await),
            "release_unknown" => show(name, c.release_cache("no-such-sequence").await),
            "fork_unknown" => show(name, c.fork_cache(&changed(&|h| h.cache_id = "no-such-sequence".into()), 2).await),
            "unknown_model" => show(name, c.with_model("no-such-model").info().await),
            "forward_unimplemented" => show(name, c.forward(pb::ForwardRequest::default()).await),
            "ahead_too_many" | "ahead_bad_stop" => {
                let (n, stops) = if name == "ahead_too_many" { (5000, vec![]) } else { (4, vec![vocab]) };
                let r: R<()> = async {
                    let mut s = c.decode_session().await?;
                    let item = pb::DecodeItem { token_id: 5, kv_cache: Some(subject.clone()), token_choice: Some(greedy_choice.clone()) };
                    let mut run = s.decode_ahead(vec![item], n, stops).await?;
                    while run.next().await?.is_some() {}
                    Ok(())
                }
                .await;
                show(name, r)
            }
            "deadline" => {
                let d = ExecutorClient::connect(addr, ClientOptions { timeout: Some(Duration::from_nanos(1)), ..Default::default() }).await?;
                show(name, d.prefill(&[1, 2, 3], None, None, None).await)
            }
            "too_long" => {
                let n = info.max_sequence_length as usize + 1;
                let prompt: Vec<u32> = (0..n).map(|i| ((37 * i + 11) % vocab as usize) as u32).collect();
                show(name, c.prefill(&prompt, None, None, None).await)
            }
            "kv_exhausted" => {
                let prompt = |n: usize, seed: usize| -> Vec<u32> {
                    (0..n).map(|i| ((37 * i + 11 + 101 * seed) % vocab as usize) as u32).collect()
                };
                let mut fillers = Vec::new();
                for seed in [1, 2] {
                    fillers.push(c.prefill(&prompt(28, seed), None, Some(policy::argmax()), None).await?.kv_cache.unwrap());
                }
                show(name, c.prefill(&prompt(12, 0), None, None, None).await);
                for f in fillers {
                    c.release_cache(&f.cache_id).await?;
                }
            }
            "prefill" => {
                let r = c.prefill(&[1, 2, 3], None, None, None).await;
                if let Ok(p) = &r {
                    c.release_cache(&p.kv_cache.as_ref().unwrap().cache_id).await?;
                }
                show(name, r)
            }
            _ => println!("{name} UNKNOWN_ROW"),
        }
    }
    // The subject is unchanged by every failure above: a decode at its length works.
    if !subject.cache_id.is_empty() {
        show("subject_after", c.decode(5, &subject, Some(policy::argmax()), None).await);
        let _ = c.release_cache(&subject.cache_id).await;
    }
    Ok(())
}

async fn rpcs(c: &ExecutorClient) -> R<()> {
    let p = c.prefill(&[1, 2, 3, 4], None, Some(policy::argmax()), None).await?;
    let h = p.kv_cache.clone().unwrap();
    show("GetModelInfo", c.info().await);
    show("GetCapabilities", c.capabilities().await);
    show("GetStatus", c.status().await);
    show("Prefill", Ok::<_, ExecutorError>(()));
    let d = c.decode(5, &h, Some(policy::argmax()), None).await;
    let h = d.as_ref().map(|d| d.kv_cache.clone().unwrap()).unwrap_or(h);
    show("Decode", d);
    let item = pb::DecodeItem { token_id: 6, kv_cache: Some(h.clone()), token_choice: None };
    let b = c.batch_decode(vec![item], Some(policy::argmax()), false).await;
    let h = b.as_ref().map(|v| v[0].kv_cache.clone().unwrap()).unwrap_or(h);
    show("BatchDecode", b);
    let v = c.forward_verify(&[7, 8], &h, Some(policy::argmax())).await;
    let h = v.as_ref().map(|v| v.kv_cache.clone().unwrap()).unwrap_or(h);
    show("ForwardVerify", v);
    let t = c.truncate_kv(&h, h.sequence_length - 1).await;
    let h = t.clone().unwrap_or(h);
    show("TruncateKv", t);
    let s: R<()> = async {
        let mut s = c.decode_session().await?;
        let r = s.step(vec![pb::DecodeItem { token_id: 9, kv_cache: Some(h.clone()), token_choice: None }], Some(policy::argmax())).await?;
        Ok::<_, ExecutorError>(r)
    }
    .await
    .map(|_| ());
    show("DecodeSession", s);
    // The session step made `h` one longer; the calls below use a fresh sequence.
    let f = c.prefill(&[1, 2, 3], None, Some(policy::argmax()), None).await?;
    let fh = f.kv_cache.unwrap();
    let kids = c.fork_cache(&fh, 2).await;
    if let Ok(k) = &kids {
        for child in k {
            let _ = c.release_cache(&child.cache_id).await;
        }
    }
    show("ForkCache", kids);
    show("Forward", c.forward(pb::ForwardRequest::default()).await);
    let spec = c
        .speculative_decode(pb::SpeculativeDecodeRequest {
            token_id: 5,
            draft_token_ids: vec![6, 7],
            kv_cache: Some(fh.clone()),
            ..Default::default()
        })
        .await;
    // SpeculativeDecode appended to the sequence: its reply's handle goes on.
    let fh = spec.as_ref().ok().and_then(|r| r.kv_cache.clone()).unwrap_or(fh);
    show("SpeculativeDecode", spec);
    let bp = c.batch_prefill(vec![pb::PrefillItem { token_ids: vec![1, 2], ..Default::default() }], Some(policy::argmax())).await;
    if let Ok(v) = &bp {
        for r in v {
            let _ = c.release_cache(&r.kv_cache.as_ref().unwrap().cache_id).await;
        }
    }
    show("BatchPrefill", bp);
    show("ListModels", c.list_models().await);
    show("LoadModel", c.load_model(pb::LoadModelRequest::default()).await);
    show("UnloadModel", c.unload_model(pb::UnloadModelRequest { name: "no-such-model".into(), ..Default::default() }).await);
    show("LoadAdapter", c.load_adapter(pb::LoadAdapterRequest::default()).await);
    show("UnloadAdapter", c.unload_adapter(pb::UnloadAdapterRequest { name: "no-such-adapter".into(), ..Default::default() }).await);
    show("ListAdapters", c.list_adapters(pb::ListAdaptersRequest::default()).await);
    show("UpdateWeights", c.update_weights(vec![]).await);
    show(
        "RegisterSharedMemory",
        c.register_shared_memory(pb::RegisterSharedMemoryRequest { name: "no-such-region".into(), ..Default::default() })
            .await
            .map(|_| ()),
    );
    show("UnregisterSharedMemory", c.unregister_shared_memory(pb::UnregisterSharedMemoryRequest::default()).await);
    let exported = c.export_sequence(pb::ExportSequenceRequest { kv_cache: Some(fh.clone()), ..Default::default() }).await;
    let chunks = exported.clone().unwrap_or_default();
    show("ExportSequence", exported);
    let imported = c.import_sequence(chunks).await;
    if let Ok(r) = &imported {
        if let Some(k) = &r.kv_cache {
            let _ = c.release_cache(&k.cache_id).await;
        }
    }
    show("ImportSequence", imported);
    show("CreateImportTicket", c.create_import_ticket(pb::CreateImportTicketRequest::default()).await);
    show(
        "PushSequence",
        c.push_sequence(pb::PushSequenceRequest { kv_cache: Some(fh.clone()), target: "127.0.0.1:1".into(), ..Default::default() })
            .await,
    );
    let w: R<()> = async {
        use futures::StreamExt;
        let mut s = c.with_timeout(Some(Duration::from_secs(5))).watch_kv_events(pb::WatchKvEventsRequest::default()).await?;
        match s.next().await {
            Some(Ok(_)) => Ok(()),
            Some(Err(e)) => Err(e.into()),
            None => Err(ExecutorError::local(tonic::Code::Internal, "no hello")),
        }
    }
    .await;
    show("WatchKvEvents", w);
    show("ReleaseCache", c.release_cache(&fh.cache_id).await);
    let _ = c.release_cache(&h.cache_id).await;
    Ok(())
}

/// RemoteExecutor alone: a prefill and decodes on a remote sequence, then the handles
/// dropped; prints the server's active sequences before and after.
async fn engine_release(c: &ExecutorClient, prompt: &[u32]) -> R<()> {
    let ex = RemoteExecutor::new(c.clone()).await?;
    let before = c.status().await?.active_sequences;
    {
        let out = ex.prefill(&PrefillInput::new(token_tensor(prompt))).await.map_err(|e| ExecutorError::local(tonic::Code::Internal, e.to_string()))?;
        let mut h = out.kv_cache.clone();
        let mut tok = out.logits.argmax_last_dim_u32().unwrap();
        let mut toks = vec![tok];
        for _ in 0..3 {
            let d = ex.decode(&DecodeInput::new(token_tensor(&[tok]), h.clone())).await.map_err(|e| ExecutorError::local(tonic::Code::Internal, e.to_string()))?;
            tok = d.logits.argmax_last_dim_u32().unwrap();
            toks.push(tok);
            h = d.kv_cache;
        }
        println!("executor_ids {}", join(&toks));
        // forward_verify of two tokens, then truncate_kv back: the next decode gives the
        // same logits as a decode straight after the loop would.
        let err = |e: ferrum_types::FerrumError| ExecutorError::local(tonic::Code::Internal, e.to_string());
        let verify = ex
            .forward_verify(&[DecodeInput::new(token_tensor(&[tok]), h.clone()), DecodeInput::new(token_tensor(&[7]), h.clone())])
            .await
            .map_err(err)?;
        let first_row = verify[0].logits.to_vec_f32().unwrap();
        println!("verify_rows {}", verify.len());
        let len = h.num_tokens();
        ex.truncate_kv(&h, len).await.map_err(err)?;
        let again = ex.decode(&DecodeInput::new(token_tensor(&[tok]), h.clone())).await.map_err(err)?;
        let same = again.logits.to_vec_f32().unwrap() == first_row;
        println!("verify_then_truncate_same {}", u8::from(same));
        drop(again);
        println!("during {}", c.status().await?.active_sequences);
    }
    // The release runs in the background once the last handle went: wait for it.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut after = c.status().await?.active_sequences;
    while after != before && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        after = c.status().await?.active_sequences;
    }
    println!("before {before}");
    println!("after {after}");
    Ok(())
}

/// The engine's own handle of a sequence, as its KV manager mints one: only its id
/// reaches the executor (a unified batch names sequences by it).
#[derive(Debug, Clone)]
struct EngineHandle(String, BlockTable);

impl KvCacheHandle for EngineHandle {
    fn block_table(&self) -> &BlockTable {
        &self.1
    }
    fn block_table_mut(&mut self) -> &mut BlockTable {
        &mut self.1
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn device(&self) -> ferrum_types::Device {
        ferrum_types::Device::CPU
    }
    fn num_layers(&self) -> usize {
        0
    }
    fn num_heads(&self) -> usize {
        0
    }
    fn head_dim(&self) -> usize {
        0
    }
    fn key_cache(&self, _layer: usize) -> ferrum_types::Result<Option<TensorRef>> {
        Ok(None)
    }
    fn value_cache(&self, _layer: usize) -> ferrum_types::Result<Option<TensorRef>> {
        Ok(None)
    }
    fn clone_handle(&self) -> ferrum_types::Result<Arc<dyn KvCacheHandle>> {
        Ok(Arc::new(self.clone()))
    }
    fn stats(&self) -> CacheHandleStats {
        CacheHandleStats {
            memory_bytes: 0,
            blocks_allocated: 0,
            tokens_stored: 0,
            utilization: 0.0,
            last_access: std::time::Instant::now(),
        }
    }
    fn is_valid(&self) -> bool {
        true
    }
    fn cache_id(&self) -> String {
        self.0.clone()
    }
}

/// RemoteExecutor's decode-ahead as Ferrum's engine drives it (unified batches naming
/// the sequence by the engine's id), with runs of 4 tokens so they chain: a prompt,
/// `n` greedy steps (`ahead_ids`), then a step on token 7 instead of the run's
/// prediction (`diverted`: the run's lead is cut off first), then a full-logits step
/// on that step's token (`full_argmax`: the diverted step's run is cut off first).
async fn engine_ahead(c: &ExecutorClient, n: usize, prompt: &[u32]) -> R<()> {
    let err = |e: ferrum_types::FerrumError| ExecutorError::local(tonic::Code::Internal, e.to_string());
    let ex = RemoteExecutor::new(c.with_timeout(None)).await?.with_decode_ahead(4);
    let before = c.status().await?.active_sequences;
    let handle: Arc<dyn KvCacheHandle> = Arc::new(EngineHandle("engine-seq".into(), BlockTable::new(16)));
    let greedy = LogitsReturnPolicy::GreedyArgmax { token_mask: None, repetition_penalty: None };
    let item = |tokens: Vec<u32>, pos: usize, policy: LogitsReturnPolicy| UnifiedBatchItem {
        seq_id: "engine-seq".into(),
        q_tokens: tokens,
        kv_cache: handle.clone(),
        recurrent_state: None,
        pos_offset: pos,
        is_final_chunk: true,
        metadata: Default::default(),
        logits_policy: policy,
    };
    let step = |it: UnifiedBatchItem| {
        let ex = &ex;
        async move {
            let rows = ex.unified_decode(&UnifiedBatch { items: vec![it] }).await.map_err(err)?;
            let row = rows.into_iter().next().flatten().unwrap_or_default();
            // A greedy item's row is its chosen id; a full row's argmax is the engine's.
            Ok::<u32, ExecutorError>(if row.len() == 1 {
                row[0] as u32
            } else {
                row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32
            })
        }
    };
    let mut toks = vec![step(item(prompt.to_vec(), 0, greedy.clone())).await?];
    for k in 0..n {
        toks.push(step(item(vec![toks[k]], prompt.len() + k, greedy.clone())).await?);
    }
    println!("ahead_ids {}", join(&toks));
    // The engine now holds prompt + n tokens; it steps token 7 where the run predicted
    // toks[n].
    let pos = prompt.len() + n;
    let diverted = step(item(vec![7], pos, greedy.clone())).await?;
    println!("diverted {diverted}");
    let full = step(item(vec![diverted], pos + 1, LogitsReturnPolicy::FullLogits)).await?;
    println!("full_argmax {full}");
    println!("counts {}", ex.call_counts());
    ex.release_cache("engine-seq");
    let clean = ex.wait_released(Duration::from_secs(10)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut after = c.status().await?.active_sequences;
    while after != before && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        after = c.status().await?.active_sequences;
    }
    println!("released {}", u8::from(clean));
    println!("before {before}");
    println!("after {after}");
    Ok(())
}

/// A decode-ahead run of two sequences that fails after one of them ended, as Ferrum's
/// engine meets it. The server (max_seq_len = len(A) + 3, a pool of A's blocks, B's and
/// one more, block size 4, B one full block) runs A and B ahead together: A ends with
/// MAX_SEQUENCE_LENGTH after 3 forwards, B goes on into its spare block and fails
/// KV_CAPACITY_EXHAUSTED when it needs another; the server undoes the run for both.
/// The engine takes 3 tokens of each, then (once the server shows the undo: the spare
/// block free again, `free_before`/`free_undone`) truncates A by one (`a_truncated`: A
/// settled, its taken tokens appended again, then cut) and steps it with full logits
/// (`a_next`, `a_len`); releases A; then steps B on (`b_ids`: B's run's tokens, then
/// those after its replay, in a new run) and prints the counts.
async fn engine_ahead_fail(c: &ExecutorClient, a: &[u32], b: &[u32]) -> R<()> {
    let err = |e: ferrum_types::FerrumError| ExecutorError::local(tonic::Code::Internal, e.to_string());
    // one response a forward (the default): the engine takes tokens of the run before it fails
    let ex = RemoteExecutor::new(c.with_timeout(None)).await?.with_decode_ahead(8);
    let handles: Vec<Arc<dyn KvCacheHandle>> = ["seq-a", "seq-b"]
        .iter()
        .map(|k| Arc::new(EngineHandle(k.to_string(), BlockTable::new(4))) as Arc<dyn KvCacheHandle>)
        .collect();
    let greedy = LogitsReturnPolicy::GreedyArgmax { token_mask: None, repetition_penalty: None };
    let item = |which: usize, tokens: Vec<u32>, pos: usize, policy: LogitsReturnPolicy| UnifiedBatchItem {
        seq_id: ["seq-a", "seq-b"][which].into(),
        q_tokens: tokens,
        kv_cache: handles[which].clone(),
        recurrent_state: None,
        pos_offset: pos,
        is_final_chunk: true,
        metadata: Default::default(),
        logits_policy: policy,
    };
    let step = |items: Vec<UnifiedBatchItem>| {
        let ex = &ex;
        async move {
            let rows = ex.unified_decode(&UnifiedBatch { items }).await.map_err(err)?;
            // A greedy item's row is its chosen id; a full row's argmax is the engine's.
            Ok::<Vec<u32>, ExecutorError>(
                rows.into_iter()
                    .map(|row| {
                        let row = row.unwrap_or_default();
                        if row.len() == 1 {
                            row[0] as u32
                        } else {
                            row.iter()
                                .enumerate()
                                .fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
                                .0 as u32
                        }
                    })
                    .collect(),
            )
        }
    };
    let free = || async { Ok::<u32, ExecutorError>(c.status().await?.kv_blocks_free) };
    let first = step(vec![item(0, a.to_vec(), 0, greedy.clone()), item(1, b.to_vec(), 0, greedy.clone())]).await?;
    let (mut at, mut bt) = (vec![first[0]], vec![first[1]]);
    let free_before = free().await?;
    // Three steps of both: the first starts the run, the next two take its tokens; the
    // third is A's last (its run ended it at the maximum length).
    for k in 0..3 {
        let got = step(vec![
            item(0, vec![at[k]], a.len() + k, greedy.clone()),
            item(1, vec![bt[k]], b.len() + k, greedy.clone()),
        ])
        .await?;
        at.push(got[0]);
        bt.push(got[1]);
    }
    // The server fails B's forward that needs a third block and undoes the run: B's
    // spare block comes free again. Waits for that, so A is settled only after it.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut free_undone = free().await?;
    while free_undone != free_before && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
        free_undone = free().await?;
    }
    println!("free_before {free_before}");
    println!("free_undone {free_undone}");
    println!("a_ids {}", join(&at));
    // The engine holds A's prompt and at[0..3]; it drops the last of them.
    let cut = a.len() + 2;
    ex.truncate_kv(&handles[0], cut).await.map_err(err)?;
    println!("a_truncated {cut}");
    let next = step(vec![item(0, vec![at[2]], cut, LogitsReturnPolicy::FullLogits)]).await?;
    println!("a_next {}", next[0]);
    println!("a_len {}", ex.sequence_len("seq-a").unwrap_or(0));
    ex.release_cache("seq-a");
    // A's blocks back in the pool, so B's next run has room.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while free().await? <= free_undone && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // B: its run's three tokens were taken; the engine steps it on (the replay first).
    for k in 3..7 {
        let got = step(vec![item(1, vec![bt[k]], b.len() + k, greedy.clone())]).await?;
        bt.push(got[0]);
    }
    println!("b_ids {}", join(&bt));
    println!("counts {}", ex.call_counts());
    ex.release_cache("seq-b");
    println!("released {}", u8::from(ex.wait_released(Duration::from_secs(10)).await));
    Ok(())
}

/// The executor's DecodeSession stream lost after the server changed a sequence and
/// before a later request on the stream named it, as Ferrum's engine meets it: the
/// server undoes such a change when the stream ends. The server's block size is 4 and
/// each prompt fills two blocks, so the undo shows as a block freed. `ahead`: a run of
/// 4 over prompt `a` (the engine takes all 4 tokens, so settling it calls nothing), the
/// stream ends (`reset_session`), the server frees the run's block (`a_freed`), and the
/// engine steps on: `a_ids` (the prompt's token, the run's 4, then 3 more). `plain`: no
/// decoding ahead; prompt `b`'s first step, the stream ends, the block is freed
/// (`b_freed`), and the engine steps on (`b_ids`: 5 tokens). Then the counts and the
/// releases (`before`/`after`: the server's active sequences).
async fn engine_break(c: &ExecutorClient, a: &[u32], b: &[u32]) -> R<()> {
    let err = |e: ferrum_types::FerrumError| ExecutorError::local(tonic::Code::Internal, e.to_string());
    let before = c.status().await?.active_sequences;
    let greedy = LogitsReturnPolicy::GreedyArgmax { token_mask: None, repetition_penalty: None };
    let free = || async { Ok::<u32, ExecutorError>(c.status().await?.kv_blocks_free) };
    // Waits (up to 20 s) until the server has more free blocks than `than`.
    let freed = |than: u32| async move {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let mut now = free().await?;
        while now <= than && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
            now = free().await?;
        }
        Ok::<bool, ExecutorError>(now > than)
    };
    // `c`: B's plain step again, stepping on at once: the server may abandon the session
    // after the executor redid the step, and its late undo must leave the redone step be.
    for (name, prompt, window, steps, wait) in [("a", a, 4u32, 8usize, true), ("b", b, 0, 5, true), ("c", b, 0, 5, false)] {
        let ex = RemoteExecutor::new(c.with_timeout(None)).await?.with_decode_ahead(window);
        let seq = format!("seq-{name}");
        let handle: Arc<dyn KvCacheHandle> = Arc::new(EngineHandle(seq.clone(), BlockTable::new(4)));
        let item = |tokens: Vec<u32>, pos: usize| UnifiedBatchItem {
            seq_id: seq.clone(),
            q_tokens: tokens,
            kv_cache: handle.clone(),
            recurrent_state: None,
            pos_offset: pos,
            is_final_chunk: true,
            metadata: Default::default(),
            logits_policy: greedy.clone(),
        };
        let step = |it: UnifiedBatchItem| {
            let ex = &ex;
            async move {
                let rows = ex.unified_decode(&UnifiedBatch { items: vec![it] }).await.map_err(err)?;
                Ok::<u32, ExecutorError>(rows.into_iter().next().flatten().unwrap_or_default()[0] as u32)
            }
        };
        let mut toks = vec![step(item(prompt.to_vec(), 0)).await?];
        // `ahead`: the run's 4 steps; `plain`: one step. Each leaves the sequence a block
        // longer than the prompt's two.
        let first = if window > 0 { window as usize } else { 1 };
        for k in 0..first {
            toks.push(step(item(vec![toks[k]], prompt.len() + k)).await?);
        }
        let held = free().await?;
        ex.reset_session();
        if wait {
            println!("{name}_freed {}", u8::from(freed(held).await?));
        }
        for k in first..steps - 1 {
            toks.push(step(item(vec![toks[k]], prompt.len() + k)).await?);
        }
        println!("{name}_ids {}", join(&toks));
        println!("{name}_counts {}", ex.call_counts());
        ex.release_cache(&seq);
        println!("{name}_released {}", u8::from(ex.wait_released(Duration::from_secs(10)).await));
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut after = c.status().await?.active_sequences;
    while after != before && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        after = c.status().await?.active_sequences;
    }
    println!("before {before}");
    println!("after {after}");
    Ok(())
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cmd = args.first().map(String::as_str).unwrap_or("");
    let addr = args.get(1).cloned().unwrap_or_default();
    // TLS and a bearer token from the environment: FERRUM_RPC_CA (the CA's PEM file),
    // FERRUM_RPC_SERVER_NAME (the name on the server's certificate), FERRUM_RPC_TOKEN.
    let token = std::env::var("FERRUM_RPC_TOKEN").ok().filter(|t| !t.is_empty());
    let tls = std::env::var("FERRUM_RPC_CA").ok().map(|ca| ferrum_rpc_client::ClientTls {
        ca_pem: std::fs::read(ca).expect("FERRUM_RPC_CA"),
        domain: std::env::var("FERRUM_RPC_SERVER_NAME").ok(),
        identity: None,
    });
    let opts = ClientOptions { token, tls, timeout: Some(Duration::from_secs(60)), ..Default::default() };
    let c = match ExecutorClient::connect(&addr, opts).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1)
        }
    };
    let r: R<()> = match cmd {
        "greedy" => greedy(&c, args[2].parse().unwrap(), &ids(&args[3])).await.map(|v| println!("greedy {}", join(&v))),
        "seeded" => seeded_ids(&c, args[2].parse().unwrap(), &ids(&args[3])).await.map(|v| println!("seeded {}", join(&v))),
        "logits" => logits(&c, &ids(&args[2]), &args[3]).await,
        "errors" => errors(&addr, &c, &args[2].split(',').collect::<Vec<_>>()).await,
        "rpcs" => rpcs(&c).await,
        "engine-release" => engine_release(&c, &ids(&args[2])).await,
        "engine-ahead" => engine_ahead(&c, args[2].parse().unwrap(), &ids(&args[3])).await,
        "engine-ahead-fail" => engine_ahead_fail(&c, &ids(&args[2]), &ids(&args[3])).await,
        "engine-break" => engine_break(&c, &ids(&args[2]), &ids(&args[3])).await,
        _ => {
            eprintln!("unknown command {cmd:?}");
            std::process::exit(2)
        }
    };
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
