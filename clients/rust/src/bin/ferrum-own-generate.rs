//! ferrum-own-generate: Ferrum's ContinuousEngine on Ferrum's own in-process CPU
//! executor (its registry's "llm" executor: LlamaFamilyModel on its CpuBackend, loaded
//! from a safetensors model folder), generating for the prompts given. The counterpart
//! of ferrum-engine-generate, with the model run in this process instead of by a
//! ferrum-rpc server.
//!
//! ferrum-own-generate --model DIR [--max-tokens N] [--concurrency K]
//!     [--temperature X] [--seed S] [--ids] [--timing] [--tokenizer FILE] PROMPT...
//!
//! Greedy unless a temperature is given. Each prompt is tokenized by Ferrum's
//! tokenizer over tokenizer.json (DIR/tokenizer.json unless --tokenizer is given).
//! One line per prompt, in the order given: the generated text, or with --ids the
//! generated ids separated by spaces. K requests are in flight at once. With --timing,
//! a last line `timing {json}` gives per-request time to first token and decode
//! tokens/s. A failed request prints `error: <message>` on stderr and exits 1.

use ferrum_engine::registry::{global_registry, ComponentConfig};
use ferrum_engine::EngineBuilder;
use ferrum_interfaces::ModelExecutor;
use ferrum_types::{Device, EngineConfig, InferenceRequest, SamplingParams};
use futures::StreamExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

struct Args {
    model: PathBuf,
    max_tokens: usize,
    concurrency: usize,
    temperature: Option<f32>,
    seed: Option<u64>,
    ids: bool,
    timing: bool,
    tokenizer: Option<PathBuf>,
    prompts: Vec<String>,
}

fn usage(msg: &str) -> ! {
    eprintln!("{msg}\nusage: ferrum-own-generate --model DIR [--max-tokens N] [--concurrency K] [--temperature X] [--seed S] [--ids] [--timing] [--tokenizer FILE] PROMPT...");
    std::process::exit(2)
}

fn parse() -> Args {
    let mut a = Args {
        model: PathBuf::new(),
        max_tokens: 32,
        concurrency: 1,
        temperature: None,
        seed: None,
        ids: false,
        timing: false,
        tokenizer: None,
        prompts: vec![],
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = |name: &str| it.next().unwrap_or_else(|| usage(&format!("{name} needs a value")));
        match arg.as_str() {
            "--model" => a.model = PathBuf::from(val("--model")),
            "--max-tokens" => a.max_tokens = val("--max-tokens").parse().unwrap_or_else(|_| usage("bad --max-tokens")),
            "--concurrency" => a.concurrency = val("--concurrency").parse().unwrap_or_else(|_| usage("bad --concurrency")),
            "--temperature" => a.temperature = Some(val("--temperature").parse().unwrap_or_else(|_| usage("bad --temperature"))),
            "--seed" => a.seed = Some(val("--seed").parse().unwrap_or_else(|_| usage("bad --seed"))),
            "--tokenizer" => a.tokenizer = Some(PathBuf::from(val("--tokenizer"))),
            "--ids" => a.ids = true,
            "--timing" => a.timing = true,
            "--" => a.prompts.extend(it.by_ref()),
            s if s.starts_with("--") => usage(&format!("unknown option {s}")),
            _ => a.prompts.push(arg),
        }
    }
    if a.model.as_os_str().is_empty() {
        usage("--model is required");
    }
    a.concurrency = a.concurrency.max(1);
    a
}

fn fail(msg: String) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(1)
}

#[tokio::main]
async fn main() {
    let args = parse();
    let model_dir = args.model.canonicalize().unwrap_or_else(|e| fail(format!("model {}: {e}", args.model.display())));
    let model_id = ferrum_types::ModelId::new(
        model_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into()),
    );

    let mut config = EngineConfig::default();
    config.model.model_id = model_id.clone();
    config.backend.device = Device::CPU;
    config.scheduler.max_running_requests = config.scheduler.max_running_requests.max(args.concurrency);

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
    let tokenizer = ferrum_tokenizer::implementations::HuggingFaceTokenizer::from_file(&tokenizer_path.to_string_lossy())
        .await
        .unwrap_or_else(|e| fail(format!("tokenizer {}: {e}", tokenizer_path.display())));
    // As in ferrum-engine-generate: the engine's per-tokenizer scan of the vocabulary
    // for its token policy runs once now, as part of startup, rather than inside the
    // first request's time to first token.
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
    let engine = EngineBuilder::new(config)
        .with_custom_executor(executor.clone())
        .with_custom_tokenizer(tokenizer)
        .build()
        .await
        .unwrap_or_else(|e| fail(format!("engine: {e}")));
    let engine: Arc<dyn ferrum_interfaces::engine::LlmInferenceEngine + Send + Sync> = Arc::from(engine);

    let mut params = match args.temperature {
        Some(t) if t > 0.0 => SamplingParams { temperature: t, seed: args.seed, ..SamplingParams::default() },
        _ => SamplingParams::greedy(),
    };
    params.max_tokens = args.max_tokens;

    // Each request streams, so the time to its first token is measured where it arrives.
    let (engine0, model0, params0) = (engine.clone(), model_id.clone(), params.clone());
    let jobs = args.prompts.clone().into_iter().enumerate().map(move |(i, prompt)| {
        let engine = engine0.clone();
        let model_id = model0.clone();
        let params = params0.clone();
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
                match finish {
                    Some(ferrum_types::FinishReason::Error) | None => Err(ferrum_types::FerrumError::backend(format!(
                        "the engine ended the request ({})",
                        finish.map(|f| format!("{f:?}")).unwrap_or_else(|| "stream closed".into()),
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
    // Interrupted: the requests' streams are dropped (the engine cancels them); the
    // model lives in this process, so nothing outside it is left holding state.
    let mut done = tokio::select! {
        done = &mut run => done.expect("generation task"),
        _ = tokio::signal::ctrl_c() => {
            run.abort();
            let _ = run.await;
            eprintln!("cancelled");
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
        eprintln!("model load at startup: {:.1} ms", load_s * 1e3);
        eprintln!("token policy scan at startup: {:.1} ms", warm_s * 1e3);
    }
    let _ = engine.shutdown().await;
    std::process::exit(if failed { 1 } else { 0 });
}
