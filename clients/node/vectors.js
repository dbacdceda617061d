// The Node.js client's runner of the shared test vectors (tests/vectors/cases.json):
//
//   node vectors.js --addr 127.0.0.1:50051 [--cases ../../tests/vectors/cases.json]
//
// Runs every case's steps through the generated stub (client.js) and prints one JSON
// line per case, {"case": NAME, "steps": [RESULT, ...]}, in the format every client's
// runner prints (tests/vectors/README.md); tests/contract/test_vectors.py compares them
// with the cases' `expect`. A call this runner does not know fails its case.
"use strict";

const fs = require("fs");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const { ModelExecutor, reasonOf, errorInfoOf } = require("./client");

const CODE_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([name, code]) => [code, name]));
const POLICIES = {
  argmax: { kind: "LOGITS_KIND_ARGMAX" },
  argmax_all: { kind: "LOGITS_KIND_ARGMAX", all_positions: true },
  full: { kind: "LOGITS_KIND_FULL", dtype: "DTYPE_FLOAT32" },
  full_all: { kind: "LOGITS_KIND_FULL", dtype: "DTYPE_FLOAT32", all_positions: true },
};

/** A failed call's result: the gRPC code's name and the error table's reason (or null). */
class CallError extends Error {
  constructor(code, reason, message) {
    super(message);
    this.code = code;
    this.reason = reason;
  }
}

function unary(client, method, request) {
  return new Promise((resolve, reject) => client[method](request, { deadline: Date.now() + 30000 }, (err, reply) => {
    if (err) reject(new CallError(CODE_NAMES[err.code], reasonOf(err), err.details));
    else resolve(reply);
  }));
}

/** A client-streaming call: writes each message of requests, then the one reply. */
function clientStream(client, method, requests) {
  return new Promise((resolve, reject) => {
    const call = client[method]({ deadline: Date.now() + 30000 }, (err, reply) => {
      if (err) reject(new CallError(CODE_NAMES[err.code], reasonOf(err), err.details));
      else resolve(reply);
    });
    requests.forEach((r) => call.write(r));
    call.end();
  });
}

function serverStream(client, method, request) {
  return new Promise((resolve, reject) => {
    const replies = [];
    const call = client[method](request, { deadline: Date.now() + 30000 });
    call.on("data", (r) => replies.push(r));
    call.on("error", (err) => reject(new CallError(CODE_NAMES[err.code], reasonOf(err), err.details)));
    call.on("end", () => resolve(replies));
  });
}

/** The request fields a step asks for: a logits policy or a token choice. */
function asked(step) {
  return step.choice ? { token_choice: step.choice } : { logits: POLICIES[step.logits] };
}

/** The ids an output names: one per ARGMAX row, or the chosen token. */
function outputIds(out) {
  if (out.chosen) return [out.chosen.token_id];
  if (out.logits && out.logits.kind === "LOGITS_KIND_ARGMAX") return out.logits.token_ids.map(Number);
  return [];
}

class Case {
  constructor(client, addr) {
    this.client = client;
    this.addr = addr;
    this.handles = {};
    this.next = {};
    this.exports = {};  // an export's messages by name, relayed to ImportSequence as received
    this.tickets = {};  // an import ticket's secret by name
  }

  token(name, token) {
    return token === "next" ? this.next[name] : token;
  }

  /** Stores out's handle under name; the result of an output-producing call. */
  kept(name, out) {
    this.handles[name] = out.kv_cache;
    const ids = outputIds(out);
    if (ids.length) this.next[name] = ids[ids.length - 1];
    const result = { length: out.kv_cache.sequence_length };
    if (out.logits && out.logits.kind === "LOGITS_KIND_FULL") {
      const t = out.logits.values;  // a Tensor: raw little-endian float32 bytes, (rows, vocab)
      result.logits = { shape: t.shape.map(Number), f32_hex: Buffer.from(t.data).toString("hex") };
    } else {
      result.ids = ids;
    }
    return result;
  }

  /** Stores a SpeculativeDecode round's handle under name, its next_token_id as the next
   * token; the result: length, the drafts kept, the next token, the logits row's argmax. */
  speculated(name, out) {
    this.handles[name] = out.kv_cache;
    this.next[name] = out.next_token_id;
    return {
      length: out.kv_cache.sequence_length, accepted: out.accepted_token_ids.map(Number),
      next: out.next_token_id, ids: out.logits.token_ids.map(Number),
    };
  }

  keptAll(names, outs) {
    return { items: names.map((name, i) => this.kept(name, outs[i])) };
  }

  items(step) {
    return step.handles.map((name, i) => ({ token_id: this.token(name, step.tokens[i]), kv_cache: this.handles[name] }));
  }
}

async function repeated(step, once) {
  const results = [];
  for (let i = 0; i < (step.repeat || 1); i += 1) results.push(await once());
  const last = { ...results[results.length - 1] };
  if (last.ids) last.ids = results.flatMap((r) => r.ids);
  if (last.items) {
    last.items = last.items.map((item, k) => ({ ids: results.flatMap((r) => r.items[k].ids), length: item.length }));
  }
  return last;
}

/** One DecodeSession step per call of step(); the stream stays open until close(). */
function openSession(client) {
  const call = client.DecodeSession({ deadline: Date.now() + 60000 });
  const waiting = [];
  const buffered = [];
  call.on("data", (reply) => {
    if (waiting.length) waiting.shift().resolve(reply);
    else buffered.push(reply);
  });
  call.on("error", (err) => {
    while (waiting.length) waiting.shift().reject(new CallError(CODE_NAMES[err.code], reasonOf(err), err.details));
  });
  const read = () => (buffered.length ? Promise.resolve(buffered.shift())
    : new Promise((resolve, reject) => waiting.push({ resolve, reject })));
  let stepId = 0;
  return {
    async step(items, fields) {
      stepId += 1;
      call.write({ step_id: stepId, items, ...fields });
      const outs = [];
      while (outs.length < items.length) {
        const reply = await read();
        if (reply.error) {
          const info = errorInfoOf(reply.error);
          throw new CallError(CODE_NAMES[reply.error.code], info ? info.reason : null, reply.error.message);
        }
        outs.push(reply);
      }
      return outs.sort((a, b) => a.index - b.index);
    },
    close() {
      call.end();
    },
  };
}

async function runStep(c, step) {
  const ex = c.client;
  switch (step.call) {
    case "info": {
      const info = await unary(ex, "GetModelInfo", {});
      return { vocab_size: info.vocab_size, num_layers: info.num_layers, max_sequence_length: info.max_sequence_length };
    }
    case "status":
      return { active_sequences: (await unary(ex, "GetStatus", {})).active_sequences };
    case "prefill":
      return c.kept(step.as, await unary(ex, "Prefill", { token_ids: step.tokens, model: step.model || "", ...asked(step) }));
    case "batch_prefill": {
      const replies = await serverStream(ex, "BatchPrefill", {
        items: step.prompts.map((p) => (step.choice ? { token_ids: p, token_choice: step.choice } : { token_ids: p })),
        ...(step.choice ? {} : { logits: POLICIES[step.logits] }),
      });
      return c.keptAll(step.as, replies.sort((a, b) => a.index - b.index));
    }
    case "decode":
      return repeated(step, async () => {
        const out = await unary(ex, "Decode", {
          token_id: c.token(step.handle, step.token), kv_cache: c.handles[step.handle], ...asked(step),
        });
        return c.kept(step.as || step.handle, out);
      });
    case "batch_decode":
      return repeated(step, async () => {
        const [reply] = await serverStream(ex, "BatchDecode", { items: c.items(step), ...asked(step), single_reply: true });
        return c.keptAll(step.handles, reply.results.sort((a, b) => a.index - b.index));
      });
    case "session": {
      const session = openSession(ex);
      try {
        return await repeated(step, async () => c.keptAll(step.handles, await session.step(c.items(step), asked(step))));
      } finally {
        session.close();
      }
    }
    case "verify":
      return c.kept(step.handle, await unary(ex, "ForwardVerify", {
        token_ids: step.tokens, kv_cache: c.handles[step.handle], ...asked(step),
      }));
    case "truncate": {
      const reply = await unary(ex, "TruncateKv", { kv_cache: c.handles[step.handle], new_length: step.length });
      c.handles[step.handle] = reply.kv_cache;
      return { length: reply.kv_cache.sequence_length };
    }
    case "release":
      await unary(ex, "ReleaseCache", { cache_id: c.handles[step.handle].cache_id });
      return {};
    case "fork": {
      const reply = await unary(ex, "ForkCache", { kv_cache: c.handles[step.handle], num_children: step.as.length });
      step.as.forEach((name, i) => {
        c.handles[name] = reply.children[i];
        c.next[name] = c.next[step.handle];
      });
      return { lengths: reply.children.map((h) => h.sequence_length) };
    }
    case "speculative":
      return c.speculated(step.handle, await unary(ex, "SpeculativeDecode", {
        token_id: c.token(step.handle, step.token), draft_token_ids: step.draft, kv_cache: c.handles[step.handle],
        logits: POLICIES[step.logits],
      }));
    case "export":
      c.exports[step.as] = await serverStream(ex, "ExportSequence", { kv_cache: c.handles[step.handle] });
      c.next[step.as] = c.next[step.handle];
      return {};
    case "import": {
      const reply = await clientStream(ex, "ImportSequence", c.exports[step.from]);
      c.handles[step.as] = reply.kv_cache;
      c.next[step.as] = c.next[step.from];
      return { length: reply.kv_cache.sequence_length };
    }
    case "ticket": {
      // What is the same on every run: the secret's length (it is random), the model and
      // the seconds it stays valid rounded up (they run down).
      const t = await unary(ex, "CreateImportTicket", { fingerprint: step.fingerprint || "", ttl_s: step.ttl_s || 0 });
      if (step.as) c.tickets[step.as] = t.ticket;
      return { ticket_chars: t.ticket.length, model: t.model, ttl_s: Math.ceil(t.ttl_s) };
    }
    case "push": {  // into the server the runner talks to, named by the runner's own address
      const reply = await unary(ex, "PushSequence", {
        kv_cache: c.handles[step.handle], target: c.addr, ticket: c.tickets[step.ticket], move: step.move,
      });
      c.handles[step.as] = reply.kv_cache;
      c.next[step.as] = c.next[step.handle];
      return { length: reply.kv_cache.sequence_length, released: reply.released };
    }
    case "forward":
      await unary(ex, "Forward", {});
      return {};
    default:
      throw new Error(`unknown call ${JSON.stringify(step.call)}`);
  }
}

async function runCase(client, addr, kase) {
  const c = new Case(client, addr);
  const steps = [];
  for (const step of kase.steps) {
    try {
      steps.push(await runStep(c, step));
    } catch (err) {
      if (!(err instanceof CallError)) throw err;
      steps.push({ error: { code: err.code, reason: err.reason } });
    }
  }
  return { case: kase.name, steps };
}

async function main(argv) {
  let addr = null;
  let casesFile = path.resolve(__dirname, "..", "..", "tests", "vectors", "cases.json");
  for (let i = 0; i < argv.length; i += 2) {
    if (argv[i] === "--addr") addr = argv[i + 1];
    else if (argv[i] === "--cases") casesFile = argv[i + 1];
    else throw new Error(`unknown argument ${argv[i]}`);
  }
  if (!addr) throw new Error("usage: node vectors.js --addr HOST:PORT [--cases FILE]");
  const client = new ModelExecutor(addr, grpc.credentials.createInsecure());
  try {
    for (const kase of JSON.parse(fs.readFileSync(casesFile, "utf8")).cases) {
      process.stdout.write(JSON.stringify(await runCase(client, addr, kase)) + "\n");
    }
  } finally {
    client.close();
  }
}

main(process.argv.slice(2)).catch((err) => { console.error(err); process.exit(1); });
