// run.mjs: drives the official OpenAI and Anthropic SDKs against a gateway,
// the way applications use them, and prints one JSON line of results.
//
//   node run.mjs <scenario> <base URL>
//
// The base URL is the gateway's root (http://127.0.0.1:<port>); the OpenAI
// client gets <base URL>/v1, the Anthropic client the root, as each SDK
// expects. SDK_OPTIONS (JSON, optional) adjusts a run:
//
//   apiKey      the API key (default sk-test-key)
//   headers     default headers of the client (e.g. {"X-User": "alice"})
//   maxRetries  the client's maxRetries (default: the SDK's, 2)
//   params      merged into the scenario's request parameters
//   repeat      calls made one after the other (default 1)
//
// For each call it prints what the SDK returned (for a stream, every chunk
// or event and the final message), the error it threw (status, code, type,
// param, the error object, headers), and every HTTP attempt the SDK made,
// seen through the fetch function passed to the client: when it started
// and when its headers arrived (performance.now(), in milliseconds), its
// status and headers, the request body, and the body of an error answer.
// A thrown error is a result, not a failure: the exit status is 0 unless
// the script itself breaks.

import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';

const [scenario, baseURL] = process.argv.slice(2);
if (!scenario || !baseURL) {
  console.error('usage: node run.mjs <scenario> <base URL>');
  process.exit(2);
}
const options = JSON.parse(process.env.SDK_OPTIONS || '{}');
const root = baseURL.replace(/\/+$/, '');

// attempts collects the HTTP attempts of the current call.
let attempts = [];

async function recordingFetch(url, init = {}) {
  // The SDK reads a data: URL through fetch to build a form; that is no
  // HTTP attempt.
  if (String(url).startsWith('data:')) return fetch(url, init);
  const attempt = {
    start: performance.now(),
    method: init.method || 'GET',
    url: String(url),
    requestHeaders: Object.fromEntries(new Headers(init.headers || {})),
    requestBody: typeof init.body === 'string' ? init.body : null,
  };
  attempts.push(attempt);
  let res;
  try {
    res = await fetch(url, init);
  } catch (err) {
    attempt.end = performance.now();
    attempt.fetchError = String(err && err.cause ? err.cause : err);
    throw err;
  }
  attempt.end = performance.now();
  attempt.status = res.status;
  attempt.headers = Object.fromEntries(res.headers);
  if (res.status >= 400) {
    // Errors are small; read a copy so that the SDK still reads its own.
    attempt.responseBody = await res.clone().text();
  }
  return res;
}

const clientOptions = (baseURL) => ({
  baseURL,
  apiKey: options.apiKey ?? 'sk-test-key',
  ...(options.maxRetries !== undefined && { maxRetries: options.maxRetries }),
  timeout: 120_000,
  defaultHeaders: options.headers ?? {},
  fetch: recordingFetch,
});

const openai = () => new OpenAI(clientOptions(root + '/v1'));
const anthropic = () => new Anthropic(clientOptions(root));

const params = (defaults) => ({ ...defaults, ...(options.params ?? {}) });

const chatDefaults = {
  model: 'gpt-4o-mini',
  messages: [{ role: 'user', content: 'Say hello to the gateway.' }],
};
const claudeDefaults = {
  model: 'claude-sonnet-4-5',
  max_tokens: 256,
  messages: [{ role: 'user', content: 'Say hello to the gateway.' }],
};

const batchRequests = [
  ['q1', 256, 'Say hello to the gateway.'],
  ['q2', 300, 'Name three prime numbers.'],
  ['q3', 500, 'Summarize a token bucket in one line.'],
].map(([id, maxTokens, text]) => ({
  custom_id: id,
  params: { model: claudeDefaults.model, max_tokens: maxTokens, messages: [{ role: 'user', content: text }] },
}));

// Each scenario makes one call and returns what the SDK gave back.
const scenarios = {
  'openai.chat': async () => ({ result: await openai().chat.completions.create(params(chatDefaults)) }),

  'openai.chat.stream': async () => {
    const stream = await openai().chat.completions.create(params({ ...chatDefaults, stream: true }));
    const chunks = [];
    for await (const chunk of stream) chunks.push(chunk);
    return { chunks };
  },

  'openai.responses': async () =>
    ({ result: await openai().responses.create(params({ model: 'gpt-4o-mini', input: 'Say hello to the gateway.' })) }),

  'openai.responses.stream': async () => {
    const stream = await openai().responses.create(
      params({ model: 'gpt-4o-mini', input: 'Say hello to the gateway.', stream: true }));
    const chunks = [];
    for await (const event of stream) chunks.push(event);
    return { chunks };
  },

  'openai.embeddings': async () => {
    const res = await openai().embeddings.create(
      params({ model: 'text-embedding-3-small', input: ['the first text', 'the second text'] }));
    // Float32Arrays (the SDK decodes base64) print as arrays.
    return { result: { ...res, data: res.data.map((d) => ({ ...d, embedding: Array.from(d.embedding) })) } };
  },

  'openai.models.list': async () => {
    const models = [];
    for await (const m of openai().models.list()) models.push(m);
    return { result: models };
  },

  // A video's generation: a form (model, prompt, seconds), answered with
  // the queued job.
  'openai.videos': async () =>
    ({ result: await openai().videos.create(params({ model: 'sora-2', prompt: 'A calico cat playing a piano onstage', seconds: '4' })) }),

  // A Realtime call's WebRTC offer: a form of the SDP offer and the
  // session (a bare application/sdp body when params sets session to
  // null), answered 201 with the SDP answer.
  'openai.realtime.calls': async () => {
    const body = params({
      sdp: 'v=0\r\no=- 1 2 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\n',
      session: { type: 'realtime', model: 'gpt-realtime', instructions: 'Be brief and kind.' },
    });
    if (body.session === null) delete body.session;
    const res = await openai().realtime.calls.create(body);
    return { result: { status: res.status, location: res.headers.get('location'), sdp: await res.text() } };
  },

  // Accepting an incoming call, with the Realtime API's unlimited budget.
  'openai.realtime.calls.accept': async () => {
    await openai().realtime.calls.accept('rtc_test',
      params({ type: 'realtime', instructions: 'Be brief and kind.', max_output_tokens: 'inf' }));
    return { result: 'accepted' };
  },

  // A managed agent's definition: JSON, runs no model.
  'anthropic.agents.create': async () => ({
    result: await anthropic().beta.agents.create(params({ name: 'support', model: 'claude-sonnet-4-5', system: 'Be brief and kind.' })),
  }),

  // Running a deployment now: a POST without a body that starts the
  // agent's session.
  'anthropic.deployments.run': async () => ({ result: await anthropic().beta.deployments.run('depl_test') }),

  // A user message sent to an agent session: JSON, answered with the
  // events sent; the session runs it later.
  'anthropic.sessions.events.send': async () => ({
    result: await anthropic().beta.sessions.events.send('sesn_test', params({
      events: [{ type: 'user.message', content: [{ type: 'text', text: 'Say hello to the gateway.' }] }],
    })),
  }),

  'anthropic.messages': async () => ({ result: await anthropic().messages.create(params(claudeDefaults)) }),

  // A Message Batch of three Messages requests (beta: the same through
  // beta.messages.batches), answered with the batch in processing: its
  // requests run later.
  'anthropic.batches.create': async () =>
    ({ result: await anthropic().messages.batches.create(params({ requests: batchRequests })) }),
  'anthropic.beta.batches.create': async () =>
    ({ result: await anthropic().beta.messages.batches.create(params({ requests: batchRequests })) }),

  'anthropic.countTokens': async () => ({
    result: await anthropic().messages.countTokens(params({ model: claudeDefaults.model, messages: claudeDefaults.messages })),
  }),

  'anthropic.stream': async () => {
    const stream = anthropic().messages.stream(params(claudeDefaults));
    const chunks = [];
    for await (const event of stream) chunks.push(event);
    return { chunks, result: await stream.finalMessage() };
  },
};

function describeError(err) {
  const out = {
    name: err?.name,
    class: err?.constructor?.name,
    message: String(err?.message ?? err),
    isRateLimitError: err instanceof OpenAI.RateLimitError || err instanceof Anthropic.RateLimitError,
    isAPIError: err instanceof OpenAI.APIError || err instanceof Anthropic.APIError,
  };
  for (const k of ['status', 'code', 'type', 'param', 'error', 'requestID']) {
    if (err && err[k] !== undefined) out[k] = err[k];
  }
  if (err?.headers) out.headers = Object.fromEntries(err.headers);
  return out;
}

const run = scenarios[scenario];
if (!run) {
  console.error(`unknown scenario ${scenario}; known: ${Object.keys(scenarios).join(', ')}`);
  process.exit(2);
}
const calls = [];
for (let i = 0; i < (options.repeat ?? 1); i++) {
  attempts = [];
  const call = {};
  try {
    Object.assign(call, await run());
  } catch (err) {
    call.error = describeError(err);
  }
  call.attempts = attempts;
  calls.push(call);
}
process.stdout.write(JSON.stringify({ scenario, calls }) + '\n');
