/**
 * What the Sky panel shows, computed from the server's replies without touching the DOM or
 * JupyterLab, so that it can be tested under plain Node.
 *
 * The shapes mirror `skyward_jupyter/server/pools.py` (the REST routes' pool object).
 */

/**
 * A state's word, as every view of a pool says it: the rank states (`provisioning` ... `terminated`)
 * and `gone`, a record whose kernel or ranks ended. The words, their tones and meanings come from
 * the server with each listing (`skyward_jupyter/model.py`, `STATE_WORDS`): one vocabulary for
 * the notebook's panel, this panel and the text.
 */
export type State = string;

/** The word `gone`: what the server says of a record whose kernel or ranks are no more. */
export const GONE = 'gone';

export interface IStateWord {
  word: string;
  /** `starting`, `good`, `busy`, `bad` or `over`: the colour group. */
  tone: string;
  meaning: string;
}

export type Vocabulary = Record<string, IStateWord>;

export interface IRank {
  rank: number;
  local_rank: number;
  state: State;
  pid: number | null;
  hostname: string | null;
}

export interface INode {
  index: number;
  address: string;
  gpus: number;
  gpu_type: string | null;
  instance_type: string | null;
  state: State;
  ranks: IRank[];
}

export interface IPool {
  id: string;
  name: string;
  provider: string;
  description: string;
  state: State;
  ready: boolean;
  nodes_requested: number;
  world_size: number;
  backend: string | null;
  started_at: number | null;
  kernel_id: string | null;
  /** The path of its kernel's notebook (under the server's root) where a session has one. */
  notebook: string | null;
  /** Why the record no longer describes a running pool (its state is then `gone`). */
  gone_why: string | null;
  owner: { pid: number | null; host: string | null; alive: boolean | null };
  orphan: boolean;
  shutdown_requested: boolean;
  uptime_s: number | null;
  cost: { price_per_hour: number | null; spent: number | null; currency: string | null };
  nodes: INode[];
}

export interface IListing {
  pools: IPool[];
  now: number;
  /** A digest of the listing that changes when it does (`GET /skyward/stamp` says it alone). */
  stamp: string;
  states: Vocabulary;
}

/** The reply of `DELETE /skyward/pools?gone=1`. */
export interface ICleanReply {
  cleaned: IShutdownReply[];
}

/** The reply of `DELETE /skyward/pools/<id>`. */
export interface IShutdownReply {
  id: string;
  name: string | null;
  how: 'kernel' | 'requested' | 'reaped';
  killed?: number[];
  notes?: string[];
}

/** A state's colour class, from its tone in the server's vocabulary (unknown: `over`). */
export function stateClass(state: State, words: Vocabulary): string {
  return `sky-tone-${words[state]?.tone ?? 'over'}`;
}

/** What a state means, for its tooltip. */
export function stateMeaning(state: State, words: Vocabulary): string {
  return words[state]?.meaning ?? '';
}

/** A pool's title: its notebook's file name and the pool's name, as `train.ipynb · default`. */
export function poolTitle(pool: IPool): string {
  const notebook = pool.notebook?.split('/').pop();
  return notebook ? `${notebook} · ${pool.name}` : pool.name;
}

/** The pools that are `gone`: those the header's "Clean up" removes together. */
export function gonePools(pools: IPool[]): IPool[] {
  return pools.filter(pool => pool.state === GONE);
}

/** The confirmation of "Clean up". */
export function cleanText(gone: IPool[]): string {
  const names = gone.map(poolTitle).join(', ');
  return (
    `Clean up ${gone.length} gone pool${gone.length === 1 ? '' : 's'} (${names})? ` +
    'Their kernels or ranks ended; what they left running is ended and their records removed.'
  );
}

/** What the panel says after "Clean up". */
export function cleanMessage(reply: ICleanReply): string {
  const n = reply.cleaned.length;
  if (!n) {
    return 'Nothing to clean: no pool is gone.';
  }
  const killed = reply.cleaned.reduce((sum, r) => sum + (r.killed?.length ?? 0), 0);
  return (
    `Cleaned ${n} gone pool${n === 1 ? '' : 's'}: ` +
    `${killed} process${killed === 1 ? '' : 'es'} ended.`
  );
}

/** `42 s`, `3 min`, `2 h 05 min`: an uptime at a glance. */
export function formatDuration(seconds: number | null): string {
  if (seconds === null || !isFinite(seconds) || seconds < 0) {
    return '';
  }
  if (seconds < 60) {
    return `${Math.floor(seconds)} s`;
  }
  const minutes = Math.floor(seconds / 60);
  if (minutes < 60) {
    return `${minutes} min`;
  }
  const hours = Math.floor(minutes / 60);
  return `${hours} h ${String(minutes % 60).padStart(2, '0')} min`;
}

/** `$2.10/h · $0.35 so far`, or '' where the provider has no prices (local, SSH). */
export function formatCost(cost: IPool['cost']): string {
  if (cost.price_per_hour === null || cost.price_per_hour === undefined) {
    return '';
  }
  const sign = !cost.currency || cost.currency === 'USD' ? '$' : `${cost.currency} `;
  const rate = `${sign}${cost.price_per_hour.toFixed(2)}/h`;
  return cost.spent === null ? rate : `${rate} · ${sign}${cost.spent.toFixed(2)} so far`;
}

/** The pool's one-line summary: provider, nodes × ranks, backend. */
export function summary(pool: IPool): string {
  const nodes = pool.nodes.length || pool.nodes_requested;
  const perNode = nodes ? Math.round(pool.world_size / nodes) : 0;
  const shape = `${nodes} node${nodes === 1 ? '' : 's'}` + (perNode > 1 ? ` × ${perNode}` : '');
  return [pool.provider, shape, pool.backend ?? ''].filter(Boolean).join(' · ');
}

/** What a node row says about its machine. */
export function describeNode(node: INode): string {
  const parts = [node.address];
  if (node.instance_type) {
    parts.push(node.instance_type);
  }
  if (node.gpus > 0) {
    parts.push(`${node.gpus} × ${node.gpu_type ?? 'GPU'}`);
  }
  parts.push(`${node.ranks.length} rank${node.ranks.length === 1 ? '' : 's'}`);
  return parts.join(' · ');
}

/** Who holds a pool, under its title: why it is gone, else its kernel where no notebook (the
 * title) says it. */
export function ownerText(pool: IPool): string {
  if (pool.gone_why) {
    return `gone: ${pool.gone_why}`;
  }
  if (pool.orphan) {
    return 'kernel not of this server';
  }
  if (pool.notebook) {
    return '';
  }
  return pool.kernel_id ? `kernel ${pool.kernel_id.slice(0, 8)}` : 'a process outside this server';
}

/** Live pools by title (notebook, then name), then the gone ones, greyed, at the end. */
export function sortPools(pools: IPool[]): IPool[] {
  const gone = (pool: IPool) => Number(pool.state === GONE);
  return [...pools].sort(
    (a, b) =>
      gone(a) - gone(b) || poolTitle(a).localeCompare(poolTitle(b)) || a.id.localeCompare(b.id)
  );
}

/** The confirmation a user must accept before a pool goes. */
export function confirmText(pool: IPool): string {
  return pool.orphan
    ? `Reap orphaned pool "${pool.name}"? Its kernel is gone; its ranks will be killed.`
    : `Shut down pool "${pool.name}"? A running cell is interrupted and its ranks end.`;
}

/** What the panel says after a shut-down request. */
export function shutdownMessage(reply: IShutdownReply): string {
  const name = reply.name ?? reply.id;
  switch (reply.how) {
    case 'kernel':
      return `Pool "${name}" was shut down by its kernel.`;
    case 'requested':
      return `Pool "${name}": shutdown requested; its kernel is busy and will end it.`;
    default: {
      const killed = reply.killed?.length ?? 0;
      const notes = reply.notes?.length ? ` ${reply.notes.join(' ')}` : '';
      return `Orphaned pool "${name}" reaped: ${killed} process${killed === 1 ? '' : 'es'} ended.${notes}`;
    }
  }
}

/**
 * A failed request, in words a user can act on. `status` is the HTTP status (0 when the server
 * could not be reached), `detail` the server's message if it sent one.
 */
export function describeFailure(status: number, detail: string, action: string): string {
  if (status === 0) {
    return `Cannot reach the Jupyter server to ${action}; retrying with back-off.`;
  }
  if (status === 404 && action === 'list pools') {
    return (
      'The skyward_jupyter server extension is not enabled on this Jupyter server: ' +
      'run `jupyter server extension enable skyward_jupyter` and restart it.'
    );
  }
  if (status === 403) {
    return `Not allowed to ${action}: this server does not let you manage kernels.`;
  }
  const why = detail ? `: ${detail}` : '';
  return `Could not ${action} (HTTP ${status})${why}.`;
}
