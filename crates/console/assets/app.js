// The console's shell: sign-in, navigation, hash routing, the status area
// and each page's lifetime (its timers and requests end when it is left).

import { api, getToken, setToken, clearToken, onUnauthorized, ApiError } from './api.js';
import { setText } from './dom.js';

const ROUTES = [
  { re: /^\/sandboxes\/?$/, page: 'sandboxes', title: 'Sandboxes', nav: '#/sandboxes', load: () => import('./pages/sandboxes.js') },
  { re: /^\/sandboxes\/([^/]+)$/, page: 'sandbox', title: 'Sandbox', nav: '#/sandboxes', load: () => import('./pages/sandbox.js') },
  { re: /^\/sweeps\/?$/, page: 'sweeps', title: 'Sweeps', nav: '#/sweeps', load: () => import('./pages/sweeps.js') },
  { re: /^\/sweeps\/([^/]+)$/, page: 'sweep', title: 'Sweep', nav: '#/sweeps', load: () => import('./pages/sweep.js') },
  { re: /^\/usage\/?$/, page: 'usage', title: 'Usage', nav: '#/usage', load: () => import('./pages/usage.js') },
  { re: /^\/fleet\/?$/, page: 'fleet', title: 'Fleet', nav: '#/fleet', load: () => import('./pages/fleet.js') },
];

const $ = id => document.getElementById(id);

let current = null;      // { cleanup, controller }
let routeSeq = 0;
let me = null;
let firstRoute = true;

// ---- the status area ----

let statusTimer = null;
/** Shows a message in the polite live region; kind: info | error | ok. */
export function setStatus(message, kind = 'info') {
  const el = $('status');
  clearTimeout(statusTimer);
  setText(el, message || '');
  el.dataset.kind = message ? kind : '';
  if (message && kind === 'ok') statusTimer = setTimeout(() => { setText(el, ''); el.dataset.kind = ''; }, 8000);
}

// ---- the terminal hook for tests ----

let terminalTextFn = () => '';
window.shoalConsole = {
  terminalText: () => terminalTextFn(),
};
export function setTerminalText(fn) { terminalTextFn = fn || (() => ''); }

// ---- sign-in ----

function showSignin(message) {
  unmount();
  me = null;
  $('nav').hidden = true;
  $('account').hidden = true;
  setText($('account-name'), '');
  setText($('account-tier'), '');
  $('page').replaceChildren();
  $('signin').hidden = false;
  setText($('signin-error'), message || '');
  setStatus('');
  document.title = 'Sign in · Shoal';
  document.body.dataset.page = 'signin';
  const input = $('signin-token');
  input.value = '';
  input.setAttribute('aria-invalid', message ? 'true' : 'false');
  input.focus();
}

function signOut(message) {
  clearToken();
  showSignin(message);
}

onUnauthorized(message => {
  if (!getToken()) return;
  signOut(`Signed out: ${message}. Sign in again with a valid token.`);
});

async function submitSignin(ev) {
  ev.preventDefault();
  const input = $('signin-token');
  const token = input.value.trim();
  const err = $('signin-error');
  if (!token) {
    setText(err, 'Enter an API token.');
    input.setAttribute('aria-invalid', 'true');
    input.focus();
    return;
  }
  const button = $('signin-submit');
  button.disabled = true;
  setText(err, '');
  try {
    const who = await api('/v1/me', { token, noAuthHandler: true });
    setToken(token);
    input.value = '';
    signedIn(who);
  } catch (e) {
    const msg = e instanceof ApiError ? e.message : String(e);
    setText(err, e.status === 401 ? msg : `Sign-in failed: ${msg}`);
    input.setAttribute('aria-invalid', 'true');
    input.focus();
  } finally {
    button.disabled = false;
  }
}

function signedIn(who) {
  me = who;
  $('signin').hidden = true;
  setText($('signin-error'), '');
  setText($('account-name'), who.account ?? '');
  setText($('account-tier'), who.tier ?? '');
  $('account-tier').hidden = !who.tier;
  $('account').hidden = false;
  $('nav').hidden = false;
  if (!location.hash || location.hash === '#' || location.hash === '#/') {
    history.replaceState(null, '', '#/sandboxes');
  }
  route();
}

// ---- routing ----

function unmount() {
  if (!current) return;
  const c = current;
  current = null;
  c.controller.abort();
  try { c.cleanup?.(); } catch (e) { console.error(e); }
  setTerminalText(null);
}

function markNav(navHref) {
  for (const a of document.querySelectorAll('#nav a')) {
    if (a.getAttribute('href') === navHref) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
}

async function route() {
  if (!me) return;
  const path = (location.hash || '').replace(/^#/, '') || '/sandboxes';
  let match = null;
  let r = null;
  for (const cand of ROUTES) {
    match = path.match(cand.re);
    if (match) { r = cand; break; }
  }
  if (!r) {
    history.replaceState(null, '', '#/sandboxes');
    return route();
  }
  unmount();
  const seq = ++routeSeq;
  delete document.body.dataset.page;
  markNav(r.nav);
  setStatus('');
  document.title = `${r.title} · Shoal`;
  const root = $('page');
  root.replaceChildren();
  const controller = new AbortController();
  const cleanups = [];
  current = { controller, cleanup: () => cleanups.forEach(f => { try { f(); } catch (e) { console.error(e); } }) };
  let mod;
  try {
    mod = await r.load();
  } catch (e) {
    setStatus(`Could not load the page: ${e.message}`, 'error');
    return;
  }
  if (seq !== routeSeq) return;
  const ctx = makeContext(r.page, controller, cleanups);
  try {
    const cleanup = mod.default(root, match.slice(1).map(decodeURIComponent), ctx);
    if (typeof cleanup === 'function') cleanups.push(cleanup);
  } catch (e) {
    console.error(e);
    setStatus(`Page error: ${e.message}`, 'error');
  }
  if (!firstRoute) {
    const h1 = root.querySelector('h1');
    if (h1) { h1.tabIndex = -1; h1.focus({ preventScroll: false }); }
  }
  firstRoute = false;
}

function makeContext(page, controller, cleanups) {
  const signal = controller.signal;
  const alive = () => !signal.aborted;
  return {
    signal,
    alive,
    me,
    /** api() bound to the page: aborted when it is left. */
    api: (path, opts = {}) => api(path, { ...opts, signal }),
    setStatus: (m, k) => { if (alive()) setStatus(m, k); },
    /** Reports an error from a request unless the page was left. */
    error(e, what) {
      if (!alive() || e?.name === 'AbortError') return;
      if (e?.status === 401) return; // sign-out already says so
      console.warn(what, e);
      setStatus(`${what ? what + ': ' : ''}${e?.message ?? e}`, 'error');
    },
    /** Marks the page loaded (what the tests wait on). */
    ready() { if (alive()) document.body.dataset.page = page; },
    onCleanup(fn) { cleanups.push(fn); },
    /**
     * Calls fn now and then every `ms` after each call ends; skipped while
     * the tab is hidden; stops when the page is left.
     */
    poll(fn, ms) {
      let timer = null;
      let stopped = false;
      const tick = async () => {
        timer = null;
        if (stopped || signal.aborted) return;
        if (!document.hidden) {
          try { await fn(); } catch (e) {
            if (e?.name !== 'AbortError' && e?.status !== 401 && alive()) {
              console.warn(e);
              setStatus(e?.message ?? String(e), 'error');
            }
          }
        }
        if (!stopped && !signal.aborted) timer = setTimeout(tick, ms);
      };
      const onVisible = () => {
        if (!document.hidden && timer != null) { clearTimeout(timer); tick(); }
      };
      document.addEventListener('visibilitychange', onVisible);
      const stop = () => {
        stopped = true;
        if (timer != null) clearTimeout(timer);
        document.removeEventListener('visibilitychange', onVisible);
      };
      cleanups.push(stop);
      tick();
      return { stop, now: () => { if (timer != null) { clearTimeout(timer); tick(); } } };
    },
    setTerminalText,
  };
}

// ---- start ----

async function start() {
  $('signin-form').addEventListener('submit', submitSignin);
  // The skip link must not change the hash (the router owns it).
  $('skip-link').addEventListener('click', ev => {
    ev.preventDefault();
    const target = $('signin').hidden ? ($('page').querySelector('h1') ?? $('main')) : $('signin-token');
    if (target.tagName === 'H1') target.tabIndex = -1;
    target.focus();
  });
  $('signout').addEventListener('click', () => {
    // A new session starts at the default page.
    history.replaceState(null, '', '#/sandboxes');
    signOut('You signed out.');
  });
  window.addEventListener('hashchange', () => route());
  window.addEventListener('pagehide', () => unmount());
  const token = getToken();
  if (!token) { showSignin(''); return; }
  try {
    const who = await api('/v1/me', { token, noAuthHandler: true });
    signedIn(who);
  } catch (e) {
    if (e.status === 401) signOut(`Signed out: ${e.message}. Sign in again with a valid token.`);
    else {
      // Keep the token (the server may be restarting) but show nothing.
      showSignin(`Cannot reach the server: ${e.message}`);
    }
  }
}

if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
else start();
