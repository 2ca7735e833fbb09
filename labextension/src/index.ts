// nblaunch's runs panel: a left sidebar list of this user's runs and pools (from the server
// extension's /nblaunch/api/runs) and, for the one clicked, a main-area view of it, polled
// while it runs. Plain DOM in Lumino widgets: no kernel, no React.
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

const LIST_EVERY_MS = 2000;
const VIEW_EVERY_MS = 1000;
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

async function api(path: string, method = 'GET'): Promise<Response> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'nblaunch/api', path);
  return ServerConnection.makeRequest(url, { method }, settings);
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

// The sidebar: every run and pool, state by colour, a failed run's cause under it.
class RunsPanel extends Widget {
  private timer = 0;

  constructor(private open: (id: string) => void) {
    super();
    this.id = 'nblaunch-runs';
    this.addClass('nbl-lab-panel');
    this.title.icon = icon;
    this.title.caption = 'nblaunch runs';
    this.node.appendChild(el('h2', 'nbl-lab-heading', 'nblaunch runs'));
    this.node.appendChild(el('div', 'nbl-lab-list'));
    void this.refresh();
    this.timer = window.setInterval(() => void this.refresh(), LIST_EVERY_MS);
  }

  dispose(): void {
    window.clearInterval(this.timer);
    super.dispose();
  }

  async refresh(): Promise<void> {
    if (!this.isVisible && this.node.querySelector('.nbl-lab-run')) {
      return; // hidden: no need to ask
    }
    const list = this.node.querySelector('.nbl-lab-list') as HTMLElement;
    let runs: IRecord[];
    try {
      const response = await api('runs');
      if (!response.ok) {
        list.textContent = `the nblaunch server extension answered ${response.status}`;
        return;
      }
      runs = (await response.json()).runs;
    } catch (error) {
      list.textContent = `cannot reach the nblaunch server extension: ${error}`;
      return;
    }
    list.replaceChildren();
    if (!runs.length) {
      list.appendChild(el('div', 'nbl-lab-empty', 'no runs yet'));
    }
    for (const run of runs) {
      const row = el('div', `nbl-lab-run nbl-lab-state-${run.state}`);
      row.dataset.id = run.id;
      row.appendChild(el('span', 'nbl-lab-dot'));
      row.appendChild(el('span', 'nbl-lab-id', run.id));
      const where = run.kind === 'pool' ? 'pool' : run.detached ? 'detached' : 'kernel';
      const step = run.last_step !== null ? ` · step ${run.last_step}` : '';
      const devices = run.devices.length ? ` · ${[...new Set(run.devices)].join(', ')}` : '';
      const facts = `${run.state} · ${where} · ${run.ranks} ranks${devices}${step}`;
      row.appendChild(el('div', 'nbl-lab-facts', facts));
      if (run.kind === 'pool' && run.state === 'running') {
        row.appendChild(el('div', 'nbl-lab-holder', holderText(run)));
      }
      if (run.cause) {
        row.appendChild(el('div', 'nbl-lab-cause', run.cause));
      }
      row.title = `${run.run_dir}\nstarted ${clock(run.started)}`;
      row.onclick = () => this.open(run.id);
      list.appendChild(row);
    }
  }
}

// One run in the main area: header and Stop, rank badges (or grid), charts, cause, all ranks.
// It follows the run's event stream (a picture at each change, until the run ended); where
// the stream cannot be read it asks every second instead.
class RunView extends Widget {
  private timer = 0;
  private tag = '';
  private reader: ReadableStreamDefaultReader<Uint8Array> | null = null;
  private ended = false;

  constructor(private runId: string) {
    super();
    this.id = `nblaunch-run-${runId}`;
    this.addClass('nbl-lab-view');
    this.title.label = runId;
    this.title.icon = icon;
    this.title.closable = true;
    void this.follow();
  }

  dispose(): void {
    window.clearInterval(this.timer);
    void this.reader?.cancel();
    super.dispose();
  }

  private draw(run: any): void {
    this.tag = run.tag;
    this.ended = run.state !== 'running';
    this.render(run as IRecord, run.view as IView);
  }

  async follow(): Promise<void> {
    while (!this.isDisposed && !this.ended) {
      let response: Response;
      try {
        response = await api(`runs/${this.runId}/events`);
      } catch {
        break;
      }
      if (!response.ok || !response.body) {
        this.node.textContent = `run ${this.runId}: the server answered ${response.status}`;
        return;
      }
      this.reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = '';
      for (;;) {
        const { value, done } = await this.reader.read().catch(() => ({ value: undefined, done: true }));
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
      if (!this.tag) {
        break; // nothing came through: read it the plain way
      }
      await new Promise(resolve => window.setTimeout(resolve, VIEW_EVERY_MS)); // then again
    }
    if (!this.isDisposed && !this.ended) {
      this.timer = window.setInterval(() => void this.refresh(), VIEW_EVERY_MS);
    }
  }

  async refresh(): Promise<void> {
    const response = await api(`runs/${this.runId}?since=${this.tag}`);
    if (response.status === 304) {
      return;
    }
    if (!response.ok) {
      this.node.textContent = `run ${this.runId}: the server answered ${response.status}`;
      window.clearInterval(this.timer);
      return;
    }
    this.draw(await response.json());
    if (this.ended) {
      window.clearInterval(this.timer); // the picture will not change
    }
  }

  private async stop(button: HTMLButtonElement): Promise<void> {
    button.disabled = true;
    button.textContent = 'Stopping…';
    await api(`runs/${this.runId}/stop`, 'POST'); // the stream (or the poll) shows it end
  }

  private render(run: IRecord, view: IView): void {
    const root = el('div', `nbl-lab-root nbl-lab-state-${run.state}`);
    const header = el('div', 'nbl-lab-header');
    header.appendChild(el('span', 'nbl-lab-title', `${run.kind} ${run.id}`));
    header.appendChild(el('span', 'nbl-lab-badge nbl-lab-run-state', run.state.toUpperCase()));
    if (run.detached && run.state === 'running') {
      const button = el('button', 'jp-mod-styled jp-mod-warn nbl-lab-stop', 'Stop');
      button.onclick = () => void this.stop(button as HTMLButtonElement);
      header.appendChild(button);
    }
    root.appendChild(header);
    const info = view.info;
    const facts = [
      `${run.ranks} ranks`,
      info.device_kind || '',
      info.checks || '',
      run.pid ? `host pid ${run.pid}` : '',
      `started ${clock(run.started)}`,
      run.ended ? `ended ${clock(run.ended)}` : ''
    ];
    root.appendChild(el('div', 'nbl-lab-facts', facts.filter(Boolean).join(' · ')));
    root.appendChild(el('div', 'nbl-lab-dir', run.run_dir));
    if (run.kind === 'pool' && run.state === 'running') {
      root.appendChild(el('div', 'nbl-lab-holder', holderText(run)));
    }
    if (view.last_step !== null) {
      root.appendChild(el('div', 'nbl-lab-step', `last step ${view.last_step}`));
    }
    root.appendChild(this.ranks(view));
    for (const diagnosis of view.diagnoses) {
      const box = el('div', `nbl-lab-diagnosis nbl-lab-${diagnosis.severity}`);
      box.appendChild(el('div', 'nbl-lab-diagnosis-title', diagnosis.title));
      box.appendChild(el('pre', '', diagnosis.body));
      root.appendChild(box);
    }
    for (const [name, byRank] of Object.entries(view.metrics)) {
      root.appendChild(chart(name, byRank));
    }
    const all = el('details', 'nbl-lab-all');
    all.appendChild(el('summary', '', `All ranks (last ${view.lines.length} lines)`));
    all.appendChild(el('pre', 'nbl-lab-log', view.lines.map(([r, t]) => `[${r}] ${t}`).join('\n')));
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
        cell.title = `rank ${rank} · ${state.state} · ${state.device}\n${last}`;
        box.appendChild(cell);
        continue;
      }
      const badge = el('div', `nbl-lab-rank nbl-lab-rank-${state.state}`);
      badge.appendChild(el('span', 'nbl-lab-rank-name', `rank ${rank} · ${state.state}`));
      badge.appendChild(el('span', 'nbl-lab-device', state.device));
      badge.appendChild(el('div', 'nbl-lab-last', state.detail || last));
      box.appendChild(badge);
    }
    return box;
  }
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
  activate: (app: JupyterFrontEnd) => {
    const open = (id: string) => {
      const known = Array.from(app.shell.widgets('main')).find(w => w.id === `nblaunch-run-${id}`);
      if (known) {
        app.shell.activateById(known.id);
        return;
      }
      const view = new RunView(id);
      app.shell.add(view, 'main');
      app.shell.activateById(view.id);
    };
    app.shell.add(new RunsPanel(open), 'left', { rank: 900 });
  }
};

export default plugin;
