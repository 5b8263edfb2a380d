// #/sweeps/<id>: one sweep, polled each second; its cells are re-read when
// the counts change (less often for big sweeps, whose cell pages are heavy).

import { h, replace, setText, usd, num, int, duration, ms, epoch, dateTime, badge, updateBadge } from '../dom.js';
import { chartFigure, createChart, setSummary, COLORS } from '../charts.js';

const POLL_MS = 1000;
const PAGE = 1000;
const MAX_CELLS = 10000;
const BINS = 20;
const CELL_STATES = ['pending', 'running', 'succeeded', 'failed', 'timeout', 'cancelled'];
const FINISHED = new Set(['succeeded', 'failed', 'timeout']);
const MAX_FAILURES = 50;

/** Dollars: 4 decimals, or 6 for amounts under a cent. */

export default function mount(root, [id], ctx) {
  const base = `/v1/sweeps/${encodeURIComponent(id)}`;

  const title = h('span', null, id);
  const stateBadge = badge('…', 'sweep-state');
  const reason = h('p', { class: 'muted', id: 'sweep-reason', hidden: true });
  const progress = h('progress', { id: 'sweep-progress', max: '1', value: '0', 'aria-labelledby': 'sweep-progress-label' });
  const progressText = h('span', { id: 'sweep-progress-label' }, 'Progress');
  const countsList = h('ul', { class: 'legend', id: 'sweep-counts', 'aria-label': 'Cells by state' });
  const facts = {};
  const fact = (k, label) => { facts[k] = h('dd', null, '—'); return [h('dt', null, label), facts[k]]; };

  const cost = h('span', { class: 'v', id: 'sweep-cost' }, '—');
  const estCost = h('span', { class: 'v', id: 'sweep-cost-estimate' }, '—');
  const eta = h('span', { class: 'v', id: 'sweep-eta' }, '—');
  const rate = h('span', { class: 'v', id: 'sweep-rate' }, '—');
  const rateLabel = h('span', { class: 'k' }, 'Recent throughput');

  const cancelBtn = h('button', { type: 'button', id: 'sweep-cancel', class: 'btn btn-danger', disabled: true }, 'Cancel sweep');
  const requeueBtn = h('button', { type: 'button', id: 'sweep-requeue', class: 'btn', disabled: true }, 'Requeue failed');
  const throttleIn = h('input', { id: 'sweep-throttle', type: 'number', min: '0', step: '1', style: 'width:6rem',
    'aria-describedby': 'sweep-throttle-hint' });
  const throttleBtn = h('button', { type: 'submit', id: 'sweep-throttle-set', class: 'btn' }, 'Set');

  const grid = h('div', { id: 'cell-grid', class: 'cell-grid', role: 'group', 'aria-label': 'Cells by index, coloured by state; hover a cell for its index, value and state' });
  const gridNote = h('p', { class: 'muted', id: 'cell-grid-note' });
  const histFig = chartFigure('runtime-histogram', 'Histogram of finished cells’ run times');
  const thruFig = chartFigure('throughput-chart', 'Cells finished per time bucket');
  const failures = h('div', { id: 'failures', class: 'failures' }, h('p', { class: 'muted' }, 'Loading…'));

  let histLabels = [];
  let histAxis = [];
  const hist = createChart(histFig, {
    height: 180,
    labels: () => histLabels,
    axisLabel: i => histAxis[i] ?? '',
    tickWidth: 70,
    xLabel: 'Run time',
    series: [{ label: 'Cells', color: COLORS.accent, bars: true, fmt: v => int(v), barSize: 0.9 }],
    axes: [{ scale: 'y', label: 'cells', fmt: v => Number.isInteger(v) ? String(v) : '' }],
  });
  let bucketSecs = 10;
  const thru = createChart(thruFig, {
    height: 180,
    xPad: 10,
    series: [{ label: 'Finished', color: COLORS.cpu, bars: true, fmt: v => int(v), barSize: 0.9 }],
    axes: [{ scale: 'y', label: 'cells', fmt: v => Number.isInteger(v) ? String(v) : '' }],
  });

  root.append(
    h('p', null, h('a', { href: '#/sweeps' }, '← All sweeps')),
    h('div', { class: 'page-head' }, h('h1', null, 'Sweep ', title), h('span', null, 'State: ', stateBadge)),
    reason,
    h('div', { class: 'grid2' },
      h('section', { class: 'panel', 'aria-labelledby': 'h-sw-progress' },
        h('h2', { id: 'h-sw-progress' }, 'Progress'),
        h('div', null, progressText), progress, countsList,
        h('div', { class: 'stats' },
          h('div', { class: 'stat' }, h('span', { class: 'k' }, 'Cost so far'), cost),
          h('div', { class: 'stat' }, h('span', { class: 'k' }, 'Estimated total cost'), estCost),
          h('div', { class: 'stat' }, h('span', { class: 'k' }, 'Time remaining'), eta),
          h('div', { class: 'stat' }, rateLabel, rate))),
      h('section', { class: 'panel', 'aria-labelledby': 'h-sw-details' },
        h('h2', { id: 'h-sw-details' }, 'Details and actions'),
        h('dl', { class: 'facts' }, fact('job', 'Job ID'), fact('template', 'Template'), fact('command', 'Command'),
          fact('limits', 'Timeout / retries'), fact('created', 'Created'), fact('started', 'Started'), fact('finished', 'Finished')),
        h('form', { class: 'toolbar', onsubmit: e => { e.preventDefault(); setThrottle(); } },
          h('div', { class: 'field' }, h('label', { for: 'sweep-throttle' }, 'Throttle (cells at once)'), throttleIn,
            h('span', { class: 'hint', id: 'sweep-throttle-hint' }, '0 pauses: no new cell starts')),
          throttleBtn),
        h('div', { class: 'actions' }, requeueBtn, cancelBtn))),
    h('section', { class: 'panel', style: 'margin-top:1rem', 'aria-labelledby': 'h-sw-cells' },
      h('h2', { id: 'h-sw-cells' }, 'Cells'),
      h('ul', { class: 'legend', 'aria-label': 'Colour legend' },
        CELL_STATES.map(s => h('li', null, h('span', { class: 'cell', dataset: { state: s }, 'aria-hidden': 'true' }), s))),
      grid, gridNote),
    h('div', { class: 'grid2' },
      h('section', { class: 'panel', 'aria-labelledby': 'h-sw-hist' }, h('h2', { id: 'h-sw-hist' }, 'Run times'), histFig),
      h('section', { class: 'panel', 'aria-labelledby': 'h-sw-thru' }, h('h2', { id: 'h-sw-thru' }, 'Throughput'), thruFig)),
    h('section', { class: 'panel', style: 'margin-top:1rem', 'aria-labelledby': 'h-sw-fail' },
      h('h2', { id: 'h-sw-fail' }, 'Failures'), failures));

  let sweep = null;
  let cells = [];
  let cellsKey = null;
  let cellsAt = 0;
  let cellsLoading = false;
  let throttleDirty = false;
  let loaded = false;
  let busy = false;
  const cellEls = [];

  throttleIn.addEventListener('input', () => { throttleDirty = true; });

  function showSweep(s) {
    sweep = s;
    setText(title, s.name || s.id);
    updateBadge(stateBadge, s.state);
    reason.hidden = !s.reason;
    setText(reason, s.reason ?? '');
    const p = Math.min(1, Math.max(0, Number(s.progress) || 0));
    progress.value = p;
    const c = s.counts ?? {};
    const finished = (c.succeeded ?? 0) + (c.failed ?? 0) + (c.timeout ?? 0) + (c.cancelled ?? 0);
    setText(progressText, `${Math.round(p * 100)}% done: ${int(finished)} of ${int(s.total ?? 0)} cells finished`);
    replace(countsList, CELL_STATES.map(k => h('li', { dataset: { state: k } },
      h('span', { class: 'cell', dataset: { state: k }, 'aria-hidden': 'true' }), `${k}: ${int(c[k] ?? 0)}`)));
    setText(facts.job, s.job_id ?? '—');
    setText(facts.template, s.template ?? '—');
    setText(facts.command, s.command ?? '—');
    setText(facts.limits, `${s.timeout_seconds ? duration(s.timeout_seconds) : 'none'} / ${s.retries ?? 0}`);
    setText(facts.created, dateTime(s.created_at));
    setText(facts.started, s.started_at ? dateTime(s.started_at) : '—');
    setText(facts.finished, s.finished_at ? dateTime(s.finished_at) : '—');
    setText(cost, usd(s.cost_usd));
    if (!throttleDirty && document.activeElement !== throttleIn) throttleIn.value = s.throttle ?? '';
    updateButtons();
  }

  function updateButtons() {
    const s = sweep;
    const over = !s || s.state === 'done' || s.state === 'cancelled';
    const c = s?.counts ?? {};
    cancelBtn.disabled = busy || over;
    requeueBtn.disabled = busy || !s || !((c.failed ?? 0) + (c.timeout ?? 0) + (c.cancelled ?? 0));
    throttleBtn.disabled = busy || !s;
  }

  async function loadCells(total) {
    const n = Math.min(total, MAX_CELLS);
    const pages = [];
    for (let off = 0; off < n; off += PAGE) pages.push(off);
    const out = new Array(pages.length);
    let next = 0;
    const worker = async () => {
      while (next < pages.length) {
        const i = next++;
        // States only: a 10,000-cell grid must not fetch every output tail.
        const res = await ctx.api(`${base}/cells?outputs=false&limit=${Math.min(PAGE, n - pages[i])}&offset=${pages[i]}`);
        out[i] = res?.cells ?? [];
      }
    };
    await Promise.all([worker(), worker(), worker()]);
    return out.flat();
  }

  function renderGrid() {
    for (let i = 0; i < cells.length; i++) {
      const c = cells[i];
      let el = cellEls[i];
      if (!el) {
        el = h('div', { class: 'cell' });
        cellEls[i] = el;
        grid.append(el);
      }
      const idx = String(c.index ?? i);
      if (el.dataset.index !== idx) el.dataset.index = idx;
      const st = c.state ?? 'pending';
      if (el.dataset.state !== st) el.dataset.state = st;
      const t = `${idx} ${c.value ?? ''} ${st}`;
      if (el.title !== t) el.title = t;
    }
    while (cellEls.length > cells.length) cellEls.pop().remove();
    const total = sweep?.total ?? cells.length;
    setText(gridNote, total > cells.length ? `Showing the first ${int(cells.length)} of ${int(total)} cells.` : `${int(cells.length)} cells.`);
  }

  function renderHistogram() {
    const done = cells.filter(c => FINISHED.has(c.state) && c.elapsed_ms != null).map(c => Number(c.elapsed_ms));
    if (!done.length) {
      histLabels = [];
      histAxis = [];
      hist.rebuild([[], []]);
      setSummary(histFig, 'No finished cells yet.');
      return;
    }
    const min = Math.min(...done);
    const max = Math.max(...done);
    const width = max > min ? (max - min) / BINS : 1;
    const bins = max > min ? BINS : 1;
    const counts = new Array(bins).fill(0);
    for (const v of done) counts[Math.min(bins - 1, Math.floor((v - min) / width))]++;
    histLabels = counts.map((_, i) => bins === 1 ? ms(min) : `${ms(min + i * width)}–${ms(min + (i + 1) * width)}`);
    histAxis = counts.map((_, i) => ms(min + i * width));
    const xs = counts.map((_, i) => i);
    hist.rebuild([xs, counts]);
    const sorted = [...done].sort((a, b) => a - b);
    const q = f => sorted[Math.min(sorted.length - 1, Math.floor(f * sorted.length))];
    setSummary(histFig, `${int(done.length)} finished cells: shortest ${ms(min)}, median ${ms(q(0.5))}, 90th percentile ${ms(q(0.9))}, longest ${ms(max)}.`);
  }

  function renderThroughput() {
    const ts = cells.filter(c => FINISHED.has(c.state) || c.state === 'cancelled').map(c => epoch(c.finished_at)).filter(Number.isFinite);
    if (!ts.length) {
      thru.setData([[], []]);
      setSummary(thruFig, 'No cell has finished yet.');
      return { recent: null };
    }
    const first = Math.min(...ts);
    const lastT = Math.max(...ts);
    bucketSecs = 10;
    while ((lastT - first) / bucketSecs > 600) bucketSecs *= 6;
    const start = Math.floor(first / bucketSecs) * bucketSecs;
    const n = Math.floor((lastT - start) / bucketSecs) + 1;
    // Each bar is drawn at its bucket's middle, so it covers the bucket.
    const xs = Array.from({ length: n }, (_, i) => start + i * bucketSecs + bucketSecs / 2);
    const ys = new Array(n).fill(0);
    for (const t of ts) ys[Math.floor((t - start) / bucketSecs)]++;
    thru.setData([xs, ys]);
    const peak = Math.max(...ys);
    setSummary(thruFig, `Cells finished per ${duration(bucketSecs)}: ${int(ts.length)} in all over ${duration(lastT - first)}, peak ${int(peak)} in one bucket.`);
    // Recent rate: the last minute, else the last 5 minutes, else overall.
    const now = Date.now() / 1000;
    for (const win of [60, 300]) {
      const k = ts.filter(t => t > now - win).length;
      if (k >= 3) return { recent: k / win, window: win };
    }
    const since = epoch(sweep?.started_at);
    const span = Math.max(1, (Number.isFinite(since) ? now - since : lastT - first));
    return { recent: ts.length / span, window: null };
  }

  // The failed and timed-out cells with their output tails, the first
  // MAX_FAILURES of each state.
  async function loadFailures() {
    const c = sweep?.counts ?? {};
    const wanted = ['failed', 'timeout'].filter(st => (c[st] ?? 0) > 0);
    const lists = await Promise.all(wanted.map(st =>
      ctx.api(`${base}/cells?state=${st}&limit=${MAX_FAILURES}`).then(r => r?.cells ?? [])));
    return lists.flat().sort((a, b) => a.index - b.index);
  }

  function renderFailures(bad) {
    if (!bad.length) { replace(failures, h('p', { class: 'muted' }, 'No failed or timed-out cells.')); return; }
    const c = sweep?.counts ?? {};
    const all = Math.max(bad.length, (c.failed ?? 0) + (c.timeout ?? 0));
    replace(failures,
      all > Math.min(bad.length, MAX_FAILURES) ? h('p', { class: 'muted' }, `Showing ${int(Math.min(bad.length, MAX_FAILURES))} of ${int(all)} failed or timed-out cells.`) : null,
      bad.slice(0, MAX_FAILURES).map(c => {
        const stderr = String(c.stderr ?? '');
        const tail = stderr.length > 2000 ? '…' + stderr.slice(-2000) : stderr;
        return h('article', { class: 'failure', dataset: { index: String(c.index), state: c.state } },
          h('div', { class: 'failure-head' },
            h('strong', null, `Cell ${c.index}`),
            badge(c.state),
            h('span', { class: 'mono' }, `value ${c.value ?? ''}`),
            h('span', null, `exit code ${c.exit_code ?? '—'}${c.signal ? `, signal ${c.signal}` : ''}`),
            h('span', { class: 'muted' }, `attempts ${c.attempts ?? '—'} · ${ms(c.elapsed_ms)}`)),
          c.error ? h('p', { class: 'error' }, c.error) : null,
          tail ? h('pre', { class: 'out', 'aria-label': `stderr of cell ${c.index}` }, tail) : h('p', { class: 'muted' }, 'No stderr.'));
      }));
  }

  function renderEstimates(recent) {
    const s = sweep;
    if (!s) return;
    const c = s.counts ?? {};
    const finished = (c.succeeded ?? 0) + (c.failed ?? 0) + (c.timeout ?? 0);
    const remaining = (c.pending ?? 0) + (c.running ?? 0);
    const spent = Number(s.cost_usd) || 0;
    if (s.state === 'done' || s.state === 'cancelled' || remaining === 0) {
      setText(estCost, usd(spent));
      setText(eta, s.state === 'cancelled' ? 'cancelled' : 'finished');
      // Over: the average rate from start to end, not a "recent" one.
      const span = epoch(s.finished_at) - epoch(s.started_at);
      setText(rateLabel, 'Average throughput');
      setText(rate, finished && span > 0 ? `${num(finished / span * 60, 1)} cells/min` : '—');
      return;
    } else {
      setText(estCost, finished ? `${usd(spent + spent / finished * remaining)} (≈${usd(spent / finished)} per cell)` : 'after the first cell');
      if (s.state === 'held') setText(eta, 'held');
      else if (Number(s.throttle) === 0) setText(eta, 'paused (throttle 0)');
      else setText(eta, recent?.recent ? `≈${duration(remaining / recent.recent)} (${int(remaining)} cells left)` : `unknown (${int(remaining)} cells left)`);
    }
    setText(rateLabel, 'Recent throughput');
    setText(rate, recent?.recent ? `${num(recent.recent * 60, 1)} cells/min` : '—');
  }

  async function refresh() {
    const s = await ctx.api(base);
    if (!ctx.alive()) return;
    showSweep(s);
    const key = JSON.stringify([s.counts, s.state, s.total]);
    const minGap = Math.max(POLL_MS, Math.ceil(Math.min(s.total ?? 0, MAX_CELLS) / PAGE) * 1000);
    const now = Date.now();
    if (!cellsLoading && (cellsKey !== key || now - cellsAt > 30_000) && (cellsKey == null || now - cellsAt >= minGap)) {
      cellsLoading = true;
      try {
        const [list, failed] = await Promise.all([loadCells(s.total ?? 0), loadFailures()]);
        if (!ctx.alive()) return;
        cells = list;
        cellsKey = key;
        cellsAt = Date.now();
        renderGrid();
        renderHistogram();
        renderFailures(failed);
        renderEstimates(renderThroughput());
      } finally { cellsLoading = false; }
    } else {
      renderEstimates(lastRecent());
    }
    if (!loaded) { loaded = true; ctx.ready(); }
  }

  function lastRecent() {
    const now = Date.now() / 1000;
    const ts = cells.map(c => epoch(c.finished_at)).filter(Number.isFinite);
    for (const win of [60, 300]) {
      const k = ts.filter(t => t > now - win).length;
      if (k >= 3) return { recent: k / win };
    }
    const since = epoch(sweep?.started_at);
    return { recent: ts.length && Number.isFinite(since) ? ts.length / Math.max(1, now - since) : null };
  }

  async function act(label, fn) {
    busy = true; updateButtons();
    ctx.setStatus(`${label}…`);
    try {
      const s = await fn();
      if (s && s.id && ctx.alive()) showSweep(s);
      cellsKey = null; cellsAt = 0;
      poller.now();
    } catch (e) { ctx.error(e, `${label} failed`); }
    finally { busy = false; if (ctx.alive()) updateButtons(); }
  }

  function setThrottle() {
    const v = Number(throttleIn.value);
    if (!Number.isInteger(v) || v < 0) {
      throttleIn.setAttribute('aria-invalid', 'true');
      ctx.setStatus('Throttle must be a whole number, 0 or more.', 'error');
      throttleIn.focus();
      return;
    }
    throttleIn.setAttribute('aria-invalid', 'false');
    act('Setting the throttle', async () => {
      const s = await ctx.api(base, { method: 'PATCH', body: { throttle: v } });
      throttleDirty = false;
      ctx.setStatus(`Throttle set to ${v}${v === 0 ? ' (paused)' : ''}.`, 'ok');
      return s;
    });
  }

  cancelBtn.addEventListener('click', () => {
    if (!confirm(`Cancel sweep ${sweep?.name || id}? Running cells are stopped and pending ones never start.`)) return;
    act('Cancelling', async () => {
      const s = await ctx.api(`${base}/cancel`, { method: 'POST' });
      ctx.setStatus('Sweep cancelled.', 'ok');
      return s;
    });
  });
  requeueBtn.addEventListener('click', () => act('Requeueing', async () => {
    const s = await ctx.api(`${base}/requeue`, { method: 'POST' });
    ctx.setStatus('Failed, timed-out and cancelled cells are pending again.', 'ok');
    return s;
  }));

  ctx.onCleanup(() => { hist.destroy(); thru.destroy(); });
  const poller = ctx.poll(refresh, POLL_MS);
}
