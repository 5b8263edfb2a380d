// #/fleet: GET /v1/capacity every 5 s: hosts with capacity bars and the
// placements/refusals per minute (history, when the server reports it).

import { h, replace, setText, num, int, mib, duration, badge } from '../dom.js';
import { chartFigure, createChart, setSummary, COLORS } from '../charts.js';

const POLL_MS = 5000;

export default function mount(root, _params, ctx) {
  const summary = h('p', { class: 'muted', id: 'fleet-summary' }, 'Loading…');
  const tbody = h('tbody');
  const histFig = chartFigure('fleet-history-chart', 'Sandboxes placed and refused per minute');
  const histNote = h('p', { class: 'muted', id: 'fleet-history-note', hidden: true });
  const chart = createChart(histFig, {
    height: 200,
    xPad: 60,
    series: [
      { label: 'Placed', color: COLORS.accent, bars: true, fmt: v => int(v), barSize: 0.8 },
      { label: 'Refused', color: COLORS.bad, fmt: v => int(v), points: true, width: 2 },
    ],
    axes: [{ scale: 'y', label: 'per minute', fmt: v => Number.isInteger(v) ? String(v) : '' }],
  });

  root.append(
    h('div', { class: 'page-head' }, h('h1', null, 'Fleet'), summary),
    h('section', { class: 'panel', style: 'padding:0', 'aria-labelledby': 'h-hosts' },
      h('h2', { id: 'h-hosts', style: 'padding:.8rem 1rem 0' }, 'Hosts'),
      h('div', { class: 'table-wrap' }, h('table', { id: 'fleet-hosts' },
        h('thead', null, h('tr', null,
          h('th', { scope: 'col' }, 'Host'),
          h('th', { scope: 'col' }, 'State'),
          h('th', { scope: 'col' }, 'CPU busy'),
          h('th', { scope: 'col' }, 'Memory in use'),
          h('th', { scope: 'col' }, 'Sandboxes'),
          h('th', { scope: 'col', class: 'num' }, 'Reserve'),
          h('th', { scope: 'col', class: 'num' }, 'Heartbeat'))),
        tbody))),
    h('section', { class: 'panel', 'aria-labelledby': 'h-history' },
      h('h2', { id: 'h-history' }, 'Placements per minute'), histNote, histFig));

  let loaded = false;
  let lastKey = '';

  ctx.poll(async () => {
    const cap = await ctx.api('/v1/capacity');
    if (!ctx.alive()) return;
    const hosts = Array.isArray(cap?.hosts) ? cap.hosts : [];
    const key = JSON.stringify(hosts);
    if (key !== lastKey) {
      lastKey = key;
      replace(tbody, hosts.length ? hosts.map(hostRow) : h('tr', null, h('td', { colspan: 7, class: 'empty' }, 'No hosts reported.')));
    }
    const up = hosts.filter(x => x.state === 'up').length;
    const sb = hosts.reduce((a, x) => a + (Number(x.sandboxes) || 0), 0);
    const max = hosts.reduce((a, x) => a + (Number(x.max_sandboxes) || 0), 0);
    const unlimited = hosts.some(x => x.max_sandboxes == null);
    setText(summary, `${hosts.length} host${hosts.length === 1 ? '' : 's'} (${up} up) · ${int(sb)} sandbox${sb === 1 ? '' : 'es'}`
      + (unlimited ? '' : ` of ${int(max)} slots in use`));

    const hist = cap?.history;
    const minutes = Array.isArray(hist?.minute) ? hist.minute : null;
    if (minutes && minutes.length) {
      const placed = minutes.map((_, i) => Number(hist.placed?.[i]) || 0);
      const refused = minutes.map((_, i) => Number(hist.refused?.[i]) || 0);
      histNote.hidden = true;
      chart.setData([minutes.map(Number), placed, refused]);
      const sp = placed.reduce((a, b) => a + b, 0);
      const sr = refused.reduce((a, b) => a + b, 0);
      setSummary(histFig, `Over the last ${minutes.length} minute${minutes.length === 1 ? '' : 's'}: ${int(sp)} placed, ${int(sr)} refused`
        + `${sr ? ` (${num(100 * sr / Math.max(1, sp + sr), 1)}% refused)` : ''}; latest minute ${int(placed.at(-1))} placed, ${int(refused.at(-1))} refused.`);
    } else {
      histNote.hidden = false;
      setText(histNote, 'This server reports no placement history.');
      chart.setData([[], [], []]);
      setSummary(histFig, 'No placement history.');
    }
    if (!loaded) { loaded = true; ctx.ready(); }
  }, POLL_MS);

  ctx.onCleanup(() => chart.destroy());
}

function hostRow(x) {
  const busy = x.cpu_busy == null ? null : Number(x.cpu_busy);
  const memTotal = Number(x.memory_mib) || 0;
  const memUsed = Math.max(0, memTotal - (Number(x.available_mib) || 0));
  const memF = memTotal ? memUsed / memTotal : 0;
  const sbF = x.max_sandboxes ? (Number(x.sandboxes) || 0) / Number(x.max_sandboxes) : 0;
  const level = f => (f >= 0.9 ? 'hot' : f >= 0.7 ? 'warn' : '');
  const hb = x.heartbeat_age_seconds;
  return h('tr', { dataset: { host: String(x.name ?? ''), state: x.state ?? '' } },
    h('th', { scope: 'row', class: 'mono' }, String(x.name ?? '')),
    h('td', null, badge(x.state)),
    h('td', { class: 'nowrap' }, busy == null ? h('span', { class: 'muted' }, 'not reported') :
      [bar(busy, level(busy)), `${num(busy * 100, 0)}% of ${int(x.vcpus)} vCPUs`]),
    x.state === 'down'
      ? h('td', { class: 'nowrap muted' }, `${mib(memTotal)} (no recent report)`)
      : h('td', { class: 'nowrap' }, bar(memF, level(memF)), `${mib(memUsed)} of ${mib(memTotal)}`),
    x.max_sandboxes == null
      ? h('td', { class: 'nowrap' }, `${int(x.sandboxes)} (no count limit)`)
      : h('td', { class: 'nowrap' }, bar(sbF, level(sbF)), `${int(x.sandboxes)} of ${int(x.max_sandboxes)}`),
    h('td', { class: 'num' }, mib(x.reserve_mib)),
    h('td', { class: 'num' }, hb == null ? '—' : `${duration(hb)} ago`));
}

function bar(fraction, kind) {
  const f = Number.isFinite(fraction) ? Math.min(1, Math.max(0, fraction)) : 0;
  return h('span', { class: `bar ${kind}`, 'aria-hidden': 'true' },
    h('span', { class: 'bar-fill', style: { width: `${(f * 100).toFixed(1)}%` } }));
}
