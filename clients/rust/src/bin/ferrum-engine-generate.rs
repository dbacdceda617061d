//! ferrum-engine-generate: Ferrum's ContinuousEngine, its model run by a ferrum-rpc
//! server through RemoteExecutor, generating for the prompts given.
//!
//! ferrum-engine-generate --addr HOST:PORT [--token T] [--max-tokens N]
//!     [--concurrency K] [--temperature X] [--seed S] [--ids] [--timing]
//!     [--decode-ahead N] [--tokenizer FILE] [--step-tokens N] [--scheduler-trace FILE]
//!     PROMPT...
//!
//! Greedy unless a temperature is given. Each prompt is tokenized by Ferrum's
//! tokenizer over tokenizer.json (tokenizers' encode with its defaults). One line per
//! prompt, in the order given: the generated text, or with --ids the generated ids
//! separated by spaces. K requests are in flight at once. --decode-ahead N: the
//! executor's decode-ahead runs hold at most N tokens a sequence (0: no decoding ahead;
//! default 64). --step-tokens N: the engine step's token budget (default
//! engine_setup::DEFAULT_STEP_TOKENS, 128: a long prompt is prefilled in chunks that
//! fit it); --scheduler-trace FILE: Ferrum's per-step scheduler trace (JSON lines).
//! With --timing, a last line `timing {json}` gives per-request time to first token
//! and decode tokens/s.
//! A failed request prints `error: <REASON: message>` on stderr and exits 1.

use ferrum_interfaces::ModelExecutor;
use ferrum_rpc_client::engine_setup::{self as setup, Cli, EngineSettings, GenerateArgs, SharedTokenizer};
use std::path::PathBuf;
use std::sync::Arc;

struct Args {
    addr: String,
    token: Option<String>,
    decode_ahead: Option<u32>,
    tokenizer: PathBuf,
    generate: GenerateArgs,
    engine: EngineSettings,
}

const USAGE: &str = "ferrum-engine-generate --addr HOST:PORT [--token T] [--max-tokens N] [--concurrency K] \
[--temperature X] [--seed S] [--ids] [--timing] [--decode-ahead N] [--tokenizer FILE] [--step-tokens N] \
[--scheduler-trace FILE] PROMPT...";

fn parse() -> Args {
    let mut a = Args {
        addr: String::new(),
        token: std::env::var("FERRUM_RPC_TOKEN").ok(),
        decode_ahead: None,
        tokenizer: setup::default_tokenizer(),
        generate: GenerateArgs::default(),
        engine: EngineSettings::new(setup::DEFAULT_STEP_TOKENS),
    };
    let mut cli = Cli::from_env(USAGE);
    while let Some(arg) = cli.next() {
        match arg.as_str() {
            "--addr" => a.addr = cli.value("--addr"),
            "--token" => a.token = Some(cli.value("--token")),
            "--tokenizer" => a.tokenizer = PathBuf::from(cli.value("--tokenizer")),
            "--decode-ahead" => a.decode_ahead = Some(cli.parsed("--decode-ahead")),
            s if a.generate.take(s, &mut cli) || a.engine.take(s, &mut cli) => {}
            s => cli.usage(&format!("unknown option {s}")),
        }
    }
    if a.addr.is_empty() {
        cli.usage("--addr is required");
    }
    a.generate.concurrency = a.generate.concurrency.max(1);
    a.engine.running = a.generate.concurrency;
    a
}

#[tokio::main]
async fn main() {
    let args = parse();
    // The program prints each prompt's text when it ends, so nobody watches the tokens
    // come: a run's tokens may come several forwards to a response.
    let executor = setup::connect(&args.addr, args.token.clone()).await.unwrap_or_else(|e| setup::fail(e));
    let executor = Arc::new(
        match args.decode_ahead {
            Some(window) => executor.with_decode_ahead(window),
            None => executor,
        }
        .with_ahead_batch(ferrum_rpc_client::ahead::UNWATCHED_FORWARDS_PER_RESPONSE),
    );
    let model_id = executor.info().model_id.clone();
    let tokenizer: SharedTokenizer =
        Arc::new(setup::load_tokenizer(&args.tokenizer).await.unwrap_or_else(|e| setup::fail(e)));
    let (engine, warm) = setup::build_engine(args.engine.config(&model_id), executor.clone(), tokenizer)
        .await
        .unwrap_or_else(|e| setup::fail(e));

    let why = {
        let executor = executor.clone();
        Arc::new(move || Some(executor.last_error().unwrap_or_else(|| "no executor error".into())))
    };
    let mut run = setup::generate_all(engine.clone(), model_id, &args.generate, why);
    // Interrupted: the requests' streams are dropped, which Ferrum's engine takes as
    // the client gone (it cancels them and releases their sequences); whatever is left
    // after a short wait is released here before exiting.
    let done = tokio::select! {
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
    let (failed, timings) = setup::print_generated(&done, args.generate.ids);
    if args.generate.timing {
        println!("timing [{}]", timings.join(", "));
        eprintln!("executor calls: {}", executor.call_counts());
        eprintln!("token policy scan at startup: {:.1} ms", warm.as_secs_f64() * 1e3);
    }
    let _ = engine.shutdown().await;
    drop(engine);
    // Whatever the engine still held is released, and every release answered, before
    // the process (and its DecodeSession stream) goes.
    executor.release_all(std::time::Duration::from_secs(5)).await;
    std::process::exit(if failed { 1 } else { 0 });
}
