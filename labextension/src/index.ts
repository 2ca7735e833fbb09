// nblaunch's runs panel: a left sidebar list of this user's runs and pools (from the server
// extension's /nblaunch/api/runs) and, for the one clicked, a main-area view of it, following
// its event stream while it runs. Plain DOM in Lumino widgets: no kernel, no React.
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { Dialog, Notification, showDialog } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { INotebookTracker, NotebookActions } from '@jupyterlab/notebook';
import { ServerConnection } from '@jupyterlab/services';
import { LabIcon } from '@jupyterlab/ui-components';
import type { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

const LIST_EVERY_MS = 2000;
// While the panel is closed the list is still read, less often, to tell of a run that failed.
const HIDDEN_EVERY_MS = 10000;
const VIEW_EVERY_MS = 1000;
// Rows drawn at first, and how many more each "show more" adds.
const PAGE = 50;
const STATES = ['running', 'failed', 'lost', 'done', 'stopped', 'ended'];
// Past this many ranks the view draws a grid of small squares instead of one badge per rank.
const GRID_FROM = 9;

const icon = new LabIcon({
  name: 'nblaunch-lab:runs',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 16 16">' +
    '<g class="jp-icon3" fill="#616161"><rect x="1" y="2" width="4" height="12" rx="1"/>' +
    '<rect x="6" y="5" width="4" height="9" rx="1"/><rect x="11" y="8" width="4" height="6" rx="1"/></g></svg>'
});

interface IRecord {
  id: string;
  kind: string;
  detached: boolean;
  state: string;
  ranks: number;
  devices: string[];
  started: number | null;
  ended: number | null;
  run_dir: string;
  cause: string;
  pid: number | null;
  function: string;
  name: string;
  origin: string;
  folder: string | null;
  logs: string[];
  last_step: number | null;
  holder: { pid: number; kernel: { kernel_id: string; path: string | null } | null } | null;
}

interface IView {
  version: number;
  info: { [key: string]: any };
  ranks: { [rank: string]: { state: string; device: string; detail: string; lines: string[] } };
  lines: [number, string][];
  metrics: { [name: string]: { [rank: string]: [number, number | null][] } };
  last_step: number | null;
  diagnoses: { title: string; body: string; severity: string; rank: number | null }[];
  progress: string[];
  ended: { ok: boolean; elapsed_s: number; ranks: { [rank: string]: string } } | null;
}

async function api(path: string, method = 'GET', signal?: AbortSignal): Promise<Response> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'nblaunch/api', path);
  return ServerConnection.makeRequest(url, { method, signal }, settings);
}

// A run's path in the API: its id encoded (a run directory may be named "lr=0.1 +warm").
function runPath(id: string, tail = ''): string {
  return `runs/${encodeURIComponent(id)}${tail}`;
}

// A DOM id for a run's view: the id's characters outside [A-Za-z0-9_.-] spelled out.
function viewId(id: string): string {
  return 'nblaunch-run-' + id.replace(/[^A-Za-z0-9_.-]/g, c => `_${c.codePointAt(0)!.toString(16)}_`);
}

const SGR_COLOURS = ['#000', '#c62828', '#2e7d32', '#f9a825', '#1565c0', '#6a1b9a', '#00838f', '#9e9e9e'];

// Text with ANSI escapes as the notebook's view shows it: SGR colours and bold kept as spans,
// every other escape (cursor moves, erases) dropped. Only textContent: no HTML from the run.
function ansi(text: string, cls = ''): HTMLElement {
  const box = el('span', cls);
  let colour = '';
  let bold = false;
  // eslint-disable-next-line no-control-regex
  const parts = text.replace(/\x1b\[[0-9;?]*[A-LN-Za-ln-z]|\x1b[()][A-Z0-9]|\x1b[=>]|\r/g, '').split(/\x1b\[([0-9;]*)m/);
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      for (const code of (part || '0').split(';').map(Number)) {
        if (code === 0) {
          [colour, bold] = ['', false];
        } else if (code === 1) {
          bold = true;
        } else if (code === 22) {
          bold = false;
        } else if (code >= 30 && code <= 37) {
          colour = SGR_COLOURS[code - 30];
        } else if (code >= 90 && code <= 97) {
          colour = SGR_COLOURS[code - 90];
        } else if (code === 39) {
          colour = '';
        }
      }
      return;
    }
    if (!part) {
      return;
    }
    const span = el('span', 'nbl-lab-ansi', part);
    if (colour) {
      span.style.color = colour;
    }
    if (bold) {
      span.style.fontWeight = 'bold';
    }
    box.appendChild(span);
  });
  return box;
}

// "12 s", "3 min", "2 h 5 min", "4 d"
function span(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) {
    return `${s} s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)} min`;
  }
  if (s < 86400) {
    return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  }
  return `${Math.floor(s / 86400)} d`;
}

// "started 3 min ago · ran 2 min" (or "· for 3 min" while it runs)
function when(run: IRecord): string {
  if (!run.started) {
    return '';
  }
  const now = Date.now() / 1000;
  const ago = `started ${span(now - run.started)} ago`;
  if (run.state === 'running') {
    return `${ago} · for ${span(now - run.started)}`;
  }
  return run.ended ? `${ago} · ran ${span(run.ended - run.started)}` : ago;
}

function el(tag: string, cls = '', text = ''): HTMLElement {
  const node = document.createElement(tag);
  if (cls) {
    node.className = cls;
  }
  if (text) {
    node.textContent = text;
  }
  return node;
}

// Which kernel a detached pool serves now, as the list and the view say it.
function holderText(run: IRecord): string {
  const holder = run.holder;
  if (!holder) {
    return 'no kernel attached (nblaunch.attach_pool() in a notebook takes it)';
  }
  if (!holder.kernel) {
    return `held by pid ${holder.pid} (not a kernel of this server)`;
  }
  return `held by the kernel of ${holder.kernel.path || holder.kernel.kernel_id} (pid ${holder.pid})`;
}

function clock(seconds: number | null): string {
  return seconds ? new Date(seconds * 1000).toLocaleString() : '';
}

// What the panel and the views do in the rest of JupyterLab.
interface IHost {
  open: (id: string) => void;
  openPath: (path: string) => void;
  goTo: (folder: string) => void;
  insert: (code: string) => boolean;
}

// The sidebar: every run and pool, state by colour, a failed run's cause under it; filtered
// by state, a page at a time. At most one read of the list is in flight.
class RunsPanel extends Widget {
  private timer = 0;
  private busy = false;
  private lastRead = 0;
  private shown = PAGE;
  private runs: IRecord[] = [];
  private seen = new Map<string, string>(); // id -> state at the last read
  private filter = '';

  constructor(private host: IHost) {
    super();
    this.id = 'nblaunch-runs';
    this.addClass('nbl-lab-panel');
    this.title.icon = icon;
    this.title.caption = 'nblaunch runs';
    this.node.appendChild(el('h2', 'nbl-lab-heading', 'nblaunch runs'));
    const tools = el('div', 'nbl-lab-tools');
    const select = el('select', 'nbl-lab-filter') as HTMLSelectElement;
    for (const state of ['', ...STATES]) {
      const option = el('option', '', state || 'all states') as HTMLOptionElement;
      option.value = state;
      select.appendChild(option);
    }
    select.onchange = () => {
      this.filter = select.value;
      this.shown = PAGE;
      this.draw();
    };
    tools.appendChild(select);
    const clear = el('button', 'jp-mod-styled nbl-lab-clear', 'Clear ended…') as HTMLButtonElement;
    clear.onclick = () => void this.clearEnded();
    tools.appendChild(clear);
    this.node.appendChild(tools);
    this.node.appendChild(el('div', 'nbl-lab-error'));
    this.node.appendChild(el('div', 'nbl-lab-list'));
    void this.refresh();
    this.timer = window.setInterval(() => void this.refresh(), LIST_EVERY_MS);
  }

  dispose(): void {
    window.clearInterval(this.timer);
    super.dispose();
  }

  async refresh(): Promise<void> {
    const hidden = !this.isVisible && this.seen.size > 0;
    if (this.busy || (hidden && Date.now() - this.lastRead < HIDDEN_EVERY_MS)) {
      return; // one read at a time; closed, a read every 10 s tells of failures
    }
    this.busy = true;
    this.lastRead = Date.now();
    const error = this.node.querySelector('.nbl-lab-error') as HTMLElement;
    try {
      const response = await api('runs');
      if (!response.ok) {
        throw new Error(`the nblaunch server extension answered ${response.status}`);
      }
      this.runs = (await response.json()).runs;
      error.textContent = '';
      this.node.classList.remove('nbl-lab-offline');
    } catch (reason) {
      error.textContent = `cannot reach the server: ${reason instanceof Error ? reason.message : reason}. The list below is from ${new Date(this.lastRead).toLocaleTimeString()}; retrying every ${LIST_EVERY_MS / 1000} s.`;
      this.node.classList.add('nbl-lab-offline');
      return;
    } finally {
      this.busy = false;
    }
    this.tell(hidden);
    if (!hidden) {
      this.draw();
    }
  }

  // A run that failed or was lost since the last read, while the panel is closed: a notification.
  private tell(hidden: boolean): void {
    for (const run of this.runs) {
      const before = this.seen.get(run.id);
      const bad = run.state === 'failed' || run.state === 'lost';
      if (hidden && before === 'running' && bad) {
        const what = `${run.name} (${run.id}) ${run.state}${run.cause ? ': ' + run.cause : ''}`;
        Notification.error(`nblaunch: ${what}`, {
          autoClose: false,
          actions: [{ label: 'Show', callback: () => this.host.open(run.id) }]
        });
      }
    }
    this.seen = new Map(this.runs.map(run => [run.id, run.state]));
  }

  private async clearEnded(): Promise<void> {
    const ended = this.runs.filter(run => run.state !== 'running' && (!this.filter || run.state === this.filter));
    if (!ended.length) {
      return;
    }
    const answer = await showDialog({
      title: `Clear ${ended.length} ended run${ended.length > 1 ? 's' : ''}?`,
      body: `Their run directories (logs, metrics, outcomes) are deleted: ${ended.slice(0, 5).map(run => run.id).join(', ')}${ended.length > 5 ? ', …' : ''}`,
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Delete' })]
    });
    if (!answer.button.accept) {
      return;
    }
    for (const run of ended) {
      await api(runPath(run.id, '/clear'), 'POST');
    }
    this.lastRead = 0;
    await this.refresh();
  }

  private draw(): void {
    const list = this.node.querySelector('.nbl-lab-list') as HTMLElement;
    list.replaceChildren();
    const runs = this.runs.filter(run => !this.filter || run.state === this.filter);
    if (!runs.length) {
      list.appendChild(el('div', 'nbl-lab-empty', this.runs.length ? `no ${this.filter} runs` : 'no runs yet'));
    }
    for (const run of runs.slice(0, this.shown)) {
      list.appendChild(this.row(run));
    }
    if (runs.length > this.shown) {
      const more = el('button', 'jp-mod-styled nbl-lab-more', `show ${Math.min(PAGE, runs.length - this.shown)} more of ${runs.length - this.shown}`);
      more.onclick = () => {
        this.shown += PAGE;
        this.draw();
      };
      list.appendChild(more);
    }
  }

  private row(run: IRecord): HTMLElement {
    const row = el('div', `nbl-lab-run nbl-lab-state-${run.state}`);
    row.dataset.id = run.id;
    const top = el('div', 'nbl-lab-row-top');
    top.appendChild(el('span', 'nbl-lab-dot'));
    top.appendChild(el('span', 'nbl-lab-name', run.name));
    top.appendChild(el('span', 'nbl-lab-id', run.id));
    row.appendChild(top);
    const where = run.kind === 'pool' ? 'pool' : run.detached ? 'detached' : 'kernel';
    const step = run.last_step !== null ? ` · step ${run.last_step}` : '';
    const devices = run.devices.length ? ` · ${[...new Set(run.devices)].join(', ')}` : '';
    const facts = `${run.state} · ${where} · ${run.ranks} ranks${devices}${step}`;
    row.appendChild(el('div', 'nbl-lab-facts', facts));
    row.appendChild(el('div', 'nbl-lab-when', [run.origin ? `from ${run.origin}` : '', when(run)].filter(Boolean).join(' · ')));
    if (run.kind === 'pool' && run.state === 'running') {
      row.appendChild(el('div', 'nbl-lab-holder', holderText(run)));
    }
    if (run.cause) {
      row.appendChild(el('div', 'nbl-lab-cause', run.cause));
    }
    row.title = `${run.run_dir}\nstarted ${clock(run.started)}`;
    row.onclick = () => this.host.open(run.id);
    return row;
  }
}

// One run in the main area: header and Stop, rank badges (or grid), charts, cause, all ranks.
// It follows the run's event stream (a picture at each change, until the run ended); where
// the stream cannot be read it asks every second instead. Closing its tab disposes it, which
// aborts the stream: a closed view holds none of the browser's six connections to the server.
class RunView extends Widget {
  private timer = 0;
  private tag = '';
  private aborter = new AbortController();
  private ended = false;
  private run: IRecord | null = null;

  constructor(
    private runId: string,
    private host: IHost
  ) {
    super();
    this.id = viewId(runId);
    this.node.dataset.runId = runId;
    this.addClass('nbl-lab-view');
    this.title.label = runId;
    this.title.icon = icon;
    this.title.closable = true;
    void this.follow();
  }

  protected onCloseRequest(msg: Message): void {
    super.onCloseRequest(msg);
    this.dispose();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    window.clearInterval(this.timer);
    this.aborter.abort();
    super.dispose();
  }

  private draw(run: any): void {
    this.tag = run.tag;
    this.ended = run.state !== 'running';
    this.run = run as IRecord;
    this.title.label = run.name && run.name !== "a kernel's run" ? `${run.name} · ${run.id}` : run.id;
    this.render(run as IRecord, run.view as IView);
  }

  private failed(status: number | string): void {
    this.node.replaceChildren(el('div', 'nbl-lab-error', `run ${this.runId}: the server answered ${status}`));
  }

  async follow(): Promise<void> {
    const signal = this.aborter.signal;
    while (!this.isDisposed && !this.ended) {
      let response: Response;
      try {
        response = await api(runPath(this.runId, '/events'), 'GET', signal);
      } catch {
        break;
      }
      if (!response.ok || !response.body) {
        this.failed(response.status);
        return;
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = '';
      for (;;) {
        const { value, done } = await reader.read().catch(() => ({ value: undefined, done: true }));
        if (done || this.isDisposed) {
          break;
        }
        buffer += decoder.decode(value, { stream: true });
        let cut: number;
        while ((cut = buffer.indexOf('\n\n')) >= 0) {
          const message = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          if (message.startsWith('data: ')) {
            this.draw(JSON.parse(message.slice(6)));
          }
        }
      }
      if (!this.tag || this.isDisposed) {
        break; // nothing came through: read it the plain way
      }
      await new Promise(resolve => window.setTimeout(resolve, VIEW_EVERY_MS)); // then again
    }
    if (!this.isDisposed && !this.ended) {
      this.timer = window.setInterval(() => void this.refresh(), VIEW_EVERY_MS);
    }
  }

  async refresh(): Promise<void> {
    let response: Response;
    try {
      response = await api(runPath(this.runId, `?since=${encodeURIComponent(this.tag)}`), 'GET', this.aborter.signal);
    } catch {
      return; // aborted, or the server is away: the next tick asks again
    }
    if (response.status === 304) {
      return;
    }
    if (!response.ok) {
      this.failed(response.status);
      window.clearInterval(this.timer);
      return;
    }
    this.draw(await response.json());
    if (this.ended) {
      window.clearInterval(this.timer); // the picture will not change
    }
  }

  private async stop(button: HTMLButtonElement): Promise<void> {
    const what = this.run?.kind === 'pool' ? 'pool' : 'run';
    const answer = await showDialog({
      title: `Stop the ${what} ${this.runId}?`,
      body:
        what === 'pool'
          ? 'Its ranks end, and the names the notebook defined on them are gone.'
          : 'Its ranks are stopped (SIGTERM to its run host, as nblaunch runs stop does); what they logged stays.',
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Stop' })]
    });
    if (!answer.button.accept || this.isDisposed) {
      return;
    }
    button.disabled = true;
    button.textContent = 'Stopping…';
    const response = await api(runPath(this.runId, '/stop'), 'POST');
    const reply = response.ok ? await response.json() : null;
    const state = this.node.querySelector('.nbl-lab-run-state');
    if (reply && state && reply.state !== 'running') {
      state.textContent = String(reply.state).toUpperCase(); // the stream follows with the rest
    }
  }

  private links(run: IRecord): HTMLElement {
    const box = el('div', 'nbl-lab-links');
    // The run directory in the file browser, when Jupyter shows it (not under a hidden folder
    // such as the default .nblaunch); the logs from the server extension, in a browser tab.
    if (run.folder !== null && !run.folder.split('/').some(part => part.startsWith('.'))) {
      const folder = el('a', 'nbl-lab-link nbl-lab-folder', run.run_dir);
      folder.onclick = () => this.host.goTo(run.folder as string);
      box.appendChild(folder);
    } else {
      box.appendChild(el('span', 'nbl-lab-dir', run.run_dir));
    }
    const settings = ServerConnection.makeSettings();
    for (const log of [...run.logs, ...(run.detached ? ['host.log'] : [])]) {
      const link = el('a', 'nbl-lab-link nbl-lab-log-link', log) as HTMLAnchorElement;
      link.href = URLExt.join(settings.baseUrl, 'nblaunch/api', runPath(run.id, `/logs/${log}`));
      link.target = '_blank';
      link.rel = 'noopener';
      box.appendChild(link);
    }
    return box;
  }

  private render(run: IRecord, view: IView): void {
    const root = el('div', `nbl-lab-root nbl-lab-state-${run.state}`);
    const header = el('div', 'nbl-lab-header');
    header.appendChild(el('span', 'nbl-lab-title', run.name));
    header.appendChild(el('span', 'nbl-lab-id', `${run.kind} ${run.id}`));
    header.appendChild(el('span', 'nbl-lab-badge nbl-lab-run-state', run.state.toUpperCase()));
    if (run.detached && run.state === 'running') {
      const button = el('button', 'jp-mod-styled jp-mod-warn nbl-lab-stop', 'Stop');
      button.onclick = () => void this.stop(button as HTMLButtonElement);
      header.appendChild(button);
    }
    if (run.detached && run.state === 'running') {
      const code = run.kind === 'pool' ? `pool = nblaunch.attach_pool("${run.id}")` : `run = nblaunch.attach("${run.id}")`;
      const attach = el('button', 'jp-mod-styled nbl-lab-attach', 'Insert attach');
      attach.title = `insert a cell with ${code} below the current notebook's active cell`;
      attach.onclick = () => {
        if (!this.host.insert(`import nblaunch\n${code}`)) {
          Notification.warning('Open a notebook first: the cell goes into the current notebook.');
        }
      };
      header.appendChild(attach);
    }
    root.appendChild(header);
    const info = view.info;
    const facts = [
      `${run.ranks} ranks`,
      info.device_kind || '',
      info.checks || '',
      run.pid ? `host pid ${run.pid}` : '',
      run.origin ? `from ${run.origin}` : '',
      when(run),
      run.ended ? `ended ${clock(run.ended)}` : ''
    ];
    root.appendChild(el('div', 'nbl-lab-facts', facts.filter(Boolean).join(' · ')));
    root.appendChild(this.links(run));
    if (run.kind === 'pool' && run.state === 'running') {
      const holder = el('div', 'nbl-lab-holder', holderText(run));
      const path = run.holder?.kernel?.path;
      if (path) {
        const open = el('a', 'nbl-lab-link', 'open the notebook');
        open.onclick = () => this.host.openPath(path);
        holder.appendChild(document.createTextNode(' · '));
        holder.appendChild(open);
      }
      root.appendChild(holder);
    }
    if (view.last_step !== null) {
      root.appendChild(el('div', 'nbl-lab-step', `last step ${view.last_step}`));
    }
    root.appendChild(this.ranks(view));
    for (const diagnosis of view.diagnoses) {
      const box = el('div', `nbl-lab-diagnosis nbl-lab-${diagnosis.severity}`);
      box.appendChild(el('div', 'nbl-lab-diagnosis-title', diagnosis.title));
      const body = el('pre');
      body.appendChild(ansi(diagnosis.body));
      box.appendChild(body);
      root.appendChild(box);
    }
    for (const [name, byRank] of Object.entries(view.metrics)) {
      root.appendChild(chart(name, byRank));
    }
    const all = el('details', 'nbl-lab-all');
    all.appendChild(el('summary', '', `All ranks (last ${view.lines.length} lines)`));
    const log = el('pre', 'nbl-lab-log');
    for (const [rank, text] of view.lines) {
      log.appendChild(document.createTextNode(`[${rank}] `));
      log.appendChild(ansi(text));
      log.appendChild(document.createTextNode('\n'));
    }
    all.appendChild(log);
    const wasOpen = this.node.querySelector('.nbl-lab-all') as HTMLDetailsElement | null;
    (all as HTMLDetailsElement).open = wasOpen ? wasOpen.open : false;
    root.appendChild(all);
    if (view.ended) {
      const seconds = view.ended.elapsed_s.toFixed(1);
      const outcomes = Object.entries(view.ended.ranks).map(([r, text]) => `rank ${r}: ${text}`);
      const text = `finished in ${seconds} s${outcomes.length ? ' · ' + outcomes.join(' · ') : ''}`;
      root.appendChild(el('div', 'nbl-lab-summary', text));
    }
    this.node.replaceChildren(root);
  }

  private ranks(view: IView): HTMLElement {
    const entries = Object.entries(view.ranks);
    const box = el('div', entries.length >= GRID_FROM ? 'nbl-lab-grid' : 'nbl-lab-ranks');
    for (const [rank, state] of entries) {
      const last = state.lines.length ? state.lines[state.lines.length - 1] : '';
      if (entries.length >= GRID_FROM) {
        const cell = el('span', `nbl-lab-cell nbl-lab-rank-${state.state}`);
        cell.title = `rank ${rank} · ${state.state} · ${state.device}\n${strip(last)}`;
        box.appendChild(cell);
        continue;
      }
      const badge = el('div', `nbl-lab-rank nbl-lab-rank-${state.state}`);
      badge.appendChild(el('span', 'nbl-lab-rank-name', `rank ${rank} · ${state.state}`));
      badge.appendChild(el('span', 'nbl-lab-device', state.device));
      badge.appendChild(ansi(state.detail || last, 'nbl-lab-last'));
      box.appendChild(badge);
    }
    return box;
  }
}

// A line without its ANSI escapes (a tooltip cannot colour).
function strip(text: string): string {
  // eslint-disable-next-line no-control-regex
  return text.replace(/\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]|\r/g, '');
}

const COLOURS = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2'];

// One metric's chart: a polyline per rank, scaled to the points' range.
function chart(name: string, byRank: { [rank: string]: [number, number | null][] }): HTMLElement {
  const [width, height] = [360, 120];
  const points = Object.values(byRank).flat().filter(p => p[1] !== null) as [number, number][];
  const box = el('div', 'nbl-lab-chart');
  box.appendChild(el('div', 'nbl-lab-chart-name', name));
  if (!points.length) {
    return box;
  }
  const xs = points.map(p => p[0]);
  const ys = points.map(p => p[1]);
  const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  const sx = (x: number) => (x1 > x0 ? ((x - x0) / (x1 - x0)) * (width - 8) + 4 : width / 2);
  const sy = (y: number) => (y1 > y0 ? height - 4 - ((y - y0) / (y1 - y0)) * (height - 8) : height / 2);
  const svgNs = 'http://www.w3.org/2000/svg';
  const svg = document.createElementNS(svgNs, 'svg');
  svg.setAttribute('width', String(width));
  svg.setAttribute('height', String(height));
  Object.entries(byRank).forEach(([rank, series], i) => {
    const line = document.createElementNS(svgNs, 'polyline');
    const kept = series.filter(p => p[1] !== null) as [number, number][];
    line.setAttribute('points', kept.map(([x, y]) => `${sx(x)},${sy(y)}`).join(' '));
    line.setAttribute('fill', 'none');
    line.setAttribute('stroke', COLOURS[i % COLOURS.length]);
    line.setAttribute('data-rank', rank);
    svg.appendChild(line);
  });
  box.appendChild(svg);
  const range = `steps ${x0} … ${x1} · values ${y0.toPrecision(3)} … ${y1.toPrecision(3)}`;
  box.appendChild(el('div', 'nbl-lab-chart-range', range));
  const legend = el('div', 'nbl-lab-legend');
  Object.keys(byRank).forEach((rank, i) => {
    const key = el('span', '', `rank ${rank}`);
    key.style.borderLeft = `12px solid ${COLOURS[i % COLOURS.length]}`;
    legend.appendChild(key);
  });
  box.appendChild(legend);
  return box;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'nblaunch-lab:plugin',
  description: "nblaunch's runs panel: this user's runs and pools, live, without a kernel.",
  autoStart: true,
  optional: [INotebookTracker],
  activate: (app: JupyterFrontEnd, notebooks: INotebookTracker | null) => {
    const host: IHost = {
      open: (id: string) => {
        const known = Array.from(app.shell.widgets('main')).find(w => w.id === viewId(id));
        if (known) {
          app.shell.activateById(known.id);
          return;
        }
        const view = new RunView(id, host);
        app.shell.add(view, 'main');
        app.shell.activateById(view.id);
      },
      openPath: (path: string) => void app.commands.execute('docmanager:open', { path }),
      goTo: (folder: string) => void app.commands.execute('filebrowser:go-to-path', { path: folder }),
      insert: (code: string) => {
        const panel = notebooks?.currentWidget;
        if (!panel) {
          return false;
        }
        NotebookActions.insertBelow(panel.content);
        panel.content.activeCell?.model.sharedModel.setSource(code);
        app.shell.activateById(panel.id);
        return true;
      }
    };
    app.shell.add(new RunsPanel(host), 'left', { rank: 900 });
  }
};

export default plugin;
