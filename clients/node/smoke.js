#!/usr/bin/env node
// A burstgate sidecar's calls from Node.js, built from proto/ alone: the
// .proto files loaded at run time with @grpc/proto-loader, no generated
// code. The cross-language contract test (tests/integration/test_node_client.py)
// runs it against a real server and checks what it prints.
//
//   node smoke.js HOST:PORT      (BURSTGATE_TOKEN: a sidecar token, when the
//                                 server requires one)
//
// Prints one JSON object with each call's answer (or error) and exits 0;
// any unexpected failure exits 1 with the error on stderr.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_DIR = path.resolve(__dirname, '..', '..', 'proto');

// The loader options docs/api.md recommends: int64 as JavaScript Numbers
// (every count and duration in this API is far below 2^53), enums by name,
// unset fields present with their defaults, proto field names as written.
const LOADER_OPTIONS = {
  keepCase: true,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [PROTO_DIR],
};

function load() {
  const definition = protoLoader.loadSync('burstgate/v1/admission.proto', LOADER_OPTIONS);
  return grpc.loadPackageDefinition(definition).burstgate.v1;
}

function metadata(token) {
  const md = new grpc.Metadata();
  if (token) md.set('authorization', `Bearer ${token}`);
  return md;
}

function unary(client, method, request, md) {
  const deadline = new Date(Date.now() + 5000);
  return new Promise((resolve, reject) => {
    client[method](request, md, { deadline }, (err, response) =>
      err ? reject(err) : resolve(response));
  });
}

// A call expected to fail: its status, as the contract names it.
async function failure(promise) {
  try {
    await promise;
  } catch (err) {
    return { code: grpc.status[err.code], details: err.details };
  }
  throw new Error('the call succeeded');
}

// Send batches on one AdmitStream; collect the answers, then how it ended.
function admitStream(client, batches, md) {
  return new Promise((resolve) => {
    const call = client.AdmitStream(md);
    const results = [];
    call.on('data', (r) => results.push(r));
    call.on('error', (err) =>
      resolve({ results, error: { code: grpc.status[err.code], details: err.details } }));
    call.on('end', () => resolve({ results, error: null }));
    for (const b of batches) call.write(b);
    call.end();
  });
}

async function main() {
  const target = process.argv[2];
  if (!target) throw new Error('usage: node smoke.js HOST:PORT');
  const token = process.env.BURSTGATE_TOKEN || '';
  const v1 = load();
  const client = new v1.AdmissionService(target, grpc.credentials.createInsecure());
  const md = metadata(token);
  const out = {};

  out.report = await unary(client, 'ReportLoad', {
    pool: 'gpu-a', engine_id: 'vllm-0', batch_tokens: 2048, max_batch_tokens: 8192,
    queue_depth: 0, queue_capacity: 0, gpu_utilization: 0.5,
    requests_running: 12, max_num_seqs: 256, kv_cache_usage: 0.25,
    // kv_cache_miss_rate left unset: not measured
  }, md);

  out.admit = await unary(client, 'Admit', {
    tenant_id: 'acme', request_id: 'node-1', lane: 'standard',
    prompt_tokens: 900, max_tokens: 256, model: 'llama', pool: 'gpu-a',
  }, md);
  // int64 read as Numbers: arithmetic works (with longs: String this would
  // be string concatenation).
  out.bucket_plus_one = out.admit.remaining.bucket_tokens + 1;
  out.types = {
    bucket_tokens: typeof out.admit.remaining.bucket_tokens,
    reservation_id: typeof out.admit.reservation_id,
    decision: typeof out.admit.decision,
  };

  // The same (tenant_id, request_id) with other sizes: the original answer.
  out.again = await unary(client, 'Admit', {
    tenant_id: 'acme', request_id: 'node-1', prompt_tokens: 5, max_tokens: 5, pool: 'gpu-a',
  }, md);

  out.refused = await unary(client, 'Admit', {
    tenant_id: 'small', request_id: 'node-2', prompt_tokens: 500, max_tokens: 0, pool: 'gpu-a',
  }, md);

  out.complete = await unary(client, 'Complete', {
    tenant_id: 'acme', request_id: 'node-1', reservation_id: out.admit.reservation_id,
    prompt_tokens: 900, generated_tokens: 120, kv_cache_miss_rate: 0.2,
    kv_cache_miss_rate_reported: true,
  }, md);

  out.stream = await admitStream(client, [{
    batch_id: 7,
    tenant_id: ['acme', 'acme', 'nobody'],
    request_id: ['b-0', 'b-1', 'b-2'],
    lane: ['batch'],
    prompt_tokens: [10, 20, 30],
    max_tokens: [5, 5, 5],
    pool: 'gpu-a',
  }], md);

  // Errors: a bad field (the details start with its name), a bad batch
  // entry (prefixed with the batch id), and no credentials.
  out.bad_admit = await failure(unary(client, 'Admit', {
    tenant_id: 'acme', request_id: 'node-3', prompt_tokens: -10, max_tokens: 1,
  }, md));
  out.bad_stream = await admitStream(client, [{
    batch_id: 9, tenant_id: ['acme', 'acme'], request_id: ['c-0', 'c-1'],
    prompt_tokens: [1, -1], max_tokens: [1, 1],
  }], md);
  out.no_credentials = await failure(unary(client, 'Admit', {
    tenant_id: 'acme', request_id: 'node-4', prompt_tokens: 1, max_tokens: 1,
  }, metadata('')));

  client.close();
  process.stdout.write(JSON.stringify(out, null, 2) + '\n');
}

main().catch((err) => {
  process.stderr.write(`${err.stack || err}\n`);
  process.exit(1);
});
