//! What the programs that drive Ferrum's ContinuousEngine (src/bin: ferrum-engine-generate,
//! ferrum-own-generate, ferrum-engine-load) share: reading their command lines, the
//! tokenizer, the engine's configuration and build, and reading one request's stream.
//!
//! The engine's step token budget (`--step-tokens`) is Ferrum's
//! `EngineConfig.batching.max_num_batched_tokens`: the most tokens one engine step
//! carries, decodes (one each) and prompt chunks together. Ferrum's scheduler (ferrum-
//! scheduler 0.8.9, `ContinuousBatchScheduler`) spends what the step's decodes leave of
//! it on prompt chunks, so it bounds how long a step's prompt work delays every running
//! sequence's next token. See [`DEFAULT_STEP_TOKENS`].

use crate::{ClientOptions, ExecutorClient, RemoteExecutor};
use ferrum_engine::EngineBuilder;
use ferrum_interfaces::engine::LlmInferenceEngine;
use ferrum_interfaces::{ModelExecutor, Tokenizer};
use ferrum_types::{EngineConfig, FerrumError, FinishReason, InferenceRequest, ModelId, SamplingParams};
use futures::StreamExt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The engine as the programs hold it.
pub type Engine = Arc<dyn LlmInferenceEngine + Send + Sync>;

/// The tokenizer as the programs give it to the engine.
pub type SharedTokenizer = Arc<dyn Tokenizer + Send + Sync>;

/// Step token budget of the programs whose executor is a ferrum-rpc server
/// (RemoteExecutor). Ferrum's own default (2,048) lets one step carry a whole long
/// prompt: Ferrum's scheduler caps a prompt's chunk below the step budget only once at
/// least half of the batch slots decode (`active_decode_prefill_chunk_for_iteration`),
/// so at a few running requests a 1,500-token prompt is one step, and every running
/// sequence's next token waits for that prompt's forward (the engine streams a token
/// when its step ends). 128 is the server's own budget for a forward while callers
/// decode (`--step-token-budget`), the schedule under which the Python client's
/// callers keep their inter-token p99 under 200 ms: a step then stalls the running
/// sequences for about one such forward (about 0.1 s for 128 prompt tokens of w4a8
/// SmolLM2 on 2 CPU cores), where 256 would take about the whole 200 ms. A long prompt
/// costs a few more steps, each one BatchPrefill continuing its sequence (a few ms of
/// fixed cost). Measured in docs/performance.md.
pub const DEFAULT_STEP_TOKENS: usize = 128;

/// Where the programs find tokenizer.json by default: the prepared SmolLM2 model under
/// FERRUM_RPC_HOME, else ~/.cache/ferrum-rpc.
pub fn default_tokenizer() -> PathBuf {
    let home = std::env::var_os("FERRUM_RPC_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/ferrum-rpc"));
    home.join("models/SmolLM2-135M-Instruct/tokenizer.json")
}

/// Prints `error: {msg}` and exits 1 (a failure at run time, not a bad argument).
pub fn fail(msg: impl std::fmt::Display) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(1)
}

/// A program's arguments, read one at a time. A bad one prints the message and the
/// program's usage line and exits 2.
pub struct Cli {
    usage: String,
    args: std::vec::IntoIter<String>,
}

impl Cli {
    /// The process's arguments, after the program name; `usage` is the usage line.
    pub fn from_env(usage: impl Into<String>) -> Self {
        Self::new(usage, std::env::args().skip(1).collect())
    }

    pub fn new(usage: impl Into<String>, args: Vec<String>) -> Self {
        Self { usage: usage.into(), args: args.into_iter() }
    }

    /// Prints `msg` and the usage line on stderr and exits 2.
    pub fn usage(&self, msg: &str) -> ! {
        eprintln!("{msg}\nusage: {}", self.usage);
        std::process::exit(2)
    }

    /// The next argument, if any.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Option<String> {
        self.args.next()
    }

    /// Every argument left (those after `--`).
    pub fn rest(&mut self) -> Vec<String> {
        self.args.by_ref().collect()
    }

    /// The value of option `name`, the next argument.
    pub fn value(&mut self, name: &str) -> String {
        match self.args.next() {
            Some(v) => v,
            None => self.usage(&format!("{name} needs a value")),
        }
    }

    /// The value of option `name`, parsed: `bad {name}` when it does not parse.
    pub fn parsed<T: FromStr>(&mut self, name: &str) -> T {
        let v = self.value(name);
        v.parse().unwrap_or_else(|_| self.usage(&format!("bad {name}")))
    }
}

/// The engine settings the programs take from their command lines.
#[derive(Debug, Clone)]
pub struct EngineSettings {
    /// The step token budget (`--step-tokens N`): Ferrum's `max_num_batched_tokens`.
    pub step_tokens: usize,
    /// `--scheduler-trace FILE`: Ferrum's per-step scheduler trace (JSON lines, one an
    /// engine step: its plan's decode and prompt tokens, and how long the step took).
    pub scheduler_trace: Option<PathBuf>,
    /// Requests that may run at once (at least Ferrum's default, 32).
    pub running: usize,
}

impl EngineSettings {
    /// `step_tokens` is the program's default budget.
    pub fn new(step_tokens: usize) -> Self {
        Self { step_tokens, scheduler_trace: None, running: 0 }
    }

    /// Takes `arg` (and its value) when it is one of these settings' options.
    pub fn take(&mut self, arg: &str, cli: &mut Cli) -> bool {
        match arg {
            "--step-tokens" => {
                self.step_tokens = cli.parsed("--step-tokens");
                if self.step_tokens == 0 {
                    cli.usage("--step-tokens must be at least 1");
                }
            }
            "--scheduler-trace" => self.scheduler_trace = Some(PathBuf::from(cli.value("--scheduler-trace"))),
            _ => return false,
        }
        true
    }

    /// Ferrum's default configuration with these settings, for `model_id`.
    pub fn config(&self, model_id: &ModelId) -> EngineConfig {
        let mut config = EngineConfig::default();
        config.model.model_id = model_id.clone();
        config.scheduler.max_running_requests = config.scheduler.max_running_requests.max(self.running);
        config.batching.max_num_batched_tokens = self.step_tokens;
        config.runtime.legacy_scheduler_trace_jsonl = self.scheduler_trace.clone();
        config
    }
}

/// Connects to the server at `addr` (with `token`, if any) and makes its executor.
pub async fn connect(addr: &str, token: Option<String>) -> Result<RemoteExecutor, String> {
    let opts = ClientOptions { token, ..Default::default() };
    let client = ExecutorClient::connect(addr, opts).await.map_err(|e| e.to_string())?;
    RemoteExecutor::new(client).await.map_err(|e| e.to_string())
}

/// Ferrum's tokenizer over tokenizer.json at `path`.
pub async fn load_tokenizer(
    path: &std::path::Path,
) -> Result<ferrum_tokenizer::implementations::HuggingFaceTokenizer, String> {
    ferrum_tokenizer::implementations::HuggingFaceTokenizer::from_file(&path.to_string_lossy())
        .await
        .map_err(|e| format!("tokenizer {}: {e}", path.display()))
}

/// Runs the engine's per-tokenizer scan of the vocabulary for its token policy now.
///
/// Ferrum builds each request's token policy (the special and control tokens its greedy
/// mask forbids) from a scan of the whole vocabulary, cached per tokenizer instance
/// (ferrum-engine 0.8.9, src/continuous_engine.rs: cached_forbidden_generation_tokens,
/// keyed by the tokenizer `Arc`'s address, reached from SequenceState's constructor). A
/// long-running engine pays that scan once; a program that starts an engine for a run
/// would pay it in its first request's time to first token, so it runs here, on the
/// instance the engine is then given. Returns how long it took.
pub fn warm_token_policy(tokenizer: &SharedTokenizer, model_id: &ModelId, vocab_size: usize) -> Duration {
    let warm = Instant::now();
    let _ = ferrum_engine::SequenceState::try_new_with_tokenizer_model_vocab_and_structured_factory(
        InferenceRequest::new(String::new(), model_id.clone()),
        Vec::new(),
        Some(tokenizer.clone()),
        Some(vocab_size),
        None,
    );
    warm.elapsed()
}

/// Builds Ferrum's ContinuousEngine over `executor` with `tokenizer` and `config`, after
/// warming the token policy on that tokenizer (see [`warm_token_policy`]). Returns the
/// engine and the warm-up's time.
pub async fn build_engine(
    config: EngineConfig,
    executor: Arc<dyn ModelExecutor + Send + Sync>,
    tokenizer: SharedTokenizer,
) -> Result<(Engine, Duration), String> {
    let warm = warm_token_policy(&tokenizer, &config.model.model_id, executor.info().vocab_size);
    let engine = EngineBuilder::new(config)
        .with_custom_executor(executor)
        .with_custom_tokenizer(tokenizer)
        .build()
        .await
        .map_err(|e| format!("engine: {e}"))?;
    Ok((Arc::from(engine), warm))
}

/// Streams `request` through `engine` to its end, calling `on_token` with each output
/// token id as its chunk arrives, and returns the streamed text and how the stream
/// ended: `Some(reason)` for the finish chunk, `None` when the stream closed without
/// one. An error chunk ends it with that error.
pub async fn stream_request(
    engine: &Engine,
    request: InferenceRequest,
    mut on_token: impl FnMut(u32),
) -> ferrum_types::Result<(String, Option<FinishReason>)> {
    let mut stream = engine.infer_stream(request).await?;
    let mut text = String::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        if let Some(t) = chunk.token {
            on_token(t.get());
        }
        text.push_str(&chunk.text);
        if chunk.finish_reason.is_some() {
            return Ok((text, chunk.finish_reason));
        }
    }
    Ok((text, None))
}

/// A stream's end as a result: a request the engine ended on an error, or whose stream
/// closed without a finish, failed; `why` (the executor's last error, where there is
/// one) says why.
pub fn finished(finish: Option<FinishReason>, why: impl FnOnce() -> Option<String>) -> ferrum_types::Result<()> {
    match finish {
        Some(FinishReason::Error) | None => {
            let how = finish.map(|f| format!("{f:?}")).unwrap_or_else(|| "stream closed".into());
            Err(FerrumError::backend(match why() {
                Some(why) => format!("the engine ended the request ({how}): {why}"),
                None => format!("the engine ended the request ({how})"),
            }))
        }
        _ => Ok(()),
    }
}

/// The options the two generating programs share (ferrum-engine-generate,
/// ferrum-own-generate): `--max-tokens N --concurrency K --temperature X --seed S --ids
/// --timing`, and the prompts.
#[derive(Debug, Clone)]
pub struct GenerateArgs {
    pub max_tokens: usize,
    pub concurrency: usize,
    pub temperature: Option<f32>,
    pub seed: Option<u64>,
    pub ids: bool,
    pub timing: bool,
    pub prompts: Vec<String>,
}

impl Default for GenerateArgs {
    fn default() -> Self {
        Self { max_tokens: 32, concurrency: 1, temperature: None, seed: None, ids: false, timing: false, prompts: vec![] }
    }
}

impl GenerateArgs {
    /// Takes `arg` when it is one of these options or a prompt (anything not starting
    /// with `--`; after `--`, every argument left).
    pub fn take(&mut self, arg: &str, cli: &mut Cli) -> bool {
        match arg {
            "--max-tokens" => self.max_tokens = cli.parsed("--max-tokens"),
            "--concurrency" => self.concurrency = cli.parsed("--concurrency"),
            "--temperature" => self.temperature = Some(cli.parsed("--temperature")),
            "--seed" => self.seed = Some(cli.parsed("--seed")),
            "--ids" => self.ids = true,
            "--timing" => self.timing = true,
            "--" => self.prompts.extend(cli.rest()),
            s if s.starts_with("--") => return false,
            _ => self.prompts.push(arg.to_string()),
        }
        true
    }

    /// Greedy unless a positive temperature was given; `max_tokens` each.
    pub fn params(&self) -> SamplingParams {
        let mut params = match self.temperature {
            Some(t) if t > 0.0 => SamplingParams { temperature: t, seed: self.seed, ..SamplingParams::default() },
            _ => SamplingParams::greedy(),
        };
        params.max_tokens = self.max_tokens;
        params
    }
}

/// One prompt's generation: its index among the prompts, result, output ids and text,
/// seconds to its first token (None without one) and in all.
pub struct Generated {
    pub index: usize,
    pub result: ferrum_types::Result<()>,
    pub ids: Vec<u32>,
    pub text: String,
    pub first_s: Option<f64>,
    pub total_s: f64,
}

/// Generates for every prompt of `args` through `engine`, `args.concurrency` requests in
/// flight at once, each streamed (so its time to first token is measured where the
/// token arrives). `why` gives a failed request's cause (the executor's last error).
/// Runs as a task, so the caller can stop it; the results come in the prompts' order.
pub fn generate_all(
    engine: Engine,
    model_id: ModelId,
    args: &GenerateArgs,
    why: Arc<dyn Fn() -> Option<String> + Send + Sync>,
) -> tokio::task::JoinHandle<Vec<Generated>> {
    let params = args.params();
    let jobs = args.prompts.clone().into_iter().enumerate().map(move |(index, prompt)| {
        let engine = engine.clone();
        let request = InferenceRequest::new(prompt, model_id.clone()).with_sampling_params(params.clone());
        let why = why.clone();
        async move {
            let t0 = Instant::now();
            let mut first: Option<f64> = None;
            let mut ids: Vec<u32> = Vec::new();
            let streamed = stream_request(&engine, request, |t| {
                first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                ids.push(t);
            })
            .await;
            let (text, result) = match streamed {
                Ok((text, finish)) => (text, finished(finish, || why())),
                Err(e) => (String::new(), Err(e)),
            };
            Generated { index, result, ids, text, first_s: first, total_s: t0.elapsed().as_secs_f64() }
        }
    });
    let concurrency = args.concurrency.max(1);
    tokio::spawn(async move {
        let mut done = futures::stream::iter(jobs).buffer_unordered(concurrency).collect::<Vec<_>>().await;
        done.sort_by_key(|d| d.index);
        done
    })
}

/// Prints the generations in order, one line each: the text (newlines as `\n`), or with
/// `ids` the output ids; a failed one as an empty line, with `error: ...` on stderr.
/// Returns whether any failed, and each successful one's timing as JSON text.
pub fn print_generated(done: &[Generated], ids: bool) -> (bool, Vec<String>) {
    let mut failed = false;
    let mut timings = Vec::new();
    for g in done {
        if let Err(e) = &g.result {
            eprintln!("error: {e}");
            failed = true;
            println!();
            continue;
        }
        if ids {
            println!("{}", g.ids.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(" "));
        } else {
            println!("{}", g.text.replace('\n', "\\n"));
        }
        timings.push(format!(
            "{{\"ttft_s\": {:.6}, \"total_s\": {:.6}, \"tokens\": {}}}",
            g.first_s.unwrap_or(g.total_s),
            g.total_s,
            g.ids.len()
        ));
    }
    (failed, timings)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Cli {
        Cli::new("test", args.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn step_tokens_and_trace_reach_the_engine_config() {
        let mut c = cli(&["--step-tokens", "200", "--scheduler-trace", "/tmp/t.jsonl", "--other"]);
        let mut s = EngineSettings::new(DEFAULT_STEP_TOKENS);
        s.running = 40;
        while let Some(arg) = c.next() {
            if !s.take(&arg, &mut c) {
                assert_eq!(arg, "--other");
            }
        }
        let config = s.config(&ModelId::new("m"));
        assert_eq!(config.batching.max_num_batched_tokens, 200);
        assert_eq!(config.scheduler.max_running_requests, 40);
        assert_eq!(config.runtime.legacy_scheduler_trace_jsonl, Some(PathBuf::from("/tmp/t.jsonl")));
        assert_eq!(config.model.model_id, ModelId::new("m"));
    }

    #[test]
    fn without_options_the_budget_is_the_programs_default() {
        let s = EngineSettings::new(DEFAULT_STEP_TOKENS);
        let config = s.config(&ModelId::new("m"));
        assert_eq!(config.batching.max_num_batched_tokens, DEFAULT_STEP_TOKENS);
        // Ferrum's own running-request default stays when fewer are asked for.
        assert_eq!(config.scheduler.max_running_requests, EngineConfig::default().scheduler.max_running_requests);
        assert_eq!(config.runtime.legacy_scheduler_trace_jsonl, None);
    }

    #[test]
    fn generate_args_take_options_and_prompts() {
        let mut c = cli(&["--max-tokens", "5", "a prompt", "--ids", "--seed", "3", "--temperature", "0.5", "--",
                          "--not-an-option"]);
        let mut g = GenerateArgs::default();
        while let Some(arg) = c.next() {
            assert!(g.take(&arg, &mut c), "{arg}");
        }
        assert_eq!(g.max_tokens, 5);
        assert!(g.ids && !g.timing);
        assert_eq!(g.prompts, vec!["a prompt".to_string(), "--not-an-option".to_string()]);
        let p = g.params();
        assert_eq!((p.max_tokens, p.temperature, p.seed), (5, 0.5, Some(3)));
        assert!(!GenerateArgs::default().take("--unknown", &mut cli(&[])));
    }

    #[test]
    fn a_stream_without_a_finish_or_ending_on_error_failed() {
        assert!(finished(Some(FinishReason::Length), || unreachable!()).is_ok());
        let e = finished(None, || Some("REASON: why".into())).unwrap_err().to_string();
        assert!(e.contains("stream closed") && e.contains("REASON: why"), "{e}");
        let e = finished(Some(FinishReason::Error), || None).unwrap_err().to_string();
        assert!(e.contains("Error"), "{e}");
    }
}
