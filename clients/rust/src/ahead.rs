//! Decoding ahead under Ferrum's engine: the [`Book`] of [`RemoteExecutor`]'s
//! decode-ahead runs.
//!
//! When the engine steps a sequence whose token the server chooses (greedy under the
//! engine's mask), the executor starts a decode-ahead run for it on its DecodeSession
//! (`max_new_tokens`: a bounded window, or what the request has left when the engine
//! says so), answers the step with the run's first token, and answers the sequence's
//! following steps from the tokens the run has streamed meanwhile, as long as each step
//! is the one the run predicted: the engine's input token is the run's last choice, at
//! the position after it, under the same token choice. The server runs its forwards
//! while the engine does its own work, and a step costs no round trip.
//!
//! The server's sequence then runs ahead of the engine's. Whatever else happens to the
//! sequence (a step the run did not predict, a non-greedy step, a prefill, a truncate,
//! a verify) first settles it ([`Book::detach`] and the executor's `settle`): the run,
//! if it still goes (for this sequence or for others), is stopped and read to its end,
//! and the tokens the engine never took are cut off (TruncateKv), so the server holds
//! exactly what the engine holds. A run that failed was undone by the server for every
//! sequence it covered, those it had already ended included (each is back where the
//! run found it): the tokens the engine did take are appended again (ForwardVerify)
//! before anything else. Waiting for the whole run's outcome is what makes that safe:
//! a sequence settled while its run could still fail would be undone after the
//! settle. A release only waits for its own sequence's end ([`Book::forget`]).
//!
//! [`RemoteExecutor`]: crate::executor::RemoteExecutor

use crate::error::ExecutorError;
use crate::executor::Lease;
use crate::pb;
use crate::session::{ahead_results, SharedSession, StepReplies};
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Most tokens one run decodes for a sequence: how far the server may get ahead of the
/// engine, so what a stop can waste (a run stops after its current forward, but the
/// tokens streamed before it are cut off again).
pub const WINDOW: u32 = 64;

/// Most runs going at once on the executor's session. A session reads no request while
/// 8 of its steps have replies outstanding (the server's MAX_PENDING_STEPS, in
/// server/rpc/session.py), and a run is such a step until it ends: two seats stay for a
/// plain step and a stop message.
pub const MAX_RUNS: usize = 6;

/// How long, after the server refused a run for want of decode-ahead seats, runs start
/// only within the bound that refusal set (see [`Book::refused`]).
const REFUSED_FOR: Duration = Duration::from_secs(1);

/// One sequence decoding ahead.
pub(crate) struct SeqAhead {
    pub lease: Weak<Lease>,
    /// The run (this book's id) that decodes it.
    run: u64,
    /// Its length when the run started, the run's first token, and the token choice
    /// every one of its tokens was made under.
    pub base_len: usize,
    pub start: u32,
    /// Its handle when the run started, and the run's stream (its ledger holds the run
    /// until a later request names the sequence).
    pub base: pb::KvCacheHandle,
    pub session: Weak<SharedSession>,
    choice: pb::TokenChoice,
    /// Every token the run chose for it, in order, and how many the engine took.
    pub tokens: Vec<u32>,
    pub taken: usize,
    /// Its last reply's handle (covering every token in `tokens`, the last one not in
    /// the KV), once the run ended it.
    pub end: Option<pb::KvCacheHandle>,
    /// The run's error: the server undid the run, the sequence is at `base_len`.
    pub failed: Option<ExecutorError>,
}

impl SeqAhead {
    /// The sequence's length as the engine knows it.
    pub fn engine_len(&self) -> usize {
        self.base_len + self.taken
    }

    /// The tokens the engine took, as inputs: appended to `base` they give the engine's
    /// sequence (the run's first input, then each taken token but the last).
    pub fn taken_inputs(&self) -> Vec<u32> {
        let mut tokens = Vec::with_capacity(self.taken);
        if self.taken > 0 {
            tokens.push(self.start);
            tokens.extend_from_slice(&self.tokens[..self.taken - 1]);
        }
        tokens
    }

    fn open(&self) -> bool {
        self.end.is_none() && self.failed.is_none()
    }
}

/// Forwards the server answers in one response for a caller whose tokens nobody watches
/// as they come (`RemoteExecutor::with_ahead_batch`; the Python client's unwatched runs
/// ask for 16): each response costs the server a write and this process a wake-up, on
/// the cores the forwards need when both share a host. The executor's default is 1, a
/// response a forward: an engine streaming to users hands each token on as it is chosen.
pub const UNWATCHED_FORWARDS_PER_RESPONSE: u32 = 8;

struct Run {
    session: Arc<SharedSession>,
    replies: StepReplies,
    /// Each item's sequence (its server cache_id), by index.
    seqs: Vec<String>,
    open: usize,
    stopping: bool,
}

/// The executor's runs and the sequences they decode, by server cache_id.
#[derive(Default)]
pub(crate) struct Book {
    seqs: HashMap<String, SeqAhead>,
    runs: HashMap<u64, Run>,
    next_run: u64,
    /// After a refusal: how many seats runs may hold, until when.
    refused: Option<(usize, Instant)>,
}

impl Book {
    pub fn holds(&self, key: &str) -> bool {
        self.seqs.contains_key(key)
    }

    /// Runs going.
    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    /// Decode-ahead seats this executor holds on the server (sequences in running runs).
    pub fn seats(&self) -> usize {
        self.seqs.values().filter(|s| s.open()).count()
    }

    /// How many more sequences may start decoding ahead now (None: no bound known).
    pub fn room(&mut self) -> Option<usize> {
        match self.refused {
            Some((held, until)) if Instant::now() < until => Some(held.saturating_sub(self.seats())),
            _ => {
                self.refused = None;
                None
            }
        }
    }

    /// Records that the server refused runs of `asked` sequences for want of seats (its
    /// bound is not in the capabilities): for a while runs may hold the seats held now
    /// and half of those asked for, so repeated refusals home in on the bound.
    pub fn refused(&mut self, asked: usize) {
        self.refused = Some((self.seats() + asked / 2, Instant::now() + REFUSED_FOR));
    }

    /// True when the engine's step of `key` (input `token` at position `pos`, chosen
    /// under `choice`) is the step the sequence's run predicted and the run has (or
    /// will send) a token for it.
    pub fn serves(&self, key: &str, token: u32, pos: usize, choice: &pb::TokenChoice) -> bool {
        let Some(s) = self.seqs.get(key) else { return false };
        if s.failed.is_some() || pos != s.engine_len() || &s.choice != choice {
            return false;
        }
        let expected = if s.taken == 0 { s.start } else { s.tokens[s.taken - 1] };
        token == expected && (s.tokens.len() > s.taken || s.end.is_none())
    }

    /// Starts one run on `session` over `items` (server cache_id, lease, the step's
    /// token, its choice): each sequence decodes up to `max_new` tokens, ending early
    /// at a token in `stop_ids`. The first token of each is this step's result.
    pub async fn start(
        &mut self,
        session: &Arc<SharedSession>,
        items: Vec<(String, Arc<Lease>, u32, pb::TokenChoice)>,
        max_new: u32,
        stop_ids: Vec<u32>,
        per_response: u32,
    ) -> Result<(), ExecutorError> {
        let request = pb::DecodeSessionRequest {
            items: items
                .iter()
                .map(|(_, lease, token, choice)| pb::DecodeItem {
                    token_id: *token,
                    kv_cache: Some(lease.handle()),
                    token_choice: Some(choice.clone()),
                })
                .collect(),
            max_new_tokens: max_new,
            stop_token_ids: stop_ids,
            forwards_per_response: per_response,
            ..Default::default()
        };
        let replies = session.send(request).await?;
        let id = self.next_run;
        self.next_run += 1;
        let mut keys = Vec::with_capacity(items.len());
        for (key, lease, token, choice) in items {
            self.seqs.insert(
                key.clone(),
                SeqAhead {
                    lease: Arc::downgrade(&lease),
                    run: id,
                    base_len: lease.len(),
                    start: token,
                    base: lease.handle(),
                    session: Arc::downgrade(session),
                    choice,
                    tokens: Vec::new(),
                    taken: 0,
                    end: None,
                    failed: None,
                },
            );
            keys.push(key);
        }
        let open = keys.len();
        self.runs.insert(id, Run { session: session.clone(), replies, seqs: keys, open, stopping: false });
        Ok(())
    }

    /// The run's token for the engine's next step of `key`, waiting for it to arrive;
    /// None when the run ended or failed without one (settle the sequence then).
    pub async fn take(&mut self, key: &str) -> Option<u32> {
        loop {
            let s = self.seqs.get_mut(key)?;
            if s.tokens.len() > s.taken {
                s.taken += 1;
                return Some(s.tokens[s.taken - 1]);
            }
            if !s.open() {
                return None;
            }
            let run = s.run;
            self.pump(run).await;
        }
    }

    /// Gives back a token `take` handed out for a step the engine never saw answered.
    pub fn untake(&mut self, key: &str) {
        if let Some(s) = self.seqs.get_mut(key) {
            s.taken = s.taken.saturating_sub(1);
        }
    }

    /// The run's error for `key`, when it failed.
    pub fn error(&self, key: &str) -> Option<ExecutorError> {
        self.seqs.get(key).and_then(|s| s.failed.clone())
    }

    /// Takes `key` out of the book once its run's outcome is known: a run still going
    /// (this sequence open, or ended while others go on) is asked to stop and read to
    /// its end, every sequence ended or the run failed. The server undoes a failed run
    /// for every sequence it covered, those it had ended included, so a sequence must
    /// not change before then: an undo after a settle would take back what the settle
    /// did (or leave the handle at a length the server no longer holds). What the
    /// server holds beyond the engine is the caller's to settle.
    pub async fn detach(&mut self, key: &str) -> Option<SeqAhead> {
        let id = self.seqs.get(key)?.run;
        self.stop(id).await;
        while self.runs.contains_key(&id) {
            self.pump(id).await;
        }
        self.seqs.remove(key)
    }

    /// Takes `key` out of the book for a release: a run still decoding the sequence is
    /// asked to stop and read up to the sequence's end (or the run's failure), so the
    /// release follows the run's last forward on it. Other sequences' runs go on: a
    /// released sequence has no state left to keep right.
    pub async fn forget(&mut self, key: &str) {
        let Some(s) = self.seqs.get(key) else { return };
        let (open, id) = (s.open(), s.run);
        if open {
            self.stop(id).await;
            while self.seqs.get(key).is_some_and(|s| s.open()) {
                self.pump(id).await;
            }
        }
        self.seqs.remove(key);
    }

    /// Puts back a sequence [`detach`](Self::detach) took out whose settle failed, so
    /// the next call on it settles it again.
    pub fn restore(&mut self, key: &str, s: SeqAhead) {
        self.seqs.insert(key.to_string(), s);
    }

    /// Asks run `id`, if it still goes, to stop (once).
    async fn stop(&mut self, id: u64) {
        if let Some(run) = self.runs.get_mut(&id) {
            if !run.stopping {
                run.stopping = true;
                // A stream that cannot take the message is broken: the next read says so.
                let _ = run.session.stop(run.replies.step_id()).await;
            }
        }
    }

    /// Reads run `id`'s next reply and files its tokens; a failed run (an error reply,
    /// or the stream lost) fails every sequence it decoded that is still in the book.
    async fn pump(&mut self, id: u64) {
        let Book { seqs, runs, .. } = self;
        let got = match runs.get_mut(&id) {
            Some(run) => run.replies.next().await,
            None => Err(ExecutorError::local(tonic::Code::Unavailable, "a decode-ahead run went missing")),
        };
        match got {
            Ok(reply) => {
                let run = runs.get_mut(&id).expect("the run just read");
                for r in ahead_results(reply) {
                    let Some(s) = run.seqs.get(r.index as usize).and_then(|k| seqs.get_mut(k)) else { continue };
                    if s.run != id || s.end.is_some() {
                        continue;
                    }
                    s.tokens.push(r.chosen.as_ref().map_or(0, |c| c.token_id));
                    if r.finish_reason != pb::FinishReason::Unspecified as i32 {
                        s.end = Some(r.kv_cache.unwrap_or_default());
                        run.open -= 1;
                    }
                }
                if run.open == 0 {
                    runs.remove(&id);
                }
            }
            Err(e) => {
                // The server undid the whole run, sequences it had ended included.
                runs.remove(&id);
                for s in seqs.values_mut().filter(|s| s.run == id) {
                    s.failed = Some(e.clone());
                }
            }
        }
    }
}
