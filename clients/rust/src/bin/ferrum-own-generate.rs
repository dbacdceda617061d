//! ferrum-own-generate: Ferrum's ContinuousEngine on Ferrum's own in-process CPU
//! executor (its registry's "llm" executor: LlamaFamilyModel on its CpuBackend, loaded
//! from a safetensors model folder), generating for the prompts given. The counterpart
//! of ferrum-engine-generate, with the model run in this process instead of by a
//! ferrum-rpc server.
//!
//! ferrum-own-generate --model DIR [--max-tokens N] [--concurrency K]
//!     [--temperature X] [--seed S] [--ids] [--timing] [--tokenizer FILE]
//!     [--step-tokens N] [--scheduler-trace FILE] PROMPT...
//!
//! Greedy unless a temperature is given. Each prompt is tokenized by Ferrum's
//! tokenizer over tokenizer.json (DIR/tokenizer.json unless --tokenizer is given).
//! One line per prompt, in the order given: the generated text, or with --ids the
//! generated ids separated by spaces. K requests are in flight at once. --step-tokens
//! N: the engine step's token budget (default Ferrum's own, 2,048: this program runs
//! Ferrum as it ships); --scheduler-trace FILE: Ferrum's per-step scheduler trace
//! (JSON lines). With --timing, a last line `timing {json}` gives per-request time to
//! first token and decode tokens/s. A failed request prints `error: <message>` on
//! stderr and exits 1.

use ferrum_engine::registry::{global_registry, ComponentConfig};
use ferrum_interfaces::ModelExecutor;
use ferrum_rpc_client::engine_setup::{self as setup, fail, Cli, EngineSettings, GenerateArgs, SharedTokenizer};
use ferrum_types::{Device, EngineConfig};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

struct Args {
    model: PathBuf,
    tokenizer: Option<PathBuf>,
    generate: GenerateArgs,
    engine: EngineSettings,
}

const USAGE: &str = "ferrum-own-generate --model DIR [--max-tokens N] [--concurrency K] [--temperature X] [--seed S] \
[--ids] [--timing] [--tokenizer FILE] [--step-tokens N] [--scheduler-trace FILE] PROMPT...";

fn parse() -> Args {
    let mut a = Args {
        model: PathBuf::new(),
        tokenizer: None,
        generate: GenerateArgs::default(),
        engine: EngineSettings::new(EngineConfig::default().batching.max_num_batched_tokens),
    };
    let mut cli = Cli::from_env(USAGE);
    while let Some(arg) = cli.next() {
        match arg.as_str() {
            "--model" => a.model = PathBuf::from(cli.value("--model")),
            "--tokenizer" => a.tokenizer = Some(PathBuf::from(cli.value("--tokenizer"))),
            s if a.generate.take(s, &mut cli) || a.engine.take(s, &mut cli) => {}
            s => cli.usage(&format!("unknown option {s}")),
        }
    }
    if a.model.as_os_str().is_empty() {
        cli.usage("--model is required");
    }
    a.generate.concurrency = a.generate.concurrency.max(1);
    a.engine.running = a.generate.concurrency;
    a
}

#[tokio::main]
async fn main() {
    let args = parse();
    let model_dir = args.model.canonicalize().unwrap_or_else(|e| fail(format!("model {}: {e}", args.model.display())));
    let model_id = ferrum_types::ModelId::new(
        model_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into()),
    );

    let mut config = args.engine.config(&model_id);
    config.backend.device = Device::CPU;

    // The executor is made here, as EngineBuilder would make it for a model path (the
    // registry's "llm" factory: the config.json architecture picks the model, the
    // device CPU picks the backend), so that its vocabulary is known before the
    // engine is built and the model's load is kept out of the requests' times.
    let load = Instant::now();
    let mut component = ComponentConfig::from_engine_config(&config);
    component
        .component_options
        .insert("model_path".into(), serde_json::Value::String(model_dir.display().to_string()));
    let executor: Arc<dyn ModelExecutor + Send + Sync> = global_registry()
        .create_executor("llm", &component)
        .await
        .unwrap_or_else(|e| fail(format!("executor: {e}")));
    let load_s = load.elapsed().as_secs_f64();

    let tokenizer_path = args.tokenizer.clone().unwrap_or_else(|| model_dir.join("tokenizer.json"));
    let tokenizer: SharedTokenizer = Arc::new(setup::load_tokenizer(&tokenizer_path).await.unwrap_or_else(|e| fail(e)));
    let (engine, warm) = setup::build_engine(config, executor, tokenizer).await.unwrap_or_else(|e| fail(e));

    // The model lives in this process: a failed request's stream says all there is.
    let mut run = setup::generate_all(engine.clone(), model_id, &args.generate, Arc::new(|| None));
    // Interrupted: the requests' streams are dropped (the engine cancels them); the
    // model lives in this process, so nothing outside it is left holding state.
    let done = tokio::select! {
        done = &mut run => done.expect("generation task"),
        _ = tokio::signal::ctrl_c() => {
            run.abort();
            let _ = run.await;
            eprintln!("cancelled");
            std::process::exit(130);
        }
    };
    let (failed, timings) = setup::print_generated(&done, args.generate.ids);
    if args.generate.timing {
        println!("timing [{}]", timings.join(", "));
        eprintln!("model load at startup: {:.1} ms", load_s * 1e3);
        eprintln!("token policy scan at startup: {:.1} ms", warm.as_secs_f64() * 1e3);
    }
    let _ = engine.shutdown().await;
    std::process::exit(if failed { 1 } else { 0 });
}
