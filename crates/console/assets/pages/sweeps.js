// #/sweeps: the account's sweeps, newest first (GET /v1/sweeps, 5 s).

import { qs } from '../api.js';
import { h, replace, setText, usd, dateTime, badge, int } from '../dom.js';

const POLL_MS = 5000;
const STATES = ['held', 'active', 'done', 'cancelled'];

export default function mount(root, _params, ctx) {
  const stateSel = h('select', { id: 'sweeps-filter-state' },
    h('option', { value: '' }, 'All states'), STATES.map(s => h('option', { value: s }, s)));
  const summary = h('p', { class: 'muted', id: 'sweeps-summary' }, 'Loading…');
  const tbody = h('tbody');
  root.append(
    h('div', { class: 'page-head' }, h('h1', null, 'Sweeps'), summary),
    h('div', { class: 'filters' },
      h('div', { class: 'field' }, h('label', { for: 'sweeps-filter-state' }, 'State'), stateSel)),
    h('div', { class: 'table-wrap panel', style: 'padding:0' },
      h('table', { id: 'sweeps-table' },
        h('thead', null, h('tr', null,
          h('th', { scope: 'col' }, 'Name'),
          h('th', { scope: 'col', class: 'num' }, 'Job'),
          h('th', { scope: 'col' }, 'State'),
          h('th', { scope: 'col' }, 'Progress'),
          h('th', { scope: 'col' }, 'Cells'),
          h('th', { scope: 'col', class: 'num' }, 'Cost'),
          h('th', { scope: 'col' }, 'Created'))),
        tbody)));

  let loaded = false;
  let lastKey = '';
  const poller = ctx.poll(async () => {
    const res = await ctx.api(`/v1/sweeps${qs({ state: stateSel.value })}`);
    const list = res?.sweeps ?? (Array.isArray(res) ? res : []);
    const key = JSON.stringify(list.map(s => [s.id, s.state, s.counts, s.cost_usd, s.progress, s.name]));
    if (key !== lastKey) {
      lastKey = key;
      const focused = document.activeElement?.closest?.('tr')?.dataset?.sweepId;
      replace(tbody, list.length ? list.map(row) :
        h('tr', null, h('td', { colspan: 7, class: 'empty' }, 'No sweeps.')));
      if (focused) tbody.querySelector(`tr[data-sweep-id="${CSS.escape(focused)}"] a`)?.focus();
    }
    const cost = list.reduce((a, s) => a + (Number(s.cost_usd) || 0), 0);
    setText(summary, `${list.length} sweep${list.length === 1 ? '' : 's'} · ${usd(cost)} in all`);
    if (!loaded) { loaded = true; ctx.ready(); }
  }, POLL_MS);
  stateSel.addEventListener('change', () => { lastKey = ''; poller.now(); });
}

function row(s) {
  const c = s.counts ?? {};
  const p = Number.isFinite(Number(s.progress)) ? Number(s.progress) : 0;
  const parts = ['succeeded', 'failed', 'timeout', 'running', 'pending', 'cancelled']
    .filter(k => c[k]).map(k => `${int(c[k])} ${k}`);
  return h('tr', { dataset: { sweepId: s.id, state: s.state ?? '' } },
    h('td', null, h('a', { href: `#/sweeps/${encodeURIComponent(s.id)}` }, s.name || s.id),
      s.name ? h('div', { class: 'muted mono', style: 'font-size:.78rem' }, s.id) : null),
    h('td', { class: 'num' }, s.job_id != null ? String(s.job_id) : '—'),
    h('td', null, badge(s.state), s.reason ? h('div', { class: 'muted', style: 'font-size:.8rem' }, s.reason) : null),
    h('td', { class: 'nowrap' },
      h('progress', { max: '1', value: String(p), 'aria-label': `Progress of ${s.name || s.id}` }),
      ` ${Math.round(p * 100)}%`),
    h('td', null, `${int(s.total ?? 0)} total`, parts.length ? h('div', { class: 'muted', style: 'font-size:.8rem' }, parts.join(', ')) : null),
    h('td', { class: 'num' }, usd(s.cost_usd)),
    h('td', { class: 'nowrap' }, dateTime(s.created_at)));
}
