//! [`DecodeSession`]: one DecodeSession stream, driven a step at a time. A step is one
//! decode over some sequences ([`DecodeSession::step`]) or a decode-ahead run, where the
//! server chooses and streams tokens on its own ([`DecodeSession::decode_ahead`]).
//!
//! Steps are answered in the order this type sends them because it waits for each
//! step's replies before sending the next; a failed step answers with one `error` reply
//! (an [`ExecutorError`]) and the stream goes on. Dropping the session cancels the
//! stream, which undoes any unconfirmed step on the server.

use crate::client::ExecutorClient;
use crate::error::{ExecutorError, Result};
use crate::pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

/// An open DecodeSession stream.
pub struct DecodeSession {
    tx: mpsc::Sender<pb::DecodeSessionRequest>,
    rx: Replies,
    next_step: u64,
    model: String,
    /// The stream itself failed (not a step): no later step can go through.
    broken: bool,
}

/// One token a decode-ahead run emitted.
#[derive(Debug, Clone)]
pub struct AheadToken {
    /// Position of the item in the run's items.
    pub index: u32,
    /// The server's choice.
    pub chosen: pb::ChosenToken,
    /// On an item's last token: its handle (covering the emitted tokens, the last one
    /// not yet in the KV) and why it ended.
    pub end: Option<(pb::KvCacheHandle, pb::FinishReason)>,
}

fn lost(what: &str) -> ExecutorError {
    ExecutorError::local(tonic::Code::Unavailable, format!("DecodeSession ended {what}"))
}

/// The reply stream: the call is started at once, but a server may send its response
/// headers only with its first reply, so the call is awaited on the first read, after
/// the first step went out.
enum Replies {
    Opening(tokio::task::JoinHandle<std::result::Result<tonic::Response<Streaming<pb::DecodeSessionResponse>>, tonic::Status>>),
    Open(Streaming<pb::DecodeSessionResponse>),
}

impl Drop for DecodeSession {
    fn drop(&mut self) {
        if let Replies::Opening(task) = &self.rx {
            task.abort();
        }
    }
}

impl DecodeSession {
    pub(crate) async fn open(client: &ExecutorClient) -> Result<Self> {
        let (tx, rx) = mpsc::channel(16);
        let req = client.request(ReceiverStream::new(rx));
        let mut stub = client.raw();
        let call = tokio::spawn(async move { stub.decode_session(req).await });
        Ok(DecodeSession {
            tx,
            rx: Replies::Opening(call),
            next_step: 1,
            model: client.model().to_string(),
            broken: false,
        })
    }

    async fn send(&mut self, message: pb::DecodeSessionRequest) -> Result<()> {
        let sent = self.tx.send(message).await.map_err(|_| lost("before the request was sent"));
        self.broken |= sent.is_err();
        sent
    }

    async fn next(&mut self) -> Result<pb::DecodeSessionResponse> {
        let got = self.read().await;
        self.broken |= got.is_err();
        got
    }

    async fn read(&mut self) -> Result<pb::DecodeSessionResponse> {
        if let Replies::Opening(task) = &mut self.rx {
            let opened = task.await.map_err(|_| lost("before it opened"))??;
            self.rx = Replies::Open(opened.into_inner());
        }
        let Replies::Open(stream) = &mut self.rx else { unreachable!() };
        match stream.message().await? {
            Some(m) => Ok(m),
            None => Err(lost("with replies outstanding")),
        }
    }

    /// True once the stream itself failed (the server gone, the call cancelled): every
    /// later step fails too, so open a new session. A step that failed on its own
    /// (its one `error` reply) leaves the session usable.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// One decode step over `items` (distinct sequences); one result per item, in order.
    pub async fn step(
        &mut self,
        items: Vec<pb::DecodeItem>,
        logits: Option<pb::LogitsPolicy>,
    ) -> Result<Vec<pb::DecodeSessionResponse>> {
        self.step_with(items, logits, false).await
    }

    /// As [`step`](Self::step); with `single_reply` the server answers the step in one
    /// message holding every item's result (the same results, one message's cost).
    pub async fn step_with(
        &mut self,
        items: Vec<pb::DecodeItem>,
        logits: Option<pb::LogitsPolicy>,
        single_reply: bool,
    ) -> Result<Vec<pb::DecodeSessionResponse>> {
        let step_id = self.next_step;
        self.next_step += 1;
        let n = items.len();
        self.send(pb::DecodeSessionRequest {
            step_id,
            model: self.model.clone(),
            items,
            logits,
            single_reply,
            ..Default::default()
        })
        .await?;
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let reply = self.next().await?;
            if let Some(err) = &reply.error {
                return Err(ExecutorError::from_rpc_status(err));
            }
            if reply.results.is_empty() {
                out.push(reply);
            } else {
                out.extend(reply.results);
            }
        }
        Ok(out)
    }

    /// Starts a decode-ahead run: the server appends each item's token, chooses the next
    /// one with the item's token_choice, and streams the choices until `max_new_tokens`,
    /// a stop id or the sequence limit. Read it with [`AheadRun::next`] until it returns
    /// None.
    pub async fn decode_ahead(
        &mut self,
        items: Vec<pb::DecodeItem>,
        max_new_tokens: u32,
        stop_token_ids: Vec<u32>,
    ) -> Result<AheadRun<'_>> {
        let step_id = self.next_step;
        self.next_step += 1;
        let open = items.len();
        self.send(pb::DecodeSessionRequest {
            step_id,
            model: self.model.clone(),
            items,
            max_new_tokens,
            stop_token_ids,
            ..Default::default()
        })
        .await?;
        Ok(AheadRun { session: self, step_id, open, pending: Default::default() })
    }

    /// Closes the sending side; the server ends the stream once its steps finish.
    pub fn close(self) {}
}

/// A running decode-ahead step.
pub struct AheadRun<'a> {
    session: &'a mut DecodeSession,
    step_id: u64,
    open: usize,
    pending: std::collections::VecDeque<pb::DecodeSessionResponse>,
}

impl AheadRun<'_> {
    /// The next emitted token, or None once every item ended.
    pub async fn next(&mut self) -> Result<Option<AheadToken>> {
        loop {
            if let Some(r) = self.pending.pop_front() {
                let finish = pb::FinishReason::try_from(r.finish_reason).unwrap_or(pb::FinishReason::Unspecified);
                let end = match (finish, r.kv_cache) {
                    (pb::FinishReason::Unspecified, _) => None,
                    (f, Some(h)) => Some((h, f)),
                    (f, None) => Some((pb::KvCacheHandle::default(), f)),
                };
                if end.is_some() {
                    self.open -= 1;
                }
                let chosen = r.chosen.unwrap_or_default();
                return Ok(Some(AheadToken { index: r.index, chosen, end }));
            }
            if self.open == 0 {
                return Ok(None);
            }
            let reply = self.session.next().await?;
            if let Some(err) = &reply.error {
                self.open = 0;
                return Err(ExecutorError::from_rpc_status(err));
            }
            if reply.results.is_empty() {
                self.pending.push_back(reply);
            } else {
                self.pending.extend(flatten(reply.results));
            }
        }
    }

    /// Asks the server to end the run after its current forward (every open item's
    /// last reply then says STOPPED); keep reading with `next`.
    pub async fn stop(&mut self) -> Result<()> {
        let step_id = self.step_id;
        self.session.send(pb::DecodeSessionRequest { step_id, stop: true, ..Default::default() }).await
    }
}

/// Batched replies (several items per forward, several forwards per reply) in order.
fn flatten(results: Vec<pb::DecodeSessionResponse>) -> Vec<pb::DecodeSessionResponse> {
    let mut out = Vec::new();
    for r in results {
        if r.results.is_empty() {
            out.push(r);
        } else {
            out.extend(flatten(r.results));
        }
    }
    out
}
