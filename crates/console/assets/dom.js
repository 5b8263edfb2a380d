// DOM and formatting helpers. Server text only ever reaches the page as
// text nodes or attribute values (never as HTML).

/**
 * Makes an element. `attrs`: `class`, `dataset` (object), `style` (object or
 * string), `on<event>` (function), `text`, properties `value`/`checked`/
 * `disabled`/`hidden`, everything else as attributes (null/false: omitted).
 * Children: nodes, strings (as text), arrays, null (skipped).
 */
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  if (attrs) {
    for (const [k, v] of Object.entries(attrs)) {
      if (v == null || v === false) continue;
      if (k === 'class') el.className = v;
      else if (k === 'dataset') Object.assign(el.dataset, v);
      else if (k === 'style' && typeof v === 'object') Object.assign(el.style, v);
      else if (k === 'text') el.textContent = String(v);
      else if (k.startsWith('on') && typeof v === 'function') el.addEventListener(k.slice(2), v);
      else if (k === 'value' || k === 'checked' || k === 'disabled' || k === 'hidden') el[k] = v;
      else el.setAttribute(k, v === true ? '' : String(v));
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children) {
    if (c == null || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else if (c instanceof Node) el.appendChild(c);
    else el.appendChild(document.createTextNode(String(c)));
  }
}

/** Replaces an element's children. */
export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

/** Sets text only when it changed (keeps screen readers and selection calm). */
export function setText(el, text) {
  const s = String(text ?? '');
  if (el.textContent !== s) el.textContent = s;
}

export function setAttr(el, name, value) {
  const s = String(value);
  if (el.getAttribute(name) !== s) el.setAttribute(name, s);
}

// ---- formatting ----

/** Dollars; amounts under a cent (a sandbox's few seconds) get six
 *  decimals so they do not read as nothing. */
export function usd(n, digits) {
  if (n == null || !Number.isFinite(Number(n))) return '—';
  const v = Number(n);
  return '$' + v.toFixed(digits ?? (v !== 0 && Math.abs(v) < 0.01 ? 6 : 4));
}

export function num(n, digits = 1) {
  if (n == null || !Number.isFinite(Number(n))) return '—';
  return Number(n).toLocaleString('en-US', { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

export function int(n) {
  if (n == null || !Number.isFinite(Number(n))) return '—';
  return Math.round(Number(n)).toLocaleString('en-US');
}

/** 75 → "1m 15s", 4000 → "1h 6m". */
export function duration(seconds) {
  if (seconds == null || !Number.isFinite(Number(seconds))) return '—';
  let s = Math.max(0, Math.round(Number(seconds)));
  if (s < 60) return `${s}s`;
  const d = Math.floor(s / 86400); s -= d * 86400;
  const hh = Math.floor(s / 3600); s -= hh * 3600;
  const m = Math.floor(s / 60); s -= m * 60;
  if (d) return `${d}d ${hh}h`;
  if (hh) return `${hh}h ${m}m`;
  return `${m}m ${s}s`;
}

export function ms(n) {
  if (n == null || !Number.isFinite(Number(n))) return '—';
  const v = Number(n);
  return v < 1000 ? `${Math.round(v)} ms` : `${(v / 1000).toFixed(v < 10000 ? 2 : 1)} s`;
}

/** Seconds since the epoch of an RFC 3339 string (NaN if none). */
export function epoch(iso) {
  if (!iso) return NaN;
  return Date.parse(iso) / 1000;
}

export function dateTime(iso) {
  const t = Date.parse(iso);
  if (!Number.isFinite(t)) return '—';
  const d = new Date(t);
  return d.toLocaleString('en-GB', { year: 'numeric', month: 'short', day: '2-digit',
    hour: '2-digit', minute: '2-digit', second: '2-digit', hour12: false });
}

export function timeOfDay(iso) {
  const t = Date.parse(iso);
  if (!Number.isFinite(t)) return '—';
  return new Date(t).toLocaleTimeString('en-GB', { hour12: false });
}

export function mib(n) {
  if (n == null || !Number.isFinite(Number(n))) return '—';
  const v = Number(n);
  return v >= 10240 ? `${(v / 1024).toFixed(1)} GiB` : `${Math.round(v)} MiB`;
}

const STATE_CLASSES = new Set(['running', 'paused', 'hibernated', 'failed', 'deleted', 'held', 'active',
  'done', 'cancelled', 'pending', 'succeeded', 'timeout', 'up', 'drain', 'down', 'lost', 'creating']);

/** A state badge: text plus a colour class (the text carries the meaning). */
export function badge(state, id) {
  const s = String(state ?? 'unknown');
  return h('span', { class: `badge st-${STATE_CLASSES.has(s) ? s : 'other'}`, id }, s);
}

export function updateBadge(el, state) {
  const s = String(state ?? 'unknown');
  setText(el, s);
  const cls = `badge st-${STATE_CLASSES.has(s) ? s : 'other'}`;
  if (el.className !== cls) el.className = cls;
}

/** A horizontal bar for a fraction 0..1; the numbers are in text beside it. */
export function bar(fraction, kind = '') {
  const f = Number.isFinite(fraction) ? Math.min(1, Math.max(0, fraction)) : 0;
  return h('span', { class: `bar ${kind}`, 'aria-hidden': 'true' },
    h('span', { class: 'bar-fill', style: { width: `${(f * 100).toFixed(1)}%` } }));
}

/** `a=b, c=d` → [['a','b'],['c','d']]; bad terms reported. */
export function parsePairs(text) {
  const pairs = [];
  const bad = [];
  for (const term of String(text || '').split(',')) {
    const t = term.trim();
    if (!t) continue;
    const i = t.indexOf('=');
    if (i <= 0) bad.push(t);
    else pairs.push([t.slice(0, i).trim(), t.slice(i + 1).trim()]);
  }
  return { pairs, bad };
}

/** Metadata as k=v chips. */
export function chips(metadata) {
  const entries = Object.entries(metadata || {});
  if (!entries.length) return h('span', { class: 'muted' }, '—');
  return h('span', { class: 'chips' },
    entries.sort(([a], [b]) => a.localeCompare(b)).map(([k, v]) =>
      h('span', { class: 'chip', title: `${k}=${v}` }, h('span', { class: 'chip-k' }, k), '=', String(v))));
}

// ---- CSV ----

/** One CSV field: quoted when needed; text that a spreadsheet would run as a
 * formula (=, +, -, @, tab, CR first) gets a leading apostrophe. */
export function csvField(v) {
  if (v == null) return '';
  let s = typeof v === 'number' ? String(v) : String(v);
  if (typeof v !== 'number' && /^[=+\-@\t\r]/.test(s)) s = `'${s}`;
  if (/[",\r\n]/.test(s)) s = `"${s.replace(/"/g, '""')}"`;
  return s;
}

export function toCsv(header, rows) {
  return [header, ...rows].map(r => r.map(csvField).join(',')).join('\r\n') + '\r\n';
}

export function download(filename, text, type = 'text/csv;charset=utf-8') {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = h('a', { href: url, download: filename, hidden: true });
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}
