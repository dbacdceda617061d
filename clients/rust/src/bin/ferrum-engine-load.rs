//! ferrum-engine-load: Ferrum's ContinuousEngine, its model run by a ferrum-rpc server
//! through RemoteExecutor, serving a timed workload of token-id prompts.
//!
//! ferrum-engine-load --addr HOST:PORT [--token T] [--workload FILE|-] [--tokenizer FILE]
//!     [--stop-at-eos] [--step-tokens N] [--scheduler-trace FILE]
//!
//! The workload is JSON: a list of `{"arrival_s": S, "prompt_ids": [..], "max_tokens": N}`
//! (from FILE, or stdin when FILE is `-` or not given). The engine is built first; then
//! the run starts, and each request is submitted to the engine (greedy) at `arrival_s`
//! seconds after the start, each as its own streamed request. Output tokens run to
//! `max_tokens`: EOS does not stop them (as a load generator's fixed output length),
//! unless --stop-at-eos.
//!
//! One JSON line per request, in the order the requests end:
//! `{"index": I, "arrival_s": S, "submitted_s": S, "ids": [..], "times": [..], "error": E}`,
//! where `times[k]` is when output token `ids[k]` reached this program from the engine's
//! stream (one chunk per token, sent as the engine step that chose it ends), seconds from
//! the run's start on the same clock as `arrival_s`; `error` is null or `REASON: message`.
//! Exits 1 when any request failed (its line says why), 2 on bad arguments or workload.
//!
//! Prompts go in as token ids: Ferrum's engine takes a text prompt and encodes it with
//! its tokenizer, so the tokenizer given to the engine here is tokenizer.json's with one
//! change: a prompt that is all whitespace-separated integers encodes to those ids as
//! they are (no special tokens added). Decoding (the stream's text) is tokenizer.json's.
//!
//! The engine is built as ferrum-engine-generate builds it (crate::engine_setup: same
//! connection, executor, tokenizer file and EngineConfig, with room for every request
//! to run at once). --step-tokens N: the engine step's token budget, decodes and prompt
//! chunks together (default engine_setup::DEFAULT_STEP_TOKENS, 128), so a long prompt
//! is prefilled over several steps instead of stalling every running request's next
//! token for its whole forward; --scheduler-trace FILE: Ferrum's per-step scheduler
//! trace (JSON lines: each step's decode and prompt tokens and its time).

use ferrum_interfaces::tokenizer::{ChatMessage, Tokenizer, TokenizerInfo};
use ferrum_interfaces::ModelExecutor;
use ferrum_rpc_client::engine_setup::{self as setup, fail, Cli, EngineSettings};
use ferrum_types::{InferenceRequest, SamplingParams, SpecialTokens, TokenId};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

struct Args {
    addr: String,
    token: Option<String>,
    workload: Option<PathBuf>,
    tokenizer: PathBuf,
    stop_at_eos: bool,
    engine: EngineSettings,
}

struct Item {
    arrival_s: f64,
    prompt_ids: Vec<u32>,
    max_tokens: usize,
}

const USAGE: &str = "ferrum-engine-load --addr HOST:PORT [--token T] [--workload FILE|-] [--tokenizer FILE] \
[--stop-at-eos] [--step-tokens N] [--scheduler-trace FILE]";

fn usage(msg: &str) -> ! {
    Cli::new(USAGE, vec![]).usage(msg)
}

fn parse() -> Args {
    let mut a = Args {
        addr: String::new(),
        token: std::env::var("FERRUM_RPC_TOKEN").ok(),
        workload: None,
        tokenizer: setup::default_tokenizer(),
        stop_at_eos: false,
        engine: EngineSettings::new(setup::DEFAULT_STEP_TOKENS),
    };
    let mut cli = Cli::from_env(USAGE);
    while let Some(arg) = cli.next() {
        match arg.as_str() {
            "--addr" => a.addr = cli.value("--addr"),
            "--token" => a.token = Some(cli.value("--token")),
            "--workload" => {
                let v = cli.value("--workload");
                a.workload = (v != "-").then(|| PathBuf::from(v));
            }
            "--tokenizer" => a.tokenizer = PathBuf::from(cli.value("--tokenizer")),
            "--stop-at-eos" => a.stop_at_eos = true,
            s if a.engine.take(s, &mut cli) => {}
            s => cli.usage(&format!("unknown argument {s}")),
        }
    }
    if a.addr.is_empty() {
        cli.usage("--addr is required");
    }
    a
}

fn read_workload(path: Option<&PathBuf>) -> Vec<Item> {
    let text = match path {
        Some(p) => std::fs::read_to_string(p).unwrap_or_else(|e| usage(&format!("workload {}: {e}", p.display()))),
        None => {
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s).unwrap_or_else(|e| usage(&format!("workload on stdin: {e}")));
            s
        }
    };
    let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| usage(&format!("workload is not JSON: {e}")));
    let list = value.as_array().unwrap_or_else(|| usage("workload: a JSON list of requests expected"));
    list.iter()
        .enumerate()
        .map(|(i, r)| {
            let bad = |what: &str| -> ! { usage(&format!("workload request {i}: {what}")) };
            let arrival_s =
                r["arrival_s"].as_f64().filter(|s| *s >= 0.0).unwrap_or_else(|| bad("arrival_s >= 0 expected"));
            let prompt_ids: Vec<u32> = r["prompt_ids"]
                .as_array()
                .unwrap_or_else(|| bad("prompt_ids: a list of token ids expected"))
                .iter()
                .map(|t| {
                    t.as_u64().and_then(|t| u32::try_from(t).ok()).unwrap_or_else(|| bad("a prompt id is not a u32"))
                })
                .collect();
            if prompt_ids.is_empty() {
                bad("prompt_ids is empty");
            }
            let max_tokens =
                r["max_tokens"].as_u64().filter(|n| *n > 0).unwrap_or_else(|| bad("max_tokens >= 1 expected"));
            Item { arrival_s, prompt_ids, max_tokens: max_tokens as usize }
        })
        .collect()
}

/// tokenizer.json's tokenizer, except that a text of whitespace-separated integers
/// encodes to exactly those ids: how this program hands the engine token-id prompts.
struct IdsTokenizer {
    inner: Arc<dyn Tokenizer + Send + Sync>,
}

impl IdsTokenizer {
    fn prompt(ids: &[u32]) -> String {
        ids.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(" ")
    }

    fn as_ids(text: &str) -> Option<Vec<TokenId>> {
        let ids: Option<Vec<TokenId>> =
            text.split_whitespace().map(|w| w.parse::<u32>().ok().map(TokenId::new)).collect();
        ids.filter(|v| !v.is_empty())
    }
}

impl Tokenizer for IdsTokenizer {
    fn encode(&self, text: &str, add_special: bool) -> ferrum_types::Result<Vec<TokenId>> {
        match Self::as_ids(text) {
            Some(ids) => Ok(ids),
            None => self.inner.encode(text, add_special),
        }
    }
    fn decode(&self, tokens: &[TokenId], skip_special: bool) -> ferrum_types::Result<String> {
        self.inner.decode(tokens, skip_special)
    }
    fn decode_incremental(&self, prev: &[TokenId], next: TokenId) -> ferrum_types::Result<String> {
        self.inner.decode_incremental(prev, next)
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn special_tokens(&self) -> &SpecialTokens {
        self.inner.special_tokens()
    }
    fn token_id(&self, text: &str) -> Option<TokenId> {
        self.inner.token_id(text)
    }
    fn token_text(&self, token_id: TokenId) -> Option<&str> {
        self.inner.token_text(token_id)
    }
    fn token_bytes(&self, token_id: TokenId) -> Option<Vec<u8>> {
        self.inner.token_bytes(token_id)
    }
    fn is_special_token(&self, token_id: TokenId) -> bool {
        self.inner.is_special_token(token_id)
    }
    fn apply_chat_template(&self, messages: &[ChatMessage]) -> ferrum_types::Result<String> {
        self.inner.apply_chat_template(messages)
    }
    fn info(&self) -> TokenizerInfo {
        self.inner.info()
    }
}

#[tokio::main]
async fn main() {
    let args = parse();
    let work = read_workload(args.workload.as_ref());

    // The engine, as ferrum-engine-generate builds it, with a running slot for every
    // request of the workload (a burst: none waits on a slot).
    let executor = Arc::new(setup::connect(&args.addr, args.token.clone()).await.unwrap_or_else(|e| fail(e)));
    let model_id = executor.info().model_id.clone();
    let tokenizer = setup::load_tokenizer(&args.tokenizer).await.unwrap_or_else(|e| fail(e));
    let tokenizer = IdsTokenizer { inner: Arc::new(tokenizer) };
    let mut settings = args.engine.clone();
    settings.running = work.len();
    let (engine, _) = setup::build_engine(settings.config(&model_id), executor.clone(), Arc::new(tokenizer))
        .await
        .unwrap_or_else(|e| fail(e));

    let start = Instant::now();
    let stop_at_eos = args.stop_at_eos;
    let tasks: Vec<_> = work
        .into_iter()
        .enumerate()
        .map(|(index, item)| {
            let engine = engine.clone();
            let model_id = model_id.clone();
            let executor = executor.clone();
            tokio::spawn(async move {
                tokio::time::sleep_until(start + Duration::from_secs_f64(item.arrival_s)).await;
                let submitted_s = start.elapsed().as_secs_f64();
                let mut params = SamplingParams::greedy();
                params.max_tokens = item.max_tokens;
                let mut request = InferenceRequest::new(IdsTokenizer::prompt(&item.prompt_ids), model_id)
                    .with_sampling_params(params);
                if !stop_at_eos {
                    // Ferrum's request flag: EOS is not a stop (as llama-server's ignore_eos).
                    request.metadata.insert("ferrum_ignore_eos".to_string(), json!(true));
                }
                let mut ids: Vec<u32> = Vec::new();
                let mut times: Vec<f64> = Vec::new();
                let streamed = setup::stream_request(&engine, request, |t| {
                    times.push(start.elapsed().as_secs_f64());
                    ids.push(t);
                })
                .await;
                // Ended on an error, or the stream closed without a finish: the
                // executor's last error says why.
                let result = streamed.and_then(|(_, finish)| {
                    setup::finished(finish, || {
                        Some(executor.last_error().unwrap_or_else(|| "no executor error".into()))
                    })
                });
                let error = result.err().map(|e| e.to_string());
                let line = json!({"index": index, "arrival_s": item.arrival_s, "submitted_s": submitted_s,
                                  "ids": ids, "times": times, "error": error});
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{line}");
                let _ = out.flush();
                error.is_none()
            })
        })
        .collect();
    let mut failed = false;
    for task in tasks {
        failed |= !task.await.unwrap_or(false);
    }
    // The engine releases a finished request's sequence after its last chunk: wait for
    // those releases to reach the server before exiting. Any still held then (the engine
    // did not release them) are released here, and said so.
    if !executor.wait_released(Duration::from_secs(10)).await {
        eprintln!(
            "warning: {} sequence(s) still held after every request ended: released here",
            executor.live_sequences()
        );
        executor.release_all(Duration::from_secs(5)).await;
    }
    let _ = engine.shutdown().await;
    drop(engine);
    std::process::exit(if failed { 1 } else { 0 });
}
