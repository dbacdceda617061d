// Seeded, sampled generation with the server choosing the tokens (TokenChoice on
// Prefill and Decode; the replies carry `chosen`, no logits):
//
//   node sample.js 127.0.0.1:50051 1 2 3 4 --tokens 16 --temperature 0.8 --top-k 20 --top-p 0.9 --seed 7
//
// prints {"tokens": [...], "logprobs": [...]} as JSON on stdout. The same seed gives
// the same tokens again (and the same as any client sending that TokenChoice).
"use strict";

const grpc = require("@grpc/grpc-js");
const { ModelExecutor, generateSampled } = require("./client");

const FLAGS = {
  "--tokens": "maxNewTokens", "--temperature": "temperature", "--top-k": "topK", "--top-p": "topP",
  "--min-p": "minP", "--seed": "seed", "--top-logprobs": "topLogprobs",
};

async function main(argv) {
  const target = argv[0];
  const prompt = [];
  const options = { maxNewTokens: 16 };
  for (let i = 1; i < argv.length; i += 1) {
    if (argv[i] in FLAGS) {
      options[FLAGS[argv[i]]] = Number(argv[i + 1]);
      i += 1;
    } else {
      prompt.push(Number(argv[i]));
    }
  }
  const client = new ModelExecutor(target, grpc.credentials.createInsecure());
  try {
    const out = await generateSampled(client, prompt, options);
    process.stdout.write(JSON.stringify(out) + "\n");
  } finally {
    client.close();
  }
}

main(process.argv.slice(2)).catch((err) => { console.error(err); process.exit(1); });
