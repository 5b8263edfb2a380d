// #/sandboxes/<id>: one sandbox. Polled (2 s) only through routes that do
// not count as activity: the list (state), /events and /usage. Logs, ports,
// metrics and lifecycle are fetched on a click only (they touch the
// sandbox's idle timer; /metrics would wake a hibernated one, so it is never
// asked of one).

import { getToken } from '../api.js';
import { h, replace, setText, usd, num, duration, ms, epoch, chips, badge, updateBadge, dateTime, timeOfDay, mib } from '../dom.js';
import { chartFigure, createChart, setSummary, COLORS } from '../charts.js';

const POLL_MS = 2000;
const MAX_SAMPLES = 1800;

export default function mount(root, [id], ctx) {
  const enc = encodeURIComponent(id);
  const base = `/v1/sandboxes/${enc}`;

  // ---- header and facts ----
  const stateBadge = badge('…', 'sandbox-state');
  const facts = {};
  const fact = (key, label) => {
    facts[key] = h('dd', { id: `sandbox-${key}` }, '—');
    return [h('dt', null, label), facts[key]];
  };
  const notice = h('p', { class: 'muted', id: 'sandbox-notice', hidden: true });

  // ---- actions ----
  const btn = (bid, label, cls = '') => h('button', { type: 'button', id: bid, class: `btn ${cls}`, disabled: true }, label);
  const b = {
    pause: btn('action-pause', 'Pause'),
    resume: btn('action-resume', 'Resume'),
    hibernate: btn('action-hibernate', 'Hibernate'),
    wake: btn('action-wake', 'Wake'),
    snapshot: btn('action-snapshot', 'Snapshot'),
    fork: btn('action-fork', 'Fork'),
    kill: btn('action-kill', 'Kill', 'btn-danger'),
  };
  const actionResult = h('p', { id: 'action-result', class: 'muted', 'aria-live': 'polite' });

  // ---- events ----
  const events = h('ol', { id: 'events', class: 'events', 'aria-label': 'Lifecycle events, newest first' });
  const eventsNote = h('p', { class: 'muted' }, 'Loading…');

  // ---- usage charts ----
  const usageFig = chartFigure('usage-chart', 'Cumulative CPU seconds and cost of this sandbox since this page opened');
  const cpuFig = chartFigure('cpu-chart', 'CPU use of this sandbox in percent of one core since this page opened');
  const usageChart = createChart(usageFig, {
    height: 200,
    series: [
      { label: 'CPU seconds', color: COLORS.cpu, scale: 'cpu', fmt: v => `${num(v, 2)} s` },
      { label: 'Cost', color: COLORS.cost, scale: 'usd', fmt: v => usd(v, 6) },
    ],
    axes: [
      { scale: 'cpu', label: 'CPU s', fmt: v => num(v, 2), zero: false },
      { scale: 'usd', label: 'USD', side: 'right', fmt: v => (v ? `$${Number(v).toPrecision(3)}` : '$0'), zero: false },
    ],
  });
  const cpuChart = createChart(cpuFig, {
    height: 150,
    series: [{ label: 'CPU %', color: COLORS.accent, scale: '%', fmt: v => `${num(v, 1)}%`, fill: '#2457c522' }],
    axes: [{ scale: '%', label: '% of a core', fmt: v => `${num(v, 0)}%` }],
  });
  const samples = { t: [], cpu: [], cost: [], pct: [] };
  let lastChange = null; // { t, cpu } at the last change of cpu_seconds

  // ---- on-click panels ----
  const logsBtn = h('button', { type: 'button', id: 'logs-load', class: 'btn' }, 'Load logs');
  const logs = h('pre', { id: 'logs', class: 'out', tabindex: '0', 'aria-label': 'Guest console log' });
  const portsBtn = h('button', { type: 'button', id: 'ports-load', class: 'btn', disabled: true }, 'Refresh ports');
  const ports = h('div', { id: 'ports' }, h('p', { class: 'muted' }, 'Not loaded.'));
  const metricsBtn = h('button', { type: 'button', id: 'metrics-load', class: 'btn', disabled: true }, 'Sample CPU/memory');
  const lifecycleBtn = h('button', { type: 'button', id: 'lifecycle-load', class: 'btn', disabled: true }, 'Load TTL and idleness');
  const procOut = h('div', { id: 'process' });

  // ---- terminal ----
  const termOpen = h('button', { type: 'button', id: 'terminal-open', class: 'btn btn-primary', disabled: true }, 'Open terminal');
  const termClose = h('button', { type: 'button', id: 'terminal-close', class: 'btn', disabled: true }, 'Close terminal');
  const termBox = h('div', { id: 'terminal', class: 'terminal-box', dataset: { connected: 'false' },
    'aria-label': 'Terminal', role: 'region' });

  root.append(
    h('p', null, h('a', { href: '#/sandboxes' }, '← All sandboxes')),
    h('div', { class: 'page-head' },
      h('h1', null, 'Sandbox ', h('span', { class: 'mono' }, id)),
      h('span', null, 'State: ', stateBadge)),
    notice,
    h('div', { class: 'grid2' },
      h('section', { class: 'panel', 'aria-labelledby': 'h-details' },
        h('h2', { id: 'h-details' }, 'Details'),
        h('dl', { class: 'facts' },
          fact('template', 'Template'), fact('created', 'Created'), fact('boot', 'Boot'),
          fact('size', 'Size'), fact('ttl', 'Idle TTL'), fact('idle', 'Idle'), fact('snapshot', 'From snapshot'),
          fact('reason', 'Reason'), fact('metadata', 'Metadata'))),
      h('section', { class: 'panel', 'aria-labelledby': 'h-actions' },
        h('h2', { id: 'h-actions' }, 'Actions'),
        h('div', { class: 'actions' }, b.pause, b.resume, b.hibernate, b.wake, b.snapshot, b.fork, b.kill),
        actionResult,
        h('h3', null, 'Process and idleness'),
        h('p', { class: 'muted' }, 'These ask the sandbox itself, so they count as activity (a hibernated sandbox is never sampled).'),
        h('div', { class: 'actions' }, metricsBtn, lifecycleBtn),
        procOut)),
    h('div', { class: 'grid2', style: 'margin-top:1rem' },
      h('section', { class: 'panel', 'aria-labelledby': 'h-usage' },
        h('h2', { id: 'h-usage' }, 'Usage since this page opened'),
        usageFig, cpuFig),
      h('section', { class: 'panel', 'aria-labelledby': 'h-events' },
        h('h2', { id: 'h-events' }, 'Lifecycle events'), eventsNote, events)),
    h('section', { class: 'panel', style: 'margin-top:1rem', 'aria-labelledby': 'h-term' },
      h('h2', { id: 'h-term' }, 'Terminal'),
      h('div', { class: 'actions' }, termOpen, termClose,
        h('span', { class: 'muted', style: 'align-self:center' }, 'In the terminal, F6 moves focus back to these buttons.')),
      termBox),
    h('div', { class: 'grid2' },
      h('section', { class: 'panel', 'aria-labelledby': 'h-logs' },
        h('h2', { id: 'h-logs' }, 'Console log'), logsBtn, logs),
      h('section', { class: 'panel', 'aria-labelledby': 'h-ports' },
        h('h2', { id: 'h-ports' }, 'Ports'), portsBtn, ports)));

  let sandbox = null;     // the list's item, or a usage row for a gone one
  let state = null;
  let busy = false;
  let loaded = false;
  let ws = null;
  let term = null;
  let termCleanup = null;
  let lastEventsKey = '';
  let poller;

  function updateButtons() {
    const live = state && state !== 'deleted' && state !== 'not found';
    const running = state === 'running';
    b.kill.disabled = busy || !live;
    b.pause.disabled = busy || !running;
    b.resume.disabled = busy || state !== 'paused';
    b.hibernate.disabled = busy || !running;
    b.wake.disabled = busy || state !== 'hibernated';
    b.snapshot.disabled = busy || !running;
    b.fork.disabled = busy || !running;
    portsBtn.disabled = !running;
    metricsBtn.disabled = !(running || state === 'paused');
    lifecycleBtn.disabled = !live;
    const open = ws && (ws.readyState === WebSocket.OPEN || ws.readyState === WebSocket.CONNECTING);
    termOpen.disabled = !running || !!open;
    termClose.disabled = !open;
    logsBtn.disabled = !live;
  }

  function showSandbox(s, gone) {
    sandbox = s;
    state = gone ? (s ? (s.status ?? 'deleted') : 'not found') : s.status;
    updateBadge(stateBadge, state);
    stateBadge.title = s?.status_reason ? `${state}: ${s.status_reason}` : state;
    notice.hidden = !gone;
    if (gone) setText(notice, s ? 'This sandbox is no longer live; its metered usage is kept.' : 'No such sandbox for this account.');
    if (s) {
      setText(facts.template, s.template ?? '—');
      setText(facts.created, s.created_at ? dateTime(s.created_at) : '—');
      setText(facts.boot, s.boot_ms != null ? `${ms(s.boot_ms)} (${s.boot_mode ?? 'unknown'})` : (s.boot_mode ?? '—'));
      setText(facts.size, s.cpu != null ? `${s.cpu} vCPU · ${mib(s.memory_mb)}` : '—');
      setText(facts.ttl, s.ttl_seconds == null ? '—' : s.ttl_seconds === 0 ? 'none' : duration(s.ttl_seconds) + (s.persistent ? ' (persistent: hibernates)' : ''));
      setText(facts.idle, s.idle_seconds == null ? '—' : duration(s.idle_seconds));
      setText(facts.snapshot, s.from_snapshot ?? '—');
      setText(facts.reason, s.status_reason ?? '—');
      const key = JSON.stringify(s.metadata ?? {});
      if (facts.metadata.dataset.key !== key) {
        facts.metadata.dataset.key = key;
        facts.metadata.replaceChildren(chips(s.metadata));
      }
    }
    updateButtons();
  }

  function payloadSummary(p) {
    if (p == null) return '';
    if (typeof p !== 'object') return String(p);
    const parts = [];
    for (const [k, v] of Object.entries(p)) {
      const val = v != null && typeof v === 'object' ? JSON.stringify(v) : String(v);
      parts.push(`${k}=${val.length > 120 ? val.slice(0, 117) + '…' : val}`);
    }
    const s = parts.join(' · ');
    return s.length > 400 ? s.slice(0, 397) + '…' : s;
  }

  function showEvents(list) {
    const sorted = [...list].sort((x, y) => (y.id ?? 0) - (x.id ?? 0) || String(y.time).localeCompare(String(x.time)));
    const key = `${sorted.length}:${sorted[0]?.id ?? ''}`;
    if (key === lastEventsKey) return;
    lastEventsKey = key;
    setText(eventsNote, sorted.length ? `${sorted.length} most recent, newest first.` : 'No events recorded.');
    replace(events, sorted.map(ev => h('li', { dataset: { type: ev.type ?? '' } },
      h('time', { datetime: ev.time ?? '', title: dateTime(ev.time) }, timeOfDay(ev.time)),
      h('span', { class: 'ev-type' }, String(ev.type ?? '').replace(/^sandbox\./, '')),
      h('span', { class: 'ev-payload' }, payloadSummary(ev.payload)))));
  }

  function addSample(row) {
    const t = Date.now() / 1000;
    const cpu = Number(row.cpu_seconds) || 0;
    const cost = Number(row.cost) || 0;
    let pct = null;
    const n = samples.t.length;
    if (!lastChange) lastChange = { t, cpu, pct: null };
    else if (cpu !== lastChange.cpu) {
      pct = Math.max(0, (cpu - lastChange.cpu) / Math.max(0.001, t - lastChange.t)) * 100;
      lastChange = { t, cpu, pct };
    } else if (n) {
      // No new meter reading: hold the last rate (0 once it stopped).
      pct = state === 'running' ? (lastChange.pct ?? null) : 0;
      if (t - lastChange.t > 30) pct = 0;
    }
    samples.t.push(t); samples.cpu.push(cpu); samples.cost.push(cost); samples.pct.push(pct);
    if (samples.t.length > MAX_SAMPLES) for (const k of Object.keys(samples)) samples[k].shift();
    usageChart.setData([samples.t, samples.cpu, samples.cost]);
    cpuChart.setData([samples.t, samples.pct]);
    const lastPct = [...samples.pct].reverse().find(v => v != null);
    setSummary(usageFig, `${samples.t.length} sample${samples.t.length === 1 ? '' : 's'} since ${timeOfDay(new Date(samples.t[0] * 1000).toISOString())}: `
      + `${num(cpu, 2)} CPU seconds and ${usd(cost, 6)} in all so far; `
      + `${num(Number(row.gib_seconds) || 0, 1)} GiB-seconds of memory.`);
    setSummary(cpuFig, lastPct == null ? 'CPU use appears after two meter readings.' : `Latest CPU use: ${num(lastPct, 1)}% of one core.`);
  }

  async function refresh() {
    const [listR, eventsR, usageR] = await Promise.allSettled([
      ctx.api('/v1/sandboxes'),
      ctx.api(`${base}/events?tail=100`),
      ctx.api(`${base}/usage`),
    ]);
    for (const r of [listR, eventsR, usageR]) {
      if (r.status === 'rejected' && (r.reason?.name === 'AbortError' || r.reason?.status === 401)) throw r.reason;
    }
    if (!ctx.alive()) return;
    if (listR.status === 'rejected') throw listR.reason;
    const arr = Array.isArray(listR.value) ? listR.value : (listR.value?.sandboxes ?? []);
    const item = arr.find(s => s.id === id);
    if (item) showSandbox(item, false);
    else if (usageR.status === 'fulfilled' && usageR.value) showSandbox(usageR.value, true);
    else {
      showSandbox(null, true);
      const why = usageR.reason;
      if (why?.status === 404) {
        const msg = why.message || `sandbox ${id} not found`;
        ctx.setStatus(/not found/i.test(msg) ? msg : `Not found: ${msg}`, 'error');
      } else if (why) ctx.error(why, 'Sandbox');
    }
    if (eventsR.status === 'fulfilled') showEvents(eventsR.value?.events ?? []);
    else if (eventsR.reason?.status === 404) setText(eventsNote, 'No event log (the sandbox is gone).');
    else ctx.error(eventsR.reason, 'Events');
    if (usageR.status === 'fulfilled' && usageR.value) addSample(usageR.value);
    if (!loaded) { loaded = true; ctx.ready(); }
    if (state === 'deleted' || (!item && usageR.status === 'rejected')) {
      if (ws) closeTerminal();
    }
  }

  // ---- actions ----
  async function act(label, fn) {
    busy = true;
    updateButtons();
    ctx.setStatus(`${label}…`);
    try {
      await fn();
    } catch (e) {
      ctx.error(e, `${label} failed`);
    } finally {
      busy = false;
      if (ctx.alive()) { updateButtons(); poller.now(); }
    }
  }

  const lifecycle = (path, label, done) => () => act(label, async () => {
    const s = await ctx.api(`${base}/${path}`, { method: 'POST' });
    if (s && s.status) showSandbox({ ...sandbox, ...s }, false);
    ctx.setStatus(`${done}: ${id} is ${s?.status ?? 'updated'}.`, 'ok');
  });
  b.pause.addEventListener('click', lifecycle('pause', 'Pausing', 'Paused'));
  b.resume.addEventListener('click', lifecycle('resume', 'Resuming', 'Resumed'));
  b.hibernate.addEventListener('click', lifecycle('hibernate', 'Hibernating', 'Hibernated'));
  b.wake.addEventListener('click', lifecycle('wake', 'Waking', 'Woken'));

  b.snapshot.addEventListener('click', () => act('Snapshotting', async () => {
    const snap = await ctx.api(`${base}/snapshots`, { method: 'POST' });
    replace(actionResult, 'New snapshot: ', h('code', { id: 'snapshot-id' }, snap?.id ?? '?'),
      snap?.size_bytes != null ? ` (${mib(snap.size_bytes / 1048576)})` : '');
    ctx.setStatus(`Snapshot ${snap?.id ?? ''} created.`, 'ok');
  }));

  b.fork.addEventListener('click', () => act('Forking', async () => {
    const res = await ctx.api(`${base}/fork`, { method: 'POST', body: { count: 1 } });
    const child = res?.children?.[0] ?? res?.sandbox?.id ?? res?.sandboxes?.[0]?.id ?? res?.id;
    replace(actionResult, 'Forked: ',
      child ? h('a', { id: 'fork-child', href: `#/sandboxes/${encodeURIComponent(child)}` }, child) : 'child id missing in the answer');
    ctx.setStatus(`Forked ${id} into ${child ?? 'a child'}.`, 'ok');
  }));

  b.kill.addEventListener('click', () => {
    if (!confirm(`Kill sandbox ${id}? Its memory and disk are deleted; this cannot be undone.`)) return;
    act('Killing', async () => {
      await ctx.api(base, { method: 'DELETE' });
      closeTerminal();
      ctx.setStatus(`Sandbox ${id} killed.`, 'ok');
      location.hash = '#/sandboxes';
    });
  });

  // ---- on-click reads ----
  logsBtn.addEventListener('click', async () => {
    logsBtn.disabled = true;
    try {
      const text = await ctx.api(`${base}/logs`, { text: true });
      setText(logs, text || '');
      if (!text) setText(logs, '(the log is empty)');
      logs.scrollTop = logs.scrollHeight;
      ctx.setStatus(`Loaded ${text.length.toLocaleString('en-US')} characters of log.`, 'ok');
    } catch (e) { ctx.error(e, 'Logs'); }
    finally { if (ctx.alive()) updateButtons(); }
  });

  portsBtn.addEventListener('click', async () => {
    portsBtn.disabled = true;
    try {
      const res = await ctx.api(`${base}/ports`);
      const list = Array.isArray(res) ? res : (res?.ports ?? []);
      if (!list.length) replace(ports, h('p', { class: 'muted' }, 'No TCP port is listening or exposed.'));
      else {
        replace(ports, h('table', { class: 'compact' },
          h('thead', null, h('tr', null,
            ['Port', 'Listening', 'Label', 'Source', 'Proxy'].map(t => h('th', { scope: 'col' }, t)))),
          h('tbody', null, list.map(p => h('tr', { dataset: { port: String(p.port) } },
            h('td', { class: 'num' }, String(p.port)),
            h('td', null, p.listening ? 'yes' : 'no'),
            h('td', null, p.label ?? '—'),
            h('td', null, p.source ?? '—'),
            h('td', null, safeLink(p.proxy_url)))))));
      }
      ctx.setStatus(`${list.length} port${list.length === 1 ? '' : 's'}.`, 'ok');
    } catch (e) { ctx.error(e, 'Ports'); }
    finally { if (ctx.alive()) updateButtons(); }
  });

  metricsBtn.addEventListener('click', async () => {
    if (state === 'hibernated' || state !== 'running' && state !== 'paused') return; // never wake it
    metricsBtn.disabled = true;
    try {
      const m = await ctx.api(`${base}/metrics`);
      replace(procOut, h('dl', { class: 'facts', id: 'metrics' },
        h('dt', null, 'Host CPU'), h('dd', null, `${num(m.host_cpu_percent, 1)}%`),
        h('dt', null, 'RSS'), h('dd', null, mib(m.host_rss_bytes / 1048576)),
        h('dt', null, 'VSZ'), h('dd', null, mib(m.host_vsz_bytes / 1048576)),
        h('dt', null, 'Threads'), h('dd', null, String(m.threads ?? '—')),
        h('dt', null, 'Uptime'), h('dd', null, duration(m.uptime_seconds)),
        h('dt', null, 'PID'), h('dd', null, String(m.pid ?? '—'))));
    } catch (e) { ctx.error(e, 'Metrics'); }
    finally { if (ctx.alive()) updateButtons(); }
  });

  lifecycleBtn.addEventListener('click', async () => {
    lifecycleBtn.disabled = true;
    try {
      const l = await ctx.api(`${base}/lifecycle`);
      replace(procOut, h('dl', { class: 'facts', id: 'lifecycle' },
        h('dt', null, 'Idle TTL'), h('dd', null, l.ttl_seconds ? duration(l.ttl_seconds) : 'none'),
        h('dt', null, 'Persistent'), h('dd', null, l.persistent ? 'yes (hibernates when idle)' : 'no (deleted when idle)'),
        h('dt', null, 'Idle'), h('dd', null, duration(l.idle_seconds)),
        h('dt', null, 'Expires'), h('dd', null, l.expires_at ? dateTime(l.expires_at) : 'never')));
    } catch (e) { ctx.error(e, 'Lifecycle'); }
    finally { if (ctx.alive()) updateButtons(); }
  });

  // ---- terminal ----
  function terminalText() {
    if (!term) return '';
    const buf = term.buffer.active;
    const lines = [];
    for (let i = 0; i < buf.length; i++) lines.push(buf.getLine(i)?.translateToString(true) ?? '');
    return lines.join('\n');
  }
  ctx.setTerminalText(terminalText);

  function closeTerminal() {
    if (ws) {
      const s = ws;
      ws = null;
      try { s.close(1000, 'closed by the user'); } catch { /* already closed */ }
    }
    termBox.dataset.connected = 'false';
    if (ctx.alive()) updateButtons();
  }

  async function openTerminal() {
    const token = getToken();
    if (!token || state !== 'running') return;
    termOpen.disabled = true;
    let mods;
    try {
      mods = await Promise.all([import('../vendor/xterm.mjs'), import('../vendor/addon-fit.mjs')]);
    } catch (e) {
      ctx.error(e, 'Loading the terminal');
      updateButtons();
      return;
    }
    if (!ctx.alive()) return;
    const [{ Terminal }, { FitAddon }] = mods;
    termCleanup?.();
    termBox.replaceChildren();
    const t = new Terminal({
      cursorBlink: true, scrollback: 5000, fontSize: 13,
      fontFamily: 'ui-monospace, SFMono-Regular, Menlo, Consolas, "Liberation Mono", monospace',
      theme: { background: '#11161d', foreground: '#e6e9ee' },
    });
    const fit = new FitAddon();
    t.loadAddon(fit);
    t.open(termBox);
    try { fit.fit(); } catch { /* not laid out yet */ }
    term = t;
    t.attachCustomKeyEventHandler(ev => {
      if (ev.key === 'F6' && ev.type === 'keydown') { (termClose.disabled ? termOpen : termClose).focus(); return false; }
      return true;
    });
    const proto = location.protocol === 'https:' ? 'wss:' : 'ws:';
    const url = `${proto}//${location.host}/v1/sandboxes/${enc}/exec/pty?rows=${t.rows}&cols=${t.cols}&access_token=${encodeURIComponent(token)}`;
    const socket = new WebSocket(url);
    socket.binaryType = 'arraybuffer';
    ws = socket;
    let opened = false;
    let ended = false;
    const encoder = new TextEncoder();
    socket.onopen = () => {
      opened = true;
      if (ws !== socket) return;
      termBox.dataset.connected = 'true';
      ctx.setStatus('Terminal connected.', 'ok');
      updateButtons();
      t.focus();
    };
    socket.onmessage = ev => {
      if (typeof ev.data === 'string') {
        let msg;
        try { msg = JSON.parse(ev.data); } catch { t.write(ev.data); return; }
        if (msg && 'exit' in msg) {
          ended = true;
          t.write(`\r\n\x1b[2m[process exited with code ${msg.exit}]\x1b[0m\r\n`);
          ctx.setStatus(`Terminal: the shell exited with code ${msg.exit}.`);
        } else if (msg && msg.error) {
          ended = true;
          t.write(`\r\n\x1b[31m[error: ${String(msg.error).replace(/[\x00-\x1f\x7f]/g, ' ')}]\x1b[0m\r\n`);
          ctx.setStatus(`Terminal error: ${msg.error}`, 'error');
        }
      } else {
        t.write(new Uint8Array(ev.data));
      }
    };
    socket.onclose = ev => {
      if (t === term && !ended) {
        t.write(`\r\n\x1b[2m[connection closed${ev.code && ev.code !== 1000 && ev.code !== 1005 ? ` (${ev.code})` : ''}]\x1b[0m\r\n`);
      }
      if (!opened && ctx.alive()) ctx.setStatus('Terminal: the connection was refused (is the sandbox running?).', 'error');
      if (ws === socket) ws = null;
      termBox.dataset.connected = 'false';
      if (ctx.alive()) updateButtons();
    };
    const send = data => { if (socket.readyState === WebSocket.OPEN) socket.send(data); };
    const d1 = t.onData(data => send(encoder.encode(data)));
    const d2 = t.onBinary(data => send(Uint8Array.from(data, c => c.charCodeAt(0) & 0xff)));
    const d3 = t.onResize(({ rows, cols }) => send(JSON.stringify({ resize: { rows, cols } })));
    const ro = new ResizeObserver(() => { try { fit.fit(); } catch { /* hidden */ } });
    ro.observe(termBox);
    termCleanup = () => {
      ro.disconnect();
      d1.dispose(); d2.dispose(); d3.dispose();
      if (ws === socket) closeTerminal();
      t.dispose();
      if (term === t) term = null;
    };
    updateButtons();
  }

  termOpen.addEventListener('click', openTerminal);
  termClose.addEventListener('click', () => { closeTerminal(); ctx.setStatus('Terminal closed.'); termOpen.focus(); });

  ctx.onCleanup(() => {
    closeTerminal();
    termCleanup?.();
    usageChart.destroy();
    cpuChart.destroy();
  });

  poller = ctx.poll(refresh, POLL_MS);
}

/** A link only for http(s) URLs (relative ones resolved here). */
function safeLink(u) {
  if (!u) return '—';
  let url;
  try { url = new URL(u, location.href); } catch { return String(u); }
  if (url.protocol !== 'http:' && url.protocol !== 'https:') return String(u);
  return h('a', { href: url.href, rel: 'noopener noreferrer', target: '_blank' }, String(u));
}
