//! ferrum-engine-generate: Ferrum's ContinuousEngine, its model run by a ferrum-rpc
//! server through RemoteExecutor, generating for the prompts given.
//!
//! ferrum-engine-generate --addr HOST:PORT [--token T] [--max-tokens N]
//!     [--concurrency K] [--temperature X] [--seed S] [--ids] [--timing]
//!     [--decode-ahead N] [--tokenizer FILE] PROMPT...
//!
//! Greedy unless a temperature is given. Each prompt is tokenized by Ferrum's
//! tokenizer over tokenizer.json (tokenizers' encode with its defaults). One line per
//! prompt, in the order given: the generated text, or with --ids the generated ids
//! separated by spaces. K requests are in flight at once. --decode-ahead N: the
//! executor's decode-ahead runs hold at most N tokens a sequence (0: no decoding ahead;
//! default 64). With --timing, a last line
//! `timing {json}` gives per-request time to first token and decode tokens/s.
//! A failed request prints `error: <REASON: message>` on stderr and exits 1.

use ferrum_engine::EngineBuilder;
use ferrum_interfaces::ModelExecutor;
use ferrum_rpc_client::{ClientOptions, ExecutorClient, RemoteExecutor};
use ferrum_types::{EngineConfig, InferenceRequest, SamplingParams};
use futures::StreamExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

struct Args {
    addr: String,
    token: Option<String>,
    max_tokens: usize,
    concurrency: usize,
    temperature: Option<f32>,
    seed: Option<u64>,
    ids: bool,
    timing: bool,
    decode_ahead: Option<u32>,
    tokenizer: PathBuf,
    prompts: Vec<String>,
}

fn default_tokenizer() -> PathBuf {
    let home = std::env::var_os("FERRUM_RPC_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/ferrum-rpc"));
    home.join("models/SmolLM2-135M-Instruct/tokenizer.json")
}

fn usage(msg: &str) -> ! {
    eprintln!("{msg}\nusage: ferrum-engine-generate --addr HOST:PORT [--token T] [--max-tokens N] [--concurrency K] [--temperature X] [--seed S] [--ids] [--timing] [--decode-ahead N] [--tokenizer FILE] PROMPT...");
    std::process::exit(2)
}

fn parse() -> Args {
    let mut a = Args {
        addr: String::new(),
        token: std::env::var("FERRUM_RPC_TOKEN").ok(),
        max_tokens: 32,
        concurrency: 1,
        temperature: None,
        seed: None,
        ids: false,
        timing: false,
        decode_ahead: None,
        tokenizer: default_tokenizer(),
        prompts: vec![],
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = |name: &str| it.next().unwrap_or_else(|| usage(&format!("{name} needs a value")));
        match arg.as_str() {
            "--addr" => a.addr = val("--addr"),
            "--token" => a.token = Some(val("--token")),
            "--max-tokens" => a.max_tokens = val("--max-tokens").parse().unwrap_or_else(|_| usage("bad --max-tokens")),
            "--concurrency" => a.concurrency = val("--concurrency").parse().unwrap_or_else(|_| usage("bad --concurrency")),
            "--temperature" => a.temperature = Some(val("--temperature").parse().unwrap_or_else(|_| usage("bad --temperature"))),
            "--seed" => a.seed = Some(val("--seed").parse().unwrap_or_else(|_| usage("bad --seed"))),
            "--tokenizer" => a.tokenizer = PathBuf::from(val("--tokenizer")),
            "--decode-ahead" => {
                a.decode_ahead = Some(val("--decode-ahead").parse().unwrap_or_else(|_| usage("bad --decode-ahead")))
            }
            "--ids" => a.ids = true,
            "--timing" => a.timing = true,
            "--" => a.prompts.extend(it.by_ref()),
            s if s.starts_with("--") => usage(&format!("unknown option {s}")),
            _ => a.prompts.push(arg),
        }
    }
    if a.addr.is_empty() {
        usage("--addr is required");
    }
    a.concurrency = a.concurrency.max(1);
    a
}

#[tokio::main]
async fn main() {
    let args = parse();
    let opts = ClientOptions { token: args.token.clone(), ..Default::default() };
    let client = match ExecutorClient::connect(&args.addr, opts).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    // The program prints each prompt's text when it ends, so nobody watches the tokens
    // come: a run's tokens may come several forwards to a response.
    let executor = match RemoteExecutor::new(client).await {
        Ok(e) => Arc::new(match args.decode_ahead {
            Some(window) => e.with_decode_ahead(window),
            None => e,
        }.with_ahead_batch(ferrum_rpc_client::ahead::UNWATCHED_FORWARDS_PER_RESPONSE)),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let model_id = executor.info().model_id.clone();
    let tokenizer = ferrum_tokenizer::implementations::HuggingFaceTokenizer::from_file(&args.tokenizer.to_string_lossy())
        .await
        .unwrap_or_else(|e| {
            eprintln!("error: tokenizer {}: {e}", args.tokenizer.display());
            std::process::exit(1)
        });
    // Ferrum builds each request's token policy (the special and control tokens its
    // greedy mask forbids) from a scan of the whole vocabulary, cached per tokenizer
    // instance (ferrum-engine 0.8.9, src/continuous_engine.rs: cached_forbidden_generation_tokens,
    // reached from SequenceState's constructor). A long-running engine pays that scan
    // once; here it would land in the first request's time to first token, so it runs
    // now, on the tokenizer instance the engine is given, as part of its startup.
    let tokenizer: Arc<dyn ferrum_interfaces::Tokenizer + Send + Sync> = Arc::new(tokenizer);
    let warm = Instant::now();
    let _ = ferrum_engine::SequenceState::try_new_with_tokenizer_model_vocab_and_structured_factory(
        InferenceRequest::new(String::new(), model_id.clone()),
        Vec::new(),
        Some(tokenizer.clone()),
        Some(executor.info().vocab_size),
        None,
    );
    let warm_s = warm.elapsed().as_secs_f64();
    let mut config = EngineConfig::default();
    config.model.model_id = model_id.clone();
    config.scheduler.max_running_requests = config.scheduler.max_running_requests.max(args.concurrency);
    let engine = EngineBuilder::new(config)
        .with_custom_executor(executor.clone())
        .with_custom_tokenizer(tokenizer)
        .build()
        .await
        .unwrap_or_else(|e| {
            eprintln!("error: engine: {e}");
            std::process::exit(1)
        });
    let engine: Arc<dyn ferrum_interfaces::engine::LlmInferenceEngine + Send + Sync> = Arc::from(engine);

    let mut params = match args.temperature {
        Some(t) if t > 0.0 => SamplingParams { temperature: t, seed: args.seed, ..SamplingParams::default() },
        _ => SamplingParams::greedy(),
    };
    params.max_tokens = args.max_tokens;

    // Each request streams, so the time to its first token is measured where it arrives.
    let (engine0, model0, params0, exec0) = (engine.clone(), model_id.clone(), params.clone(), executor.clone());
    let jobs = args.prompts.clone().into_iter().enumerate().map(move |(i, prompt)| {
        let engine = engine0.clone();
        let model_id = model0.clone();
        let params = params0.clone();
        let executor0 = exec0.clone();
        async move {
            let request = InferenceRequest::new(prompt, model_id).with_sampling_params(params);
            let t0 = Instant::now();
            let mut first: Option<f64> = None;
            let mut ids: Vec<u32> = Vec::new();
            let mut text = String::new();
            let mut finish = None;
            let result: ferrum_types::Result<()> = async {
                let mut stream = engine.infer_stream(request).await?;
                while let Some(chunk) = stream.next().await {
                    let chunk = chunk?;
                    if let Some(t) = chunk.token {
                        first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                        ids.push(t.get());
                    }
                    text.push_str(&chunk.text);
                    if chunk.finish_reason.is_some() {
                        finish = chunk.finish_reason;
                        break;
                    }
                }
                // A request the engine ended on an error, or whose stream closed without
                // a finish, failed: the executor's last error says why.
                match finish {
                    Some(ferrum_types::FinishReason::Error) | None => Err(ferrum_types::FerrumError::backend(format!(
                        "the engine ended the request ({}): {}",
                        finish.map(|f| format!("{f:?}")).unwrap_or_else(|| "stream closed".into()),
                        executor0.last_error().unwrap_or_else(|| "no executor error".into())
                    ))),
                    _ => Ok(()),
                }
            }
            .await;
            (i, result, ids, text, first, t0.elapsed().as_secs_f64())
        }
    });
    let concurrency = args.concurrency;
    let mut run = tokio::spawn(futures::stream::iter(jobs).buffer_unordered(concurrency).collect::<Vec<_>>());
    // Interrupted: the requests' streams are dropped, which Ferrum's engine takes as
    // the client gone (it cancels them and releases their sequences); whatever is left
    // after a short wait is released here before exiting.
    let mut done = tokio::select! {
        done = &mut run => done.expect("generation task"),
        _ = tokio::signal::ctrl_c() => {
            run.abort();
            let _ = run.await;
            let clean = executor.wait_released(std::time::Duration::from_secs(5)).await;
            if !clean {
                executor.release_all(std::time::Duration::from_secs(5)).await;
            }
            eprintln!("cancelled: the engine released its sequences{}", if clean { "" } else { " (the rest released here)" });
            std::process::exit(130);
        }
    };
    done.sort_by_key(|d| d.0);
    let mut failed = false;
    let mut timings = Vec::new();
    for (_, result, ids, text, first, total) in &done {
        if let Err(e) = result {
            eprintln!("error: {e}");
            failed = true;
            println!();
            continue;
        }
        if args.ids {
            println!("{}", ids.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(" "));
        } else {
            println!("{}", text.replace('\n', "\\n"));
        }
        timings.push(format!(
            "{{\"ttft_s\": {:.6}, \"total_s\": {:.6}, \"tokens\": {}}}",
            first.unwrap_or(*total),
            total,
            ids.len()
        ));
    }
    if args.timing {
        println!("timing [{}]", timings.join(", "));
        eprintln!("executor calls: {}", executor.call_counts());
        eprintln!("token policy scan at startup: {:.1} ms", warm_s * 1e3);
    }
    let _ = engine.shutdown().await;
    drop(engine);
    // Whatever the engine still held is released, and every release answered, before
    // the process (and its DecodeSession stream) goes.
    executor.release_all(std::time::Duration::from_secs(5)).await;
    std::process::exit(if failed { 1 } else { 0 });
}
