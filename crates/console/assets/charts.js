// uPlot helpers: a chart is a <figure> with an accessible name, the plot,
// and a text summary (figcaption) that says what the plot shows.

import uPlot from './vendor/uPlot.esm.js';
import { h, setText } from './dom.js';

/** Axis ticks in dollars: "$0", "$0.020", "$1.5". */
export function moneyTick(v) {
  if (!v) return '$0';
  return `$${Number(v).toPrecision(2)}`;
}

export const COLORS = {
  accent: '#2457c5',
  cost: '#a34f00',
  cpu: '#0f766e',
  mem: '#7c3aed',
  bad: '#b42318',
  grey: '#5b6472',
};

/**
 * The figure for a chart: `<figure id aria-label>` + plot + caption.
 * Returns the figure; pass it to `createChart`.
 */
export function chartFigure(id, label) {
  return h('figure', { id, class: 'chart', 'aria-label': label, role: 'figure' },
    h('div', { class: 'plot' }),
    h('figcaption', { class: 'chart-summary' }, 'No data yet.'));
}

export function setSummary(figure, text) {
  setText(figure.querySelector('.chart-summary'), text);
}

/**
 * cfg: {
 *   height, xTime (default true), xLabel, xFmt(v) (x values in the legend),
 *   labels: () => string[] (categorical x: x values are 0..n-1),
 *   series: [{label, color, scale, fmt, bars, fill, dash, width, points}],
 *   axes:   [{scale, label, fmt, side: 'left'|'right'}],
 * }
 * Returns { setData(data), destroy(), plot() }.
 */
export function createChart(figure, cfg) {
  const plotEl = figure.querySelector('.plot');
  const height = cfg.height ?? 220;
  const xTime = cfg.labels ? false : (cfg.xTime ?? true);
  let u = null;
  let ro = null;

  const categorical = !!cfg.labels;
  const labelOf = i => {
    const ls = cfg.labels ? cfg.labels() : [];
    return Number.isInteger(i) && i >= 0 && i < ls.length ? ls[i] : '';
  };

  function opts(width) {
    const series = [{
      label: cfg.xLabel ?? (xTime ? 'Time' : 'x'),
      value: (self, v) => v == null ? '—' : categorical ? labelOf(v)
        : cfg.xFmt ? cfg.xFmt(v) : xTime ? new Date(v * 1000).toLocaleString('en-GB', { hour12: false }) : String(v),
    }];
    for (const s of cfg.series) {
      const o = {
        label: s.label,
        stroke: s.color,
        width: s.width ?? (s.bars ? 1 : 2),
        scale: s.scale ?? 'y',
        value: (self, v) => v == null ? '—' : (s.fmt ? s.fmt(v) : String(v)),
        points: { show: s.points ?? false },
        spanGaps: true,
      };
      if (s.dash) o.dash = s.dash;
      if (s.bars) {
        o.paths = uPlot.paths.bars({ size: [s.barSize ?? 0.7, 60], align: s.align ?? 0 });
        o.fill = s.fill ?? s.color + 'cc';
        o.points = { show: false };
      } else if (s.fill) {
        o.fill = s.fill;
      }
      series.push(o);
    }
    const axes = [{
      stroke: '#39414d',
      grid: { stroke: '#e4e7ec', width: 1 },
      ticks: { stroke: '#d0d5dd', width: 1 },
      ...(categorical ? {
        values: (self, splits) => splits.map(v => cfg.axisLabel ? cfg.axisLabel(v) : labelOf(v)),
        splits: self => {
          const n = (cfg.labels() || []).length;
          const room = Math.max(1, Math.floor((self.bbox.width / devicePixelRatio) / (cfg.tickWidth ?? 80)));
          const step = Math.max(1, Math.ceil(n / room));
          const out = [];
          for (let i = 0; i < n; i += step) out.push(i);
          return out;
        },
      } : {}),
      ...(!categorical && xTime ? { space: 70, values: (self, splits) => timeTicks(self, splits) } : {}),
      ...(cfg.xAxisFmt ? { values: (self, splits) => splits.map(v => cfg.xAxisFmt(v)) } : {}),
    }];
    for (const a of (cfg.axes ?? [{ scale: 'y' }])) {
      axes.push({
        scale: a.scale ?? 'y',
        side: a.side === 'right' ? 1 : 3,
        label: a.label,
        labelSize: a.label ? 18 : 0,
        stroke: a.color ?? '#39414d',
        // Wide enough for the longest tick label (about 7 px a character).
        size: a.size ?? ((self, values) => {
          const longest = Math.max(3, ...(values ?? []).map(v => String(v ?? '').length));
          return Math.ceil(longest * 7 + (a.label ? 30 : 14));
        }),
        grid: a.side === 'right' ? { show: false } : { stroke: '#e4e7ec', width: 1 },
        ticks: { stroke: '#d0d5dd', width: 1 },
        values: (self, splits) => splits.map(v => a.fmt ? a.fmt(v) : String(v)),
      });
    }
    const scales = {
      x: categorical
        ? { time: false, range: () => [-0.6, Math.max(0.6, (cfg.labels() || []).length - 0.4)] }
        : !xTime && !cfg.xPad ? { time: false }
        : { time: xTime, range: (self, min, max) => {
            const pad = cfg.xPad ?? 0;
            if (min == null || max == null) {
              const now = Date.now() / 1000;
              return xTime ? [now - 60, now] : [0, 1];
            }
            // One sample (or none apart): a minute around it, not decades.
            const lo = min - pad, hi = max + pad;
            return hi - lo < 60 && xTime ? [lo - 30, hi + 30] : [lo, hi];
          } },
    };
    for (const a of (cfg.axes ?? [{ scale: 'y' }])) {
      scales[a.scale ?? 'y'] = a.zero === false
        ? { range: (self, min, max) => {
          if (min == null || max == null) return [0, 1];
          const pad = Math.max((max - min) * 0.1, Math.abs(max) * 0.01, 1e-9);
          return [Math.max(0, min - pad), max + pad];
        } }
        : { range: (self, min, max) => [Math.min(0, min ?? 0), max > 0 ? max * 1.1 : 1] };
    }
    return {
      width, height, series, axes, scales,
      legend: { live: true },
      cursor: { drag: { x: false, y: false }, points: { size: 6 } },
      padding: [12, 8, 0, 0],
    };
  }

  function widthNow() {
    return Math.max(240, Math.floor(plotEl.clientWidth || figure.clientWidth || 640));
  }

  return {
    setData(data) {
      if (!u) {
        u = new uPlot(opts(widthNow()), data, plotEl);
        ro = new ResizeObserver(() => {
          const w = widthNow();
          if (u && Math.abs(u.width - w) > 2) u.setSize({ width: w, height });
        });
        ro.observe(plotEl);
      } else {
        u.setData(data, true);
      }
    },
    /** Rebuilds (after the categories or scales changed shape). */
    rebuild(data) {
      this.destroy();
      this.setData(data);
    },
    destroy() {
      ro?.disconnect();
      ro = null;
      u?.destroy();
      u = null;
    },
    plot: () => u,
  };
}

const pad2 = n => String(n).padStart(2, '0');
const MONTHS = ['Jan', 'Feb', 'Mar', 'Apr', 'May', 'Jun', 'Jul', 'Aug', 'Sep', 'Oct', 'Nov', 'Dec'];

/** Local-time tick labels sized to the visible span; repeats blanked. */
function timeTicks(self, splits) {
  const span = (self.scales.x.max ?? 0) - (self.scales.x.min ?? 0);
  let prev = null;
  return splits.map(v => {
    const d = new Date(v * 1000);
    let s;
    if (span <= 900) s = `${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
    else if (span <= 2 * 86400) s = `${pad2(d.getHours())}:${pad2(d.getMinutes())}`;
    else s = `${d.getDate()} ${MONTHS[d.getMonth()]}`;
    if (s === prev) return '';
    prev = s;
    return s;
  });
}
