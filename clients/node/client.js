// A Node.js client of the ferrum-rpc executor contract, from the .proto alone.
//
//   npm install
//   node client.js 127.0.0.1:50051 1 2 3 4 --tokens 16     # greedy ids, as JSON on stdout
//
// It prefills a prompt, decodes greedily (Decode), runs the same steps through
// BatchDecode and a DecodeSession, and decodes a google.rpc.ErrorInfo reason
// from a failed call. Errors come as a google.rpc.Status in the binary trailer
// "grpc-status-details-bin" (unary calls) or in DecodeSessionResponse.error
// (session steps); both decode with the protos from google-proto-files.
//
// `generateSampled(client, promptIds, {temperature, topK, topP, seed, maxNewTokens})`
// lets the server choose each token (a seeded TokenChoice; no logits on the wire);
// `sample.js` runs it from the command line:
//
//   node sample.js 127.0.0.1:50051 1 2 3 4 --tokens 16 --temperature 0.8 --top-k 20 --seed 7
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const googleProtos = require("google-proto-files");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "protos");
const GOOGLE_ROOT = googleProtos.getProtoPath("..");  // the folder holding google/...
const LOAD_OPTIONS = {
  keepCase: true,      // field names as in the .proto (snake_case)
  longs: Number,       // 64-bit fields as numbers (they stay below 2^53)
  enums: String,       // enum values by name
  defaults: true,
  oneofs: true,
  includeDirs: [PROTO_ROOT, GOOGLE_ROOT],
};

const definition = protoLoader.loadSync(
  ["ferrum_rpc/v1/executor.proto", "google/rpc/status.proto", "google/rpc/error_details.proto"],
  LOAD_OPTIONS);
const loaded = grpc.loadPackageDefinition(definition);
const ModelExecutor = loaded.ferrum.executor.v1.ModelExecutor;

// protobufjs types for decoding error details (proto-loader keeps them on the definition).
const protobuf = require("protobufjs");
const errorTypes = protobuf.loadSync(
  ["google/rpc/status.proto", "google/rpc/error_details.proto"].map((p) => path.join(GOOGLE_ROOT, p)));
const StatusType = errorTypes.lookupType("google.rpc.Status");
const ErrorInfoType = errorTypes.lookupType("google.rpc.ErrorInfo");
const ERROR_INFO_URL = "type.googleapis.com/google.rpc.ErrorInfo";

/** The ErrorInfo of a google.rpc.Status (a decoded message): {reason, domain, metadata} or null. */
function errorInfoOf(status) {
  for (const detail of status.details || []) {
    if (detail.type_url === ERROR_INFO_URL || detail.typeUrl === ERROR_INFO_URL) {
      return ErrorInfoType.decode(detail.value);
    }
  }
  return null;
}

/** The error table's reason of a failed unary call (grpc-js ServiceError), or null. */
function reasonOf(serviceError) {
  const raw = serviceError.metadata && serviceError.metadata.get("grpc-status-details-bin")[0];
  if (!raw) return null;
  const info = errorInfoOf(StatusType.decode(raw));
  return info ? info.reason : null;
}

function unary(client, method, request) {
  return new Promise((resolve, reject) => client[method](request, (err, reply) => (err ? reject(err) : resolve(reply))));
}

function serverStream(client, method, request) {
  return new Promise((resolve, reject) => {
    const replies = [];
    const call = client[method](request);
    call.on("data", (r) => replies.push(r));
    call.on("error", reject);
    call.on("end", () => resolve(replies));
  });
}

const ARGMAX = { kind: "LOGITS_KIND_ARGMAX" };
const argmaxOf = (logits) => logits.token_ids[0];

/** Greedy generation with Prefill + Decode; releases the sequence. */
async function greedyDecode(client, prompt, tokens) {
  const first = await unary(client, "Prefill", { token_ids: prompt, logits: ARGMAX });
  let handle = first.kv_cache;
  const out = [argmaxOf(first.logits)];
  while (out.length < tokens) {
    const step = await unary(client, "Decode", { token_id: out[out.length - 1], kv_cache: handle, logits: ARGMAX });
    handle = step.kv_cache;
    out.push(argmaxOf(step.logits));
  }
  await unary(client, "ReleaseCache", { cache_id: handle.cache_id });
  return out;
}

/** The same generation for two copies of the prompt through BatchDecode (one message per step). */
async function greedyBatch(client, prompt, tokens) {
  const firsts = await Promise.all([0, 1].map(() => unary(client, "Prefill", { token_ids: prompt, logits: ARGMAX })));
  let handles = firsts.map((f) => f.kv_cache);
  const outs = firsts.map((f) => [argmaxOf(f.logits)]);
  while (outs[0].length < tokens) {
    const items = handles.map((h, i) => ({ token_id: outs[i][outs[i].length - 1], kv_cache: h }));
    const [reply] = await serverStream(client, "BatchDecode", { items, logits: ARGMAX, single_reply: true });
    reply.results.forEach((r) => { handles[r.index] = r.kv_cache; outs[r.index].push(argmaxOf(r.logits)); });
  }
  for (const h of handles) await unary(client, "ReleaseCache", { cache_id: h.cache_id });
  return outs;
}

/** The same generation through one DecodeSession stream; the last step is sent with a
 * stale length on purpose, and its error reason decoded from DecodeSessionResponse.error. */
function greedySession(client, prompt, tokens) {
  return unary(client, "Prefill", { token_ids: prompt, logits: ARGMAX }).then((first) => new Promise((resolve, reject) => {
    const call = client.DecodeSession();
    let handle = first.kv_cache;
    const out = [argmaxOf(first.logits)];
    let stepId = 1;
    let errorReason = null;
    const send = () => call.write({ step_id: stepId, items: [{ token_id: out[out.length - 1], kv_cache: handle }], logits: ARGMAX });
    call.on("data", (reply) => {
      if (reply.error) {  // the forged step: a stale length
        errorReason = (errorInfoOf(reply.error) || {}).reason || null;
        call.end();
        return;
      }
      handle = reply.kv_cache;
      out.push(argmaxOf(reply.logits));
      stepId += 1;
      if (out.length < tokens) {
        send();
      } else {  // one more step with a stale handle: the server answers it with an error, the stream goes on
        call.write({ step_id: stepId, items: [{ token_id: 1, kv_cache: { ...handle, sequence_length: 1 } }], logits: ARGMAX });
      }
    });
    call.on("error", reject);
    call.on("end", () => unary(client, "ReleaseCache", { cache_id: handle.cache_id })
      .then(() => resolve({ tokens: out, errorReason }), reject));
    send();
  }));
}

/** A TokenChoice message from camelCase options (unset ones take the proto's defaults). */
function tokenChoiceOf({ temperature, topK, topP, minP, seed, repetitionPenalty, presencePenalty,
  frequencyPenalty, logitBias, topLogprobs, logprobsMode } = {}) {
  const choice = {};
  const set = (field, value) => { if (value !== undefined && value !== null) choice[field] = value; };
  set("temperature", temperature);
  set("top_k", topK);
  set("top_p", topP);
  set("min_p", minP);
  set("seed", seed);  // uint64: a Number (below 2^53) or a decimal string
  set("repetition_penalty", repetitionPenalty);
  set("presence_penalty", presencePenalty);
  set("frequency_penalty", frequencyPenalty);
  set("logit_bias", logitBias);  // {tokenId: bias}
  set("top_logprobs", topLogprobs);
  set("logprobs_mode", logprobsMode);  // "LOGPROBS_MODE_RAW" or "LOGPROBS_MODE_PROCESSED"
  return choice;
}

/** Sampled generation with the server choosing every token (Prefill + Decode with a
 * `token_choice`, `logits` unset: the replies carry `chosen`, no logits). With a seed,
 * the token at each position depends only on (seed, position) and the model, so the
 * same call gives the same tokens, here or from any other client. Releases the
 * sequence. Returns {tokens, logprobs} (logprobs: each chosen token's, RAW by default). */
async function generateSampled(client, promptIds, options = {}) {
  const { maxNewTokens = 16, ...rest } = options;
  const token_choice = tokenChoiceOf(rest);
  const first = await unary(client, "Prefill", { token_ids: promptIds, token_choice });
  let handle = first.kv_cache;
  const tokens = [first.chosen.token_id];
  const logprobs = [first.chosen.logprob];
  try {
    while (tokens.length < maxNewTokens) {
      const step = await unary(client, "Decode", { token_id: tokens[tokens.length - 1], kv_cache: handle, token_choice });
      handle = step.kv_cache;
      tokens.push(step.chosen.token_id);
      logprobs.push(step.chosen.logprob);
    }
  } finally {
    await unary(client, "ReleaseCache", { cache_id: handle.cache_id });
  }
  return { tokens, logprobs };
}

async function main(argv) {
  const target = argv[0];
  const rest = argv.slice(1);
  let tokens = 16;
  const prompt = [];
  for (let i = 0; i < rest.length; i += 1) {
    if (rest[i] === "--tokens") { tokens = Number(rest[i + 1]); i += 1; } else prompt.push(Number(rest[i]));
  }
  const client = new ModelExecutor(target, grpc.credentials.createInsecure());
  const info = await unary(client, "GetModelInfo", {});
  const greedy = await greedyDecode(client, prompt, tokens);
  const batch = await greedyBatch(client, prompt, tokens);
  const session = await greedySession(client, prompt, tokens);
  let unaryReason = null;
  try {
    await unary(client, "Decode", { token_id: 1, kv_cache: { cache_id: "no-such-sequence", server_instance_id: "x", sequence_length: 0 } });
  } catch (err) {
    unaryReason = reasonOf(err);
  }
  client.close();
  process.stdout.write(JSON.stringify({
    model: info.name, vocab_size: info.vocab_size, greedy, batch, session: session.tokens,
    session_error_reason: session.errorReason, unary_error_reason: unaryReason,
  }) + "\n");
}

module.exports = {
  ModelExecutor, reasonOf, errorInfoOf, greedyDecode, greedyBatch, greedySession, tokenChoiceOf, generateSampled,
};

if (require.main === module) {
  main(process.argv.slice(2)).catch((err) => { console.error(err); process.exit(1); });
}
