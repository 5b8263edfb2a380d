// The API client: bearer token from sessionStorage, JSON in and out, the
// server's `{"error"}` message on failures.

const TOKEN_KEY = 'shoal.token';

export function getToken() {
  try { return sessionStorage.getItem(TOKEN_KEY); } catch { return null; }
}

export function setToken(token) {
  sessionStorage.setItem(TOKEN_KEY, token);
}

export function clearToken() {
  try { sessionStorage.removeItem(TOKEN_KEY); } catch { /* storage off */ }
}

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.name = 'ApiError';
    this.status = status;
    this.body = body;
  }
}

let unauthorizedHandler = null;

/** Called with the server's message when any request answers 401. */
export function onUnauthorized(fn) {
  unauthorizedHandler = fn;
}

/**
 * `api('/v1/sandboxes', {method, body, signal, text, token})`.
 * Resolves to the parsed JSON (or text with `text: true`, null for 204).
 * Rejects with ApiError (status 0 for network failures); AbortError passes
 * through unchanged.
 */
export async function api(path, opts = {}) {
  const token = opts.token ?? getToken();
  const headers = { Accept: opts.text ? 'text/plain' : 'application/json' };
  if (token) headers.Authorization = `Bearer ${token}`;
  let body;
  if (opts.body !== undefined) {
    headers['Content-Type'] = 'application/json';
    body = JSON.stringify(opts.body);
  }
  let res;
  try {
    res = await fetch(path, {
      method: opts.method || 'GET',
      headers,
      body,
      signal: opts.signal,
      cache: 'no-store',
      credentials: 'omit',
    });
  } catch (e) {
    if (e.name === 'AbortError') throw e;
    throw new ApiError(0, `Network error: cannot reach the server (${e.message})`);
  }
  if (!res.ok) {
    let message = `${res.status} ${res.statusText || 'error'}`;
    let parsed = null;
    try {
      const raw = await res.text();
      try {
        parsed = JSON.parse(raw);
        if (parsed && typeof parsed.error === 'string' && parsed.error) message = parsed.error;
      } catch {
        if (raw && raw.length < 300) message = raw.trim() || message;
      }
    } catch { /* body unreadable */ }
    const err = new ApiError(res.status, message, parsed);
    if (res.status === 401 && !opts.noAuthHandler && unauthorizedHandler) unauthorizedHandler(message);
    throw err;
  }
  if (res.status === 204) return null;
  if (opts.text) return res.text();
  const ct = res.headers.get('content-type') || '';
  if (!ct.includes('json')) {
    const t = await res.text();
    try { return JSON.parse(t); } catch { return t; }
  }
  return res.json();
}

/** Query string from an object; arrays repeat the key; null/'' skipped. */
export function qs(params) {
  const u = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v == null || v === '') continue;
    if (Array.isArray(v)) v.forEach(x => u.append(k, x));
    else u.append(k, String(v));
  }
  const s = u.toString();
  return s ? `?${s}` : '';
}

export const enc = encodeURIComponent;
