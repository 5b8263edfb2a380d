// #/sandboxes: the live table. Polls only routes that do not count as a
// sandbox's activity: GET /v1/sandboxes and GET /v1/usage.

import { qs } from '../api.js';
import { h, setText, usd, duration, epoch, chips, badge, updateBadge, parsePairs, dateTime } from '../dom.js';

const STATES = ['running', 'paused', 'hibernated', 'failed'];
const POLL_MS = 2000;

export default function mount(root, _params, ctx) {
  const stateSel = h('select', { id: 'filter-state' },
    h('option', { value: '' }, 'All states'),
    STATES.map(s => h('option', { value: s }, s)));
  const templateIn = h('input', { id: 'filter-template', type: 'text', placeholder: 'e.g. python', autocomplete: 'off' });
  const metaIn = h('input', { id: 'filter-metadata', type: 'text', placeholder: 'key=value', autocomplete: 'off',
    'aria-describedby': 'filter-metadata-hint' });
  const summary = h('p', { id: 'sandboxes-summary', class: 'muted' }, 'Loading…');
  const tbody = h('tbody');
  const table = h('table', { id: 'sandboxes-table' },
    h('caption', { class: 'muted', style: 'caption-side: bottom; text-align: left; padding-top: .4rem' },
      'CPU and memory “now” are averages between the last two refreshes (metered every few seconds).'),
    h('thead', null, h('tr', null,
      h('th', { scope: 'col' }, 'ID'),
      h('th', { scope: 'col' }, 'State'),
      h('th', { scope: 'col' }, 'Template'),
      h('th', { scope: 'col', class: 'num' }, 'Age'),
      h('th', { scope: 'col', class: 'num' }, 'Idle'),
      h('th', { scope: 'col', class: 'num' }, 'CPU now'),
      h('th', { scope: 'col', class: 'num' }, 'Memory now'),
      h('th', { scope: 'col', class: 'num' }, 'Cost so far'),
      h('th', { scope: 'col' }, 'Metadata'))),
    tbody);

  root.append(
    h('div', { class: 'page-head' }, h('h1', null, 'Sandboxes'), summary),
    h('form', { class: 'filters', role: 'search', 'aria-label': 'Filter sandboxes', onsubmit: e => { e.preventDefault(); refreshSoon(); } },
      h('div', { class: 'field' }, h('label', { for: 'filter-state' }, 'State'), stateSel),
      h('div', { class: 'field' }, h('label', { for: 'filter-template' }, 'Template contains'), templateIn),
      h('div', { class: 'field' }, h('label', { for: 'filter-metadata' }, 'Metadata'), metaIn,
        h('span', { id: 'filter-metadata-hint', class: 'hint' }, 'key=value, several joined by commas')),
      h('button', { type: 'submit', class: 'btn' }, 'Apply')),
    h('div', { class: 'table-wrap panel', style: 'padding:0' }, table));

  const rows = new Map();       // id -> { tr, cells..., metaKey }
  const prev = new Map();       // id -> { t, cpu, gib }
  let last = { list: [], usage: new Map(), at: 0 };
  let loaded = false;
  let poller;

  function refreshSoon() { poller?.now(); }
  stateSel.addEventListener('change', refreshSoon);
  let metaTimer;
  metaIn.addEventListener('input', () => { clearTimeout(metaTimer); metaTimer = setTimeout(refreshSoon, 400); });
  templateIn.addEventListener('input', () => render());
  ctx.onCleanup(() => clearTimeout(metaTimer));

  async function refresh() {
    const { pairs, bad } = parsePairs(metaIn.value);
    metaIn.setAttribute('aria-invalid', bad.length ? 'true' : 'false');
    const query = qs({ state: stateSel.value, metadata: pairs.map(([k, v]) => `${k}=${v}`) });
    const list = await ctx.api(`/v1/sandboxes${query}`);
    const arr = Array.isArray(list) ? list : (list?.sandboxes ?? []);
    let usage = new Map();
    let sampledAt = Date.now() / 1000;
    if (arr.length) {
      // Usage since the oldest listed sandbox began (so "so far" is whole),
      // with an open `to`: the server takes a fresh sample.
      const from = Math.floor(Math.min(...arr.map(s => epoch(s.created_at)).filter(Number.isFinite), Date.now() / 1000)) - 60;
      try {
        const report = await ctx.api(`/v1/usage${qs({ from, metadata: pairs.map(([k, v]) => `${k}=${v}`) })}`);
        for (const row of report?.items ?? []) usage.set(row.sandbox_id, row);
        const to = epoch(report?.to);
        if (Number.isFinite(to)) sampledAt = to;
      } catch (e) {
        if (e?.name === 'AbortError' || e?.status === 401) throw e;
        ctx.error(e, 'Usage');
      }
    }
    last = { list: arr, usage, at: sampledAt };
    render(true);
    if (!loaded) { loaded = true; ctx.ready(); }
  }

  function render(fresh = false) {
    const tpl = templateIn.value.trim().toLowerCase();
    const list = last.list
      .filter(s => !tpl || String(s.template ?? '').toLowerCase().includes(tpl))
      .sort((a, b) => String(b.created_at).localeCompare(String(a.created_at)) || String(a.id).localeCompare(String(b.id)));
    const seen = new Set();
    let total = 0;
    const now = Date.now() / 1000;
    list.forEach((s, i) => {
      seen.add(s.id);
      let r = rows.get(s.id);
      if (!r) r = makeRow(s.id);
      const u = last.usage.get(s.id);
      // CPU and memory now: deltas between two usage answers.
      if (fresh && u) {
        const p = prev.get(s.id);
        const cur = { t: last.at, cpu: Number(u.cpu_seconds) || 0, gib: Number(u.gib_seconds) || 0 };
        if (p && cur.t - p.t > 0.2) {
          const dt = cur.t - p.t;
          r.cpuNow = Math.max(0, (cur.cpu - p.cpu) / dt);
          r.memNow = Math.max(0, (cur.gib - p.gib) / dt);
          prev.set(s.id, cur);
        } else if (!p) {
          prev.set(s.id, cur);
        }
      }
      r.tr.dataset.state = s.status ?? '';
      updateBadge(r.state, s.status);
      r.state.title = s.status_reason ? `${s.status}: ${s.status_reason}` : (s.status ?? '');
      setText(r.template, s.template ?? '');
      const created = epoch(s.created_at);
      setText(r.age, Number.isFinite(created) ? duration(now - created) : '—');
      r.age.title = dateTime(s.created_at);
      setText(r.idle, s.idle_seconds == null ? '—' : duration(s.idle_seconds));
      const paused = s.status !== 'running';
      setText(r.cpu, r.cpuNow == null ? '—' : (paused && r.cpuNow === 0 ? '0%' : `${(r.cpuNow * 100).toFixed(1)}%`));
      setText(r.mem, r.memNow == null ? '—' : `${Math.round(r.memNow * 1024)} MiB`);
      setText(r.cost, u ? usd(u.cost) : '—');
      if (u) total += Number(u.cost) || 0;
      const metaKey = JSON.stringify(s.metadata ?? {});
      if (metaKey !== r.metaKey) { r.metaKey = metaKey; r.meta.replaceChildren(chips(s.metadata)); }
      if (tbody.children[i] !== r.tr) tbody.insertBefore(r.tr, tbody.children[i] ?? null);
    });
    for (const [id, r] of rows) {
      if (!seen.has(id)) { r.tr.remove(); rows.delete(id); if (!last.list.some(s => s.id === id)) prev.delete(id); }
    }
    let empty = tbody.querySelector('tr.empty-row');
    if (!list.length) {
      if (!empty) {
        empty = h('tr', { class: 'empty-row' }, h('td', { colspan: 9, class: 'empty' }, ''));
        tbody.append(empty);
      }
      setText(empty.firstChild, last.list.length ? 'No sandbox matches the template filter.' : 'No live sandboxes match.');
    } else if (empty) empty.remove();
    const hidden = last.list.length - list.length;
    setText(summary, `${list.length} sandbox${list.length === 1 ? '' : 'es'}${hidden ? ` (${hidden} hidden by the template filter)` : ''} · total cost so far ${usd(total)}`);
  }

  function makeRow(id) {
    const td = (cls) => h('td', cls ? { class: cls } : null);
    const r = {
      tr: h('tr', { dataset: { sandboxId: id } }),
      state: badge(''),
      template: td(), age: td('num'), idle: td('num'), cpu: td('num'), mem: td('num'), cost: td('num'), meta: td(),
      metaKey: null, cpuNow: null, memNow: null,
    };
    r.tr.append(
      h('td', { class: 'mono nowrap' }, h('a', { href: `#/sandboxes/${encodeURIComponent(id)}` }, id)),
      h('td', null, r.state), r.template, r.age, r.idle, r.cpu, r.mem, r.cost, r.meta);
    rows.set(id, r);
    return r;
  }

  poller = ctx.poll(refresh, POLL_MS);
}
