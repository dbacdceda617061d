//! ferrum-rust-vectors: the Rust client's runner of the shared test vectors
//! (tests/vectors/cases.json).
//!
//!   ferrum-rust-vectors --addr HOST:PORT [--cases FILE]
//!
//! Runs every case's steps through [`ExecutorClient`] and prints one JSON line per case,
//! `{"case": NAME, "steps": [RESULT, ...]}`, in the format every client's runner prints
//! (tests/vectors/README.md); tests/contract/test_vectors.py compares them with the
//! cases' `expect`. A call this runner does not know fails its case.

use ferrum_rpc_client::error::code_name;
use ferrum_rpc_client::{pb, ClientOptions, DecodeSession, ExecutorClient, ExecutorError};
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::time::Duration;

type R<T> = Result<T, ExecutorError>;

/// One case's state: per handle name its handle and its next token (the argmax of the
/// last row or the chosen token of the last call on it).
struct Case<'a> {
    client: &'a ExecutorClient,
    handles: HashMap<String, pb::KvCacheHandle>,
    next: HashMap<String, u32>,
    /// An export's messages by name, relayed to ImportSequence as received.
    exports: HashMap<String, Vec<pb::SequenceChunk>>,
    /// An import ticket's secret by name.
    tickets: HashMap<String, String>,
}

/// What an output-producing reply holds, whichever RPC made it.
struct Out {
    logits: Option<pb::Logits>,
    kv_cache: Option<pb::KvCacheHandle>,
    chosen: Option<pb::ChosenToken>,
}

macro_rules! out_of {
    ($r:expr) => {{
        let r = $r;
        Out { logits: r.logits, kv_cache: r.kv_cache, chosen: r.chosen }
    }};
}

fn policy(name: &str) -> pb::LogitsPolicy {
    let (kind, all_positions) = match name {
        "argmax" => (pb::LogitsKind::Argmax, false),
        "argmax_all" => (pb::LogitsKind::Argmax, true),
        "full" => (pb::LogitsKind::Full, false),
        "full_all" => (pb::LogitsKind::Full, true),
        other => panic!("unknown logits policy {other:?}"),
    };
    pb::LogitsPolicy { kind: kind as i32, dtype: pb::DType::DtypeFloat32 as i32, all_positions, ..Default::default() }
}

fn choice(c: &Value) -> pb::TokenChoice {
    pb::TokenChoice {
        temperature: c.get("temperature").and_then(Value::as_f64).map(|v| v as f32),
        top_k: c.get("top_k").and_then(Value::as_u64).unwrap_or(0) as u32,
        top_p: c.get("top_p").and_then(Value::as_f64).map(|v| v as f32),
        seed: c.get("seed").and_then(Value::as_u64),
        ..Default::default()
    }
}

/// The step's logits policy or token choice.
fn asked(step: &Value) -> (Option<pb::LogitsPolicy>, Option<pb::TokenChoice>) {
    match step.get("choice") {
        Some(c) => (None, Some(choice(c))),
        None => (Some(policy(step["logits"].as_str().unwrap())), None),
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn names(v: &Value) -> Vec<String> {
    v.as_array().unwrap().iter().map(|x| x.as_str().unwrap().to_string()).collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Case<'_> {
    fn token(&self, name: &str, token: &Value) -> u32 {
        match token.as_str() {
            Some("next") => self.next[name],
            _ => token.as_u64().unwrap() as u32,
        }
    }

    fn handle(&self, step: &Value) -> pb::KvCacheHandle {
        self.handles[step["handle"].as_str().unwrap()].clone()
    }

    /// Stores the output's handle under `name`; the result of an output-producing call.
    fn kept(&mut self, name: &str, out: Out) -> Value {
        let handle = out.kv_cache.unwrap_or_default();
        let length = handle.sequence_length;
        self.handles.insert(name.to_string(), handle);
        let mut result = Map::new();
        result.insert("length".into(), json!(length));
        let mut got: Vec<u32> = Vec::new();
        if let Some(c) = &out.chosen {
            got.push(c.token_id);
        } else if let Some(l) = &out.logits {
            if l.kind == pb::LogitsKind::Full as i32 {
                let t = l.values.as_ref().unwrap();
                result.insert("logits".into(), json!({"shape": t.shape, "f32_hex": hex(&t.data)}));
                return Value::Object(result);
            }
            got = l.token_ids.clone();
        }
        if let Some(last) = got.last() {
            self.next.insert(name.to_string(), *last);
        }
        result.insert("ids".into(), json!(got));
        Value::Object(result)
    }

    /// Stores a SpeculativeDecode round's handle under `name` with its `next_token_id` as
    /// the next token; the result: length, the drafts kept, the next token and the
    /// argmax of the logits row after them.
    fn speculated(&mut self, name: &str, r: pb::SpeculativeDecodeResponse) -> Value {
        let handle = r.kv_cache.unwrap_or_default();
        let length = handle.sequence_length;
        self.handles.insert(name.to_string(), handle);
        self.next.insert(name.to_string(), r.next_token_id);
        let argmax = r.logits.map(|l| l.token_ids).unwrap_or_default();
        json!({"length": length, "accepted": r.accepted_token_ids, "next": r.next_token_id, "ids": argmax})
    }

    fn kept_all(&mut self, names: &[String], outs: Vec<Out>) -> Value {
        let items: Vec<Value> = names.iter().zip(outs).map(|(n, o)| self.kept(n, o)).collect();
        json!({ "items": items })
    }

    fn items(&self, step: &Value) -> Vec<pb::DecodeItem> {
        let tokens = step["tokens"].as_array().unwrap();
        names(&step["handles"])
            .iter()
            .zip(tokens)
            .map(|(n, t)| pb::DecodeItem { token_id: self.token(n, t), kv_cache: Some(self.handles[n].clone()), token_choice: None })
            .collect()
    }
}

/// The results of a step run `repeat` times as one: ids (or each item's) concatenated, the last length.
fn repeated(results: Vec<Value>) -> Value {
    let mut last = results.last().unwrap().clone();
    if last.get("ids").is_some() {
        let all: Vec<Value> = results.iter().flat_map(|r| r["ids"].as_array().unwrap().clone()).collect();
        last["ids"] = json!(all);
    }
    if let Some(items) = last.get("items").and_then(Value::as_array).cloned() {
        let merged: Vec<Value> = (0..items.len())
            .map(|k| {
                let all: Vec<Value> =
                    results.iter().flat_map(|r| r["items"][k]["ids"].as_array().unwrap().clone()).collect();
                json!({"ids": all, "length": items[k]["length"]})
            })
            .collect();
        last["items"] = json!(merged);
    }
    last
}

fn times(step: &Value) -> u64 {
    step.get("repeat").and_then(Value::as_u64).unwrap_or(1)
}

async fn run_step(case: &mut Case<'_>, addr: &str, step: &Value) -> R<Value> {
    let c = case.client;
    match step["call"].as_str().unwrap() {
        "info" => {
            let i = c.info().await?;
            Ok(json!({"vocab_size": i.vocab_size, "num_layers": i.num_layers, "max_sequence_length": i.max_sequence_length}))
        }
        "status" => Ok(json!({"active_sequences": c.status().await?.active_sequences})),
        "prefill" => {
            let (logits, choice) = asked(step);
            let other;
            let on = match step.get("model").and_then(Value::as_str) {
                Some(model) => {
                    other = connect(addr, model).await?;
                    &other
                }
                None => c,
            };
            let out = on.prefill(&ids(&step["tokens"]), None, logits, choice).await?;
            Ok(case.kept(step["as"].as_str().unwrap(), out_of!(out)))
        }
        "batch_prefill" => {
            let (logits, choice) = asked(step);
            let items = step["prompts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| pb::PrefillItem { token_ids: ids(p), token_choice: choice.clone(), ..Default::default() })
                .collect();
            let mut replies = c.batch_prefill(items, logits).await?;
            replies.sort_by_key(|r| r.index);
            Ok(case.kept_all(&names(&step["as"]), replies.into_iter().map(|r| out_of!(r)).collect()))
        }
        "decode" => {
            let name = step["handle"].as_str().unwrap();
            let keep = step.get("as").and_then(Value::as_str).unwrap_or(name).to_string();
            let (logits, choice) = asked(step);
            let mut results = Vec::new();
            for _ in 0..times(step) {
                let token = case.token(name, &step["token"]);
                let out = c.decode(token, &case.handles[name], logits.clone(), choice.clone()).await?;
                results.push(case.kept(&keep, out_of!(out)));
            }
            Ok(repeated(results))
        }
        "batch_decode" => {
            let (logits, _) = asked(step);
            let mut results = Vec::new();
            for _ in 0..times(step) {
                let mut replies = c.batch_decode(case.items(step), logits.clone(), true).await?;
                replies.sort_by_key(|r| r.index);
                results.push(case.kept_all(&names(&step["handles"]), replies.into_iter().map(|r| out_of!(r)).collect()));
            }
            Ok(repeated(results))
        }
        "session" => {
            let (logits, _) = asked(step);
            let mut session: DecodeSession = c.decode_session().await?;
            let mut results = Vec::new();
            for _ in 0..times(step) {
                let mut replies = session.step(case.items(step), logits.clone()).await?;
                replies.sort_by_key(|r| r.index);
                results.push(case.kept_all(&names(&step["handles"]), replies.into_iter().map(|r| out_of!(r)).collect()));
            }
            session.close();
            Ok(repeated(results))
        }
        "verify" => {
            let (logits, _) = asked(step);
            let r = c.forward_verify(&ids(&step["tokens"]), &case.handle(step), logits).await?;
            let out = Out { logits: r.logits, kv_cache: r.kv_cache, chosen: None };
            Ok(case.kept(step["handle"].as_str().unwrap(), out))
        }
        "truncate" => {
            let h = c.truncate_kv(&case.handle(step), step["length"].as_u64().unwrap() as u32).await?;
            let length = h.sequence_length;
            case.handles.insert(step["handle"].as_str().unwrap().to_string(), h);
            Ok(json!({ "length": length }))
        }
        "release" => {
            c.release_cache(&case.handle(step).cache_id).await?;
            Ok(json!({}))
        }
        "fork" => {
            let parent = step["handle"].as_str().unwrap().to_string();
            let children_names = names(&step["as"]);
            let children = c.fork_cache(&case.handle(step), children_names.len() as u32).await?;
            let lengths: Vec<u32> = children.iter().map(|h| h.sequence_length).collect();
            for (name, h) in children_names.iter().zip(children) {
                case.handles.insert(name.clone(), h);
                if let Some(next) = case.next.get(&parent).copied() {
                    case.next.insert(name.clone(), next);
                }
            }
            Ok(json!({ "lengths": lengths }))
        }
        "speculative" => {
            let name = step["handle"].as_str().unwrap();
            let (logits, _) = asked(step);
            let req = pb::SpeculativeDecodeRequest {
                token_id: case.token(name, &step["token"]),
                draft_token_ids: ids(&step["draft"]),
                kv_cache: Some(case.handle(step)),
                logits,
                ..Default::default()
            };
            let r = c.speculative_decode(req).await?;
            Ok(case.speculated(name, r))
        }
        "export" => {
            let req = pb::ExportSequenceRequest { kv_cache: Some(case.handle(step)), ..Default::default() };
            let chunks = c.export_sequence(req).await?;
            let name = step["as"].as_str().unwrap().to_string();
            case.exports.insert(name.clone(), chunks);
            if let Some(next) = case.next.get(step["handle"].as_str().unwrap()).copied() {
                case.next.insert(name, next);
            }
            Ok(json!({}))
        }
        "import" => {
            let from = step["from"].as_str().unwrap();
            let name = step["as"].as_str().unwrap().to_string();
            let h = c.import_sequence(case.exports[from].clone()).await?.kv_cache.unwrap_or_default();
            let length = h.sequence_length;
            case.handles.insert(name.clone(), h);
            if let Some(next) = case.next.get(from).copied() {
                case.next.insert(name, next);
            }
            Ok(json!({ "length": length }))
        }
        "ticket" => {
            // What is the same on every run: the secret's length (it is random), the model
            // and the seconds it stays valid rounded up (they run down).
            let req = pb::CreateImportTicketRequest {
                fingerprint: step.get("fingerprint").and_then(Value::as_str).unwrap_or("").to_string(),
                ttl_s: step.get("ttl_s").and_then(Value::as_f64).unwrap_or(0.0),
                ..Default::default()
            };
            let t = c.create_import_ticket(req).await?;
            if let Some(name) = step.get("as").and_then(Value::as_str) {
                case.tickets.insert(name.to_string(), t.ticket.clone());
            }
            Ok(json!({"ticket_chars": t.ticket.chars().count(), "model": t.model, "ttl_s": t.ttl_s.ceil() as i64}))
        }
        "push" => {
            // Into the server the runner talks to, named by the runner's own address.
            let name = step["handle"].as_str().unwrap();
            let req = pb::PushSequenceRequest {
                kv_cache: Some(case.handle(step)),
                target: addr.to_string(),
                ticket: case.tickets[step["ticket"].as_str().unwrap()].clone(),
                r#move: step["move"].as_bool().unwrap(),
                ..Default::default()
            };
            let r = c.push_sequence(req).await?;
            let h = r.kv_cache.unwrap_or_default();
            let length = h.sequence_length;
            let keep = step["as"].as_str().unwrap().to_string();
            case.handles.insert(keep.clone(), h);
            if let Some(next) = case.next.get(name).copied() {
                case.next.insert(keep, next);
            }
            Ok(json!({"length": length, "released": r.released}))
        }
        "forward" => {
            c.forward(pb::ForwardRequest::default()).await?;
            Ok(json!({}))
        }
        other => panic!("unknown call {other:?}"),
    }
}

async fn connect(addr: &str, model: &str) -> R<ExecutorClient> {
    let opts = ClientOptions { timeout: Some(Duration::from_secs(30)), model: model.to_string(), ..Default::default() };
    ExecutorClient::connect(addr, opts).await
}

async fn run_case(client: &ExecutorClient, addr: &str, case: &Value) -> Value {
    let mut state =
        Case { client, handles: HashMap::new(), next: HashMap::new(), exports: HashMap::new(), tickets: HashMap::new() };
    let mut steps = Vec::new();
    for step in case["steps"].as_array().unwrap() {
        steps.push(match run_step(&mut state, addr, step).await {
            Ok(v) => v,
            Err(e) => json!({"error": {"code": code_name(e.code), "reason": e.reason}}),
        });
    }
    json!({"case": case["name"], "steps": steps})
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut addr = None;
    let mut cases = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/vectors/cases.json").to_string();
    for pair in args.chunks(2) {
        match (pair[0].as_str(), pair.get(1)) {
            ("--addr", Some(v)) => addr = Some(v.clone()),
            ("--cases", Some(v)) => cases = v.clone(),
            _ => panic!("usage: ferrum-rust-vectors --addr HOST:PORT [--cases FILE]"),
        }
    }
    let addr = addr.expect("--addr HOST:PORT");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&cases).unwrap()).unwrap();
    let client = match connect(&addr, "").await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ferrum-rust-vectors: {e}");
            std::process::exit(1);
        }
    };
    for case in doc["cases"].as_array().unwrap() {
        println!("{}", run_case(&client, &addr, case).await);
    }
}
