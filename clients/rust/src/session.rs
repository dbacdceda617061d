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

/// One DecodeSession stream that several steps use at once: decode-ahead runs of some
/// sequences stream on while plain steps of others come and go. A reader task takes
/// every reply off the stream and hands it to its step's queue by `step_id`; a step's
/// queue is registered before its request is sent, so no reply can miss it. When the
/// stream itself fails (the server gone, the call cancelled), every open step's queue
/// gets that error and the session is broken: open a new one. Dropping the session
/// cancels the stream (the server then undoes each sequence's unconfirmed step).
pub struct SharedSession {
    tx: mpsc::Sender<pb::DecodeSessionRequest>,
    routes: std::sync::Arc<std::sync::Mutex<Routes>>,
    next_step: std::sync::atomic::AtomicU64,
    model: String,
    reader: tokio::task::JoinHandle<()>,
}

type Route = mpsc::UnboundedSender<Result<pb::DecodeSessionResponse>>;

#[derive(Default)]
struct Routes {
    open: std::collections::HashMap<u64, Route>,
    /// Why the stream ended, once it did.
    broken: Option<ExecutorError>,
}

/// The replies of one step of a [`SharedSession`], in order; its route goes with it.
pub struct StepReplies {
    step_id: u64,
    rx: mpsc::UnboundedReceiver<Result<pb::DecodeSessionResponse>>,
    routes: std::sync::Arc<std::sync::Mutex<Routes>>,
}

impl StepReplies {
    /// The step's id (what a stop message names).
    pub fn step_id(&self) -> u64 {
        self.step_id
    }

    /// The step's next reply; an `error` reply comes back as that error (the step
    /// failed on its own), a lost stream as the stream's error.
    pub async fn next(&mut self) -> Result<pb::DecodeSessionResponse> {
        match self.rx.recv().await {
            Some(Ok(reply)) => match &reply.error {
                Some(err) => Err(ExecutorError::from_rpc_status(err)),
                None => Ok(reply),
            },
            Some(Err(e)) => Err(e),
            None => Err(lost("with replies outstanding")),
        }
    }
}

impl Drop for StepReplies {
    fn drop(&mut self) {
        self.routes.lock().unwrap().open.remove(&self.step_id);
    }
}

impl Drop for SharedSession {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl SharedSession {
    pub(crate) fn open(client: &ExecutorClient) -> Self {
        let (tx, rx) = mpsc::channel(64);
        let req = client.request(ReceiverStream::new(rx));
        let mut stub = client.raw();
        let routes = std::sync::Arc::new(std::sync::Mutex::new(Routes::default()));
        let table = routes.clone();
        // The call is awaited here, after the first request went out: a server may send
        // its response headers only with its first reply.
        let reader = tokio::spawn(async move {
            let why = match stub.decode_session(req).await {
                Err(status) => ExecutorError::from(status),
                Ok(response) => {
                    let mut stream = response.into_inner();
                    loop {
                        match stream.message().await {
                            Ok(Some(reply)) => {
                                let route = table.lock().unwrap().open.get(&reply.step_id).cloned();
                                if let Some(route) = route {
                                    let _ = route.send(Ok(reply));
                                }
                            }
                            Ok(None) => break lost("with replies outstanding"),
                            Err(status) => break ExecutorError::from(status),
                        }
                    }
                }
            };
            let mut routes = table.lock().unwrap();
            for (_, route) in routes.open.drain() {
                let _ = route.send(Err(why.clone()));
            }
            routes.broken = Some(why);
        });
        SharedSession {
            tx,
            routes,
            next_step: std::sync::atomic::AtomicU64::new(1),
            model: client.model().to_string(),
            reader,
        }
    }

    /// True once the stream itself failed: every later step fails too.
    pub fn is_broken(&self) -> bool {
        self.routes.lock().unwrap().broken.is_some() || self.tx.is_closed()
    }

    /// Sends `request` as a new step (its step_id and model set here); its replies.
    pub async fn send(&self, mut request: pb::DecodeSessionRequest) -> Result<StepReplies> {
        let step_id = self.next_step.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        request.step_id = step_id;
        request.model = self.model.clone();
        let (route, rx) = mpsc::unbounded_channel();
        {
            let mut routes = self.routes.lock().unwrap();
            if let Some(why) = &routes.broken {
                return Err(why.clone());
            }
            routes.open.insert(step_id, route);
        }
        let replies = StepReplies { step_id, rx, routes: self.routes.clone() };
        self.tx.send(request).await.map_err(|_| lost("before the request was sent"))?;
        Ok(replies)
    }

    /// Asks the server to end decode-ahead step `step_id` after its current forward.
    pub async fn stop(&self, step_id: u64) -> Result<()> {
        let message = pb::DecodeSessionRequest { step_id, stop: true, ..Default::default() };
        self.tx.send(message).await.map_err(|_| lost("before the request was sent"))
    }

    /// One plain decode step over `items`; one result per item, in order.
    pub async fn step(
        &self,
        items: Vec<pb::DecodeItem>,
        logits: Option<pb::LogitsPolicy>,
        single_reply: bool,
    ) -> Result<Vec<pb::DecodeSessionResponse>> {
        let n = items.len();
        let mut replies =
            self.send(pb::DecodeSessionRequest { items, logits, single_reply, ..Default::default() }).await?;
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let reply = replies.next().await?;
            if reply.results.is_empty() {
                out.push(reply);
            } else {
                out.extend(reply.results);
            }
        }
        Ok(out)
    }
}

/// A decode-ahead reply's results, one per item and forward, in order.
pub fn ahead_results(reply: pb::DecodeSessionResponse) -> Vec<pb::DecodeSessionResponse> {
    if reply.results.is_empty() {
        vec![reply]
    } else {
        flatten(reply.results)
    }
}
