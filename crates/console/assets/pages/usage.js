// #/usage: cost per day over a date range (one /v1/usage call per local
// day, a few at a time), the range's total, and the range's rows grouped
// client-side by a metadata key. Not polled: the range is fixed.

import { qs } from '../api.js';
import { h, replace, setText, usd, num, int, toCsv, download } from '../dom.js';
import { chartFigure, createChart, setSummary, COLORS, moneyTick } from '../charts.js';

const MAX_DAYS = 366;
const PARALLEL = 6;
const NONE = '(none)';

function isoDay(d) {
  const p = n => String(n).padStart(2, '0');
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())}`;
}
function parseDay(s) {
  const m = /^(\d{4})-(\d{2})-(\d{2})$/.exec(s || '');
  return m ? new Date(Number(m[1]), Number(m[2]) - 1, Number(m[3])) : null;
}
const unix = d => Math.floor(d.getTime() / 1000);

export default function mount(root, _params, ctx) {
  const today = new Date(); today.setHours(0, 0, 0, 0);
  const start = new Date(today); start.setDate(start.getDate() - 13);
  const fromIn = h('input', { id: 'usage-from', type: 'date', value: isoDay(start), max: isoDay(today) });
  const toIn = h('input', { id: 'usage-to', type: 'date', value: isoDay(today), max: isoDay(today) });
  const keyIn = h('input', { id: 'usage-group-key', type: 'text', value: 'sweep', autocomplete: 'off', spellcheck: 'false',
    'aria-describedby': 'usage-group-hint' });
  const showBtn = h('button', { type: 'submit', class: 'btn btn-primary', id: 'usage-apply' }, 'Show');
  const total = h('span', { class: 'v', id: 'usage-total-cost', dataset: { cost: '0' } }, '—');
  const totalCpu = h('span', { class: 'v', id: 'usage-total-cpu' }, '—');
  const totalGib = h('span', { class: 'v', id: 'usage-total-gib' }, '—');
  const totalSb = h('span', { class: 'v', id: 'usage-total-sandboxes' }, '—');
  const rangeNote = h('p', { class: 'muted', id: 'usage-range-note' });

  const dailyFig = chartFigure('usage-daily-chart', 'Cost per day, with CPU seconds and GiB-seconds');
  const groupFig = chartFigure('usage-group-chart', 'Cost by metadata value');
  const dailyTable = h('tbody');
  const groupBody = h('tbody');
  const groupKeyHead = h('th', { scope: 'col' }, 'Value');
  const csvDaily = h('button', { type: 'button', id: 'usage-csv-daily', class: 'btn', disabled: true }, 'Download daily CSV');
  const csvGroups = h('button', { type: 'button', id: 'usage-csv-groups', class: 'btn', disabled: true }, 'Download grouped CSV');

  const daily = createChart(dailyFig, {
    height: 240,
    xFmt: v => isoDay(new Date(v * 1000)),
    xLabel: 'Day',
    xPad: 43200,
    series: [
      { label: 'Cost', color: COLORS.accent, bars: true, scale: 'usd', fmt: v => usd(v) },
      { label: 'CPU seconds', color: COLORS.cpu, scale: 'cpu', fmt: v => num(v, 1), points: true },
      { label: 'GiB-seconds', color: COLORS.mem, scale: 'gib', fmt: v => num(v, 1), points: true, dash: [4, 3] },
    ],
    axes: [
      { scale: 'usd', label: 'USD', fmt: moneyTick },
      { scale: 'cpu', label: 'CPU s', side: 'right', fmt: v => num(v, 0), color: COLORS.cpu },
    ],
  });
  let groupLabels = [];
  const groupChart = createChart(groupFig, {
    height: 200,
    labels: () => groupLabels,
    axisLabel: i => { const s = groupLabels[i] ?? ''; return s.length > 14 ? s.slice(0, 13) + '…' : s; },
    tickWidth: 90,
    xLabel: 'Value',
    series: [{ label: 'Cost', color: COLORS.cost, bars: true, fmt: v => usd(v), barSize: 0.6 }],
    axes: [{ scale: 'y', label: 'USD', fmt: moneyTick }],
  });

  root.append(
    h('div', { class: 'page-head' }, h('h1', null, 'Usage'), rangeNote),
    h('form', { class: 'filters', 'aria-label': 'Usage range', onsubmit: e => { e.preventDefault(); clearTimeout(rangeTimer); load(); } },
      h('div', { class: 'field' }, h('label', { for: 'usage-from' }, 'From (first day)'), fromIn),
      h('div', { class: 'field' }, h('label', { for: 'usage-to' }, 'To (last day)'), toIn),
      showBtn),
    h('section', { class: 'panel', 'aria-labelledby': 'h-u-total' },
      h('h2', { id: 'h-u-total' }, 'Range total'),
      h('div', { class: 'stats' },
        h('div', { class: 'stat' }, h('span', { class: 'k' }, 'Cost'), total),
        h('div', { class: 'stat' }, h('span', { class: 'k' }, 'CPU seconds'), totalCpu),
        h('div', { class: 'stat' }, h('span', { class: 'k' }, 'GiB-seconds'), totalGib),
        h('div', { class: 'stat' }, h('span', { class: 'k' }, 'Sandboxes'), totalSb))),
    h('section', { class: 'panel', 'aria-labelledby': 'h-u-daily' },
      h('h2', { id: 'h-u-daily' }, 'Per day'),
      dailyFig,
      h('div', { class: 'toolbar' }, csvDaily),
      h('details', null, h('summary', null, 'Per-day table'),
        h('div', { class: 'table-wrap' }, h('table', { id: 'usage-daily-table' },
          h('thead', null, h('tr', null, ['Day', 'Sandboxes', 'CPU seconds', 'GiB-seconds', 'Cost'].map((t, i) =>
            h('th', { scope: 'col', class: i ? 'num' : null }, t)))),
          dailyTable)))),
    h('section', { class: 'panel', 'aria-labelledby': 'h-u-group' },
      h('h2', { id: 'h-u-group' }, 'By metadata key'),
      h('div', { class: 'filters' },
        h('div', { class: 'field' }, h('label', { for: 'usage-group-key' }, 'Metadata key'), keyIn,
          h('span', { class: 'hint', id: 'usage-group-hint' }, 'e.g. sweep or project; sandboxes without it are under “(none)”')),
        csvGroups),
      h('div', { class: 'table-wrap' }, h('table', { id: 'usage-by-key' },
        h('thead', null, h('tr', null, groupKeyHead,
          ['Sandboxes', 'CPU seconds', 'GiB-seconds', 'Cost'].map(t => h('th', { scope: 'col', class: 'num' }, t)))),
        groupBody)),
      groupFig));

  let days = [];       // [{day, from, to, sandboxes, cpu_seconds, gib_seconds, cost}]
  let items = [];      // the range's rows
  let groups = [];
  let seq = 0;
  let loaded = false;

  async function load() {
    const from = parseDay(fromIn.value);
    const to = parseDay(toIn.value);
    const bad = !from || !to || from > to;
    fromIn.setAttribute('aria-invalid', bad ? 'true' : 'false');
    toIn.setAttribute('aria-invalid', bad ? 'true' : 'false');
    if (bad) { ctx.setStatus('Pick a first day on or before the last day.', 'error'); return; }
    const list = [];
    for (let d = new Date(from); d <= to; d.setDate(d.getDate() + 1)) {
      const next = new Date(d); next.setDate(next.getDate() + 1);
      list.push({ day: isoDay(d), from: unix(d), to: unix(next) });
      if (list.length > MAX_DAYS) break;
    }
    if (list.length > MAX_DAYS) { ctx.setStatus(`Pick at most ${MAX_DAYS} days.`, 'error'); return; }
    const mine = ++seq;
    showBtn.disabled = true;
    ctx.setStatus(`Loading ${list.length} day${list.length === 1 ? '' : 's'}…`);
    try {
      const rangeP = ctx.api(`/v1/usage${qs({ from: list[0].from, to: list[list.length - 1].to })}`);
      let next = 0;
      const worker = async () => {
        while (next < list.length) {
          const d = list[next++];
          const r = await ctx.api(`/v1/usage${qs({ from: d.from, to: d.to })}`);
          const t = r?.totals ?? {};
          Object.assign(d, {
            sandboxes: Number(t.sandboxes) || 0, cpu_seconds: Number(t.cpu_seconds) || 0,
            gib_seconds: Number(t.gib_seconds) || 0, cost: Number(t.cost) || 0,
          });
        }
      };
      const [range] = await Promise.all([rangeP, ...Array.from({ length: Math.min(PARALLEL, list.length) }, worker)]);
      if (mine !== seq || !ctx.alive()) return;
      days = list;
      items = range?.items ?? [];
      const t = range?.totals ?? {};
      const cost = Number(t.cost) || 0;
      total.dataset.cost = String(cost);
      setText(total, usd(cost));
      setText(totalCpu, num(t.cpu_seconds, 1));
      setText(totalGib, num(t.gib_seconds, 1));
      setText(totalSb, int(t.sandboxes ?? items.length));
      setText(rangeNote, `${list[0].day} to ${list[list.length - 1].day} (${list.length} day${list.length === 1 ? '' : 's'}, local time)`);
      renderDaily();
      renderGroups();
      ctx.setStatus('');
      if (!loaded) { loaded = true; ctx.ready(); }
    } catch (e) {
      ctx.error(e, 'Usage');
    } finally {
      if (mine === seq) showBtn.disabled = false;
    }
  }

  function renderDaily() {
    daily.setData([days.map(d => d.from), days.map(d => d.cost), days.map(d => d.cpu_seconds), days.map(d => d.gib_seconds)]);
    const sum = days.reduce((a, d) => a + d.cost, 0);
    const top = days.reduce((a, d) => (d.cost > (a?.cost ?? -1) ? d : a), null);
    setSummary(dailyFig, days.length
      ? `${days.length} days, ${usd(sum)} in all${top && top.cost > 0 ? `; the most expensive day was ${top.day} at ${usd(top.cost)}` : ''}.`
      : 'No days.');
    replace(dailyTable, days.map(d => h('tr', { dataset: { day: d.day } },
      h('th', { scope: 'row' }, d.day),
      h('td', { class: 'num' }, int(d.sandboxes)),
      h('td', { class: 'num' }, num(d.cpu_seconds, 1)),
      h('td', { class: 'num' }, num(d.gib_seconds, 1)),
      h('td', { class: 'num' }, usd(d.cost)))));
    csvDaily.disabled = !days.length;
  }

  function renderGroups() {
    const key = keyIn.value.trim();
    setText(groupKeyHead, key ? `${key} =` : 'Value');
    const map = new Map();
    for (const it of items) {
      const v = key && it.metadata && Object.hasOwn(it.metadata, key) ? String(it.metadata[key]) : NONE;
      const g = map.get(v) ?? { value: v, sandboxes: 0, cpu_seconds: 0, gib_seconds: 0, cost: 0 };
      g.sandboxes += 1;
      g.cpu_seconds += Number(it.cpu_seconds) || 0;
      g.gib_seconds += Number(it.gib_seconds) || 0;
      g.cost += Number(it.cost) || 0;
      map.set(v, g);
    }
    groups = [...map.values()].sort((a, b) => b.cost - a.cost || a.value.localeCompare(b.value));
    replace(groupBody, groups.length ? groups.map(g => h('tr', { dataset: { value: g.value } },
      h('th', { scope: 'row', class: g.value === NONE ? 'muted' : 'mono' }, g.value),
      h('td', { class: 'num' }, int(g.sandboxes)),
      h('td', { class: 'num' }, num(g.cpu_seconds, 1)),
      h('td', { class: 'num' }, num(g.gib_seconds, 1)),
      h('td', { class: 'num' }, usd(g.cost)))) :
      h('tr', null, h('td', { colspan: 5, class: 'empty' }, 'No usage in this range.')));
    const shown = groups.slice(0, 30);
    groupLabels = shown.map(g => g.value);
    groupChart.rebuild([shown.map((_, i) => i), shown.map(g => g.cost)]);
    setSummary(groupFig, groups.length
      ? `${groups.length} value${groups.length === 1 ? '' : 's'} of “${key || '—'}”${groups.length > 30 ? ' (the 30 costliest charted)' : ''}; the costliest is ${groups[0].value} at ${usd(groups[0].cost)}.`
      : 'No usage in this range.');
    csvGroups.disabled = !groups.length;
  }

  let rangeTimer;
  const reloadSoon = () => { clearTimeout(rangeTimer); rangeTimer = setTimeout(load, 400); };
  fromIn.addEventListener('change', reloadSoon);
  toIn.addEventListener('change', reloadSoon);
  ctx.onCleanup(() => clearTimeout(rangeTimer));
  let keyTimer;
  keyIn.addEventListener('input', () => { clearTimeout(keyTimer); keyTimer = setTimeout(renderGroups, 250); });
  ctx.onCleanup(() => { clearTimeout(keyTimer); daily.destroy(); groupChart.destroy(); });

  csvDaily.addEventListener('click', () => {
    download(`shoal-usage-daily-${fromIn.value}-to-${toIn.value}.csv`, toCsv(
      ['day', 'from_unix', 'to_unix', 'sandboxes', 'cpu_seconds', 'gib_seconds', 'cost_usd'],
      days.map(d => [d.day, d.from, d.to, d.sandboxes, d.cpu_seconds, d.gib_seconds, d.cost])));
  });
  csvGroups.addEventListener('click', () => {
    const key = keyIn.value.trim() || 'value';
    download(`shoal-usage-by-${key.replace(/[^A-Za-z0-9_.-]+/g, '_')}-${fromIn.value}-to-${toIn.value}.csv`, toCsv(
      [key, 'sandboxes', 'cpu_seconds', 'gib_seconds', 'cost_usd'],
      groups.map(g => [g.value, g.sandboxes, g.cpu_seconds, g.gib_seconds, g.cost])));
  });

  load();
}
