/**
 * The "Sky" side panel: every pool of this Jupyter server's kernels, refreshed on change: a fast
 * poll of the listing's digest (`GET /skyward/stamp`, a few times a second) fetches the listing
 * as soon as it changes, and a slower one keeps uptimes and costs current. Both back off when the
 * server fails and stand by while the panel or the browser tab is hidden.
 *
 * Each pool is titled by its notebook and name (a click opens the notebook); a pool whose kernel
 * or ranks ended is `gone`, greyed, and the header's "Clean up" ends all of those at once.
 *
 * The DOM is rebuilt from each listing (a few pools, a few nodes each), keeping what the user
 * chose: which pools are expanded, which shut-downs are in flight, the last message.
 *
 * The slow poll's state is written on the panel's node (`data-poll`: its phase,
 * `data-poll-interval`: milliseconds to the next tick, `data-poll-ticks`: ticks so far), so that
 * its back-off and standby can be seen from the outside (the browser tests read them).
 */

import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Poll } from '@lumino/polling';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { cleanGonePools, listingStamp, listPools, RequestError, shutDownPool } from './api';
import {
  cleanMessage,
  cleanText,
  confirmText,
  describeNode,
  formatCost,
  formatDuration,
  GONE,
  gonePools,
  INode,
  IPool,
  ownerText,
  poolTitle,
  shutdownMessage,
  sortPools,
  stateClass,
  stateMeaning,
  summary,
  Vocabulary
} from './model';

/** Milliseconds between listings while all is well (uptime, cost); failures back off to `MAX_INTERVAL`. */
const INTERVAL = 3000;
const MAX_INTERVAL = 30000;
/** Milliseconds between asks for the listing's digest: how soon a change shows. */
const STAMP_INTERVAL = 400;

type Attributes = Record<string, string>;

function h(tag: string, attrs: Attributes = {}, ...children: (Node | string)[]): HTMLElement {
  const element = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    element.setAttribute(key, value);
  }
  element.append(...children);
  return element;
}

/** Open (or bring to the front) the notebook at a path under the server's root. */
export type OpenNotebook = (path: string) => void;

export class SkyPanel extends Widget {
  constructor(openNotebook: OpenNotebook) {
    super();
    this._openNotebook = openNotebook;
    this.id = 'skyward-pools';
    this.addClass('sky-lab');
    this.title.caption = 'Sky: the pools of this server’s kernels';

    this._message = h('div', { class: 'sky-lab-message', role: 'status' });
    this._list = h('ul', { class: 'sky-lab-pools' });
    const refresh = h('button', { class: 'sky-lab-refresh jp-Button', title: 'Refresh now' }, '↻');
    refresh.addEventListener('click', () => void this._poll.refresh());
    this._clean = h('button', { class: 'sky-lab-clean jp-Button' }) as HTMLButtonElement;
    this._clean.addEventListener('click', () => void this._cleanUp());
    this.node.append(
      h('header', { class: 'sky-lab-header' }, h('h2', {}, 'Sky pools'), this._clean, refresh),
      this._message,
      this._list
    );

    this._poll = new Poll({
      factory: () => this._update(),
      frequency: { interval: INTERVAL, backoff: true, max: MAX_INTERVAL },
      standby: () => !this.isVisible || 'when-hidden',
      name: 'skyward:pools'
    });
    this._poll.ticked.connect((_, state) => {
      this.node.dataset.poll = state.phase;
      this.node.dataset.pollInterval = String(state.interval);
      this.node.dataset.pollTicks = String(++this._ticks);
    });
    this._stampPoll = new Poll({
      factory: () => this._checkStamp(),
      frequency: { interval: STAMP_INTERVAL, backoff: true, max: MAX_INTERVAL },
      standby: () => !this.isVisible || 'when-hidden',
      name: 'skyward:pools-stamp'
    });
  }

  dispose(): void {
    this._poll.dispose();
    this._stampPoll.dispose();
    super.dispose();
  }

  /** A new digest means a new listing: fetch it now rather than at the slow poll's next tick. */
  private async _checkStamp(): Promise<void> {
    if (!this._loaded || this._listError) {
      return; // the slow poll (and its back-off) is in charge until a listing arrives
    }
    if ((await listingStamp()) !== this._stamp) {
      await this._poll.refresh();
    }
  }

  /** Showing the panel refreshes at once rather than at the next tick. */
  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    void this._poll.refresh();
  }

  private async _update(): Promise<void> {
    try {
      const listing = await listPools();
      this._pools = sortPools(listing.pools);
      this._stamp = listing.stamp;
      this._words = listing.states;
      this._loaded = true;
      this._listError = '';
    } catch (error) {
      this._listError = error instanceof RequestError ? error.message : String(error);
      this._render();
      throw error; // the poll backs off
    }
    this._render();
  }

  private _render(): void {
    const message = this._listError || this._note;
    this._message.textContent = message;
    this._message.className = 'sky-lab-message' + (this._listError || this._noteIsError ? ' sky-lab-error' : '');
    this._message.hidden = !message;

    const gone = gonePools(this._pools);
    this._clean.textContent = this._cleaning ? 'Cleaning…' : `Clean up ${gone.length} gone`;
    this._clean.title = gone.length ? cleanText(gone) : '';
    this._clean.hidden = !gone.length && !this._cleaning;
    this._clean.disabled = this._cleaning;

    const items = this._pools.map(pool => this._renderPool(pool));
    if (!items.length && this._loaded) {
      items.push(
        h(
          'li',
          { class: 'sky-lab-empty' },
          'No pools. A %%sky cell in any notebook of this server starts one.'
        )
      );
    }
    this._list.replaceChildren(...items);
  }

  private _renderPool(pool: IPool): HTMLElement {
    const expanded = this._expanded.has(pool.id);
    const stopping = this._stopping.has(pool.id) || pool.shutdown_requested;
    const gone = pool.state === GONE;

    const toggle = h(
      'button',
      {
        class: 'sky-lab-toggle',
        'aria-expanded': String(expanded),
        title: expanded ? 'Hide nodes' : 'Show nodes'
      },
      expanded ? '▾' : '▸'
    );
    toggle.addEventListener('click', () => {
      if (!this._expanded.delete(pool.id)) {
        this._expanded.add(pool.id);
      }
      this._render();
    });

    const notebook = pool.notebook;
    const title = h(
      notebook ? 'a' : 'span',
      notebook
        ? { class: 'sky-lab-title', href: '#', title: `Open ${notebook}` }
        : { class: 'sky-lab-title' },
      poolTitle(pool)
    );
    if (notebook) {
      title.addEventListener('click', event => {
        event.preventDefault();
        this._openNotebook(notebook);
      });
    }

    const state = h(
      'span',
      {
        class: `sky-lab-state ${stateClass(pool.state, this._words)}`,
        'data-state': pool.state,
        title: stateMeaning(pool.state, this._words)
      },
      pool.state
    );

    const button = h(
      'button',
      { class: 'sky-lab-shutdown jp-Button', title: confirmText(pool) },
      stopping ? 'Shutting down…' : pool.orphan ? 'Reap' : 'Shut down'
    ) as HTMLButtonElement;
    button.disabled = stopping;
    button.addEventListener('click', () => void this._shutDown(pool));

    const details = [summary(pool), gone ? '' : formatDuration(pool.uptime_s), formatCost(pool.cost)]
      .filter(Boolean)
      .join(' · ');

    const item = h(
      'li',
      {
        class: 'sky-lab-pool' + (gone ? ' sky-lab-gone' : ''),
        'data-pool-id': pool.id,
        'data-pool-name': pool.name,
        'data-state': pool.state,
        'data-orphan': String(pool.orphan)
      },
      h('div', { class: 'sky-lab-pool-head' }, toggle, title, button),
      h('div', { class: 'sky-lab-pool-line' }, state, h('span', { class: 'sky-lab-details' }, details))
    );
    const owner = ownerText(pool);
    if (owner) {
      item.append(h('div', { class: 'sky-lab-owner' }, owner));
    }
    if (expanded) {
      item.append(this._renderNodes(pool.nodes, gone));
    }
    return item;
  }

  /** The node table; a gone pool's nodes say what was last heard of them, greyed with it. */
  private _renderNodes(nodes: INode[], gone: boolean): HTMLElement {
    const rows = nodes.map(node =>
      h(
        'tr',
        { class: 'sky-lab-node', 'data-state': node.state },
        h('td', {}, String(node.index)),
        h('td', {}, describeNode(node)),
        h(
          'td',
          {},
          h(
            'span',
            {
              class: `sky-lab-state ${stateClass(node.state, this._words)}`,
              title: (gone ? 'last heard: ' : '') + stateMeaning(node.state, this._words)
            },
            node.state
          )
        )
      )
    );
    if (!rows.length) {
      rows.push(h('tr', {}, h('td', { colspan: '3' }, 'no nodes yet')));
    }
    return h(
      'table',
      { class: 'sky-lab-nodes' },
      h('thead', {}, h('tr', {}, h('th', {}, 'node'), h('th', {}, 'machine'), h('th', {}, 'state'))),
      h('tbody', {}, ...rows)
    );
  }

  private async _shutDown(pool: IPool): Promise<void> {
    const answer = await showDialog({
      title: pool.orphan ? 'Reap orphaned pool' : 'Shut down pool',
      body: confirmText(pool),
      buttons: [
        Dialog.cancelButton(),
        Dialog.warnButton({ label: pool.orphan ? 'Reap' : 'Shut down' })
      ]
    });
    if (!answer.button.accept) {
      return;
    }
    this._stopping.add(pool.id);
    this._render();
    try {
      this._setNote(shutdownMessage(await shutDownPool(pool.id, pool.name)), false);
    } catch (error) {
      this._setNote(error instanceof RequestError ? error.message : String(error), true);
    } finally {
      this._stopping.delete(pool.id);
      void this._poll.refresh();
    }
  }

  private async _cleanUp(): Promise<void> {
    const gone = gonePools(this._pools);
    const answer = await showDialog({
      title: 'Clean up gone pools',
      body: cleanText(gone),
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Clean up' })]
    });
    if (!answer.button.accept) {
      return;
    }
    this._cleaning = true;
    this._render();
    try {
      this._setNote(cleanMessage(await cleanGonePools()), false);
    } catch (error) {
      this._setNote(error instanceof RequestError ? error.message : String(error), true);
    } finally {
      this._cleaning = false;
      void this._poll.refresh();
    }
  }

  private _setNote(text: string, isError: boolean): void {
    this._note = text;
    this._noteIsError = isError;
    this._render();
  }

  private readonly _openNotebook: OpenNotebook;
  private readonly _poll: Poll;
  private readonly _stampPoll: Poll;
  private readonly _clean: HTMLButtonElement;
  private _cleaning = false;
  /** The digest of the listing shown; the fast poll compares the server's with it. */
  private _stamp = '';
  private _words: Vocabulary = {};
  private _ticks = 0;
  private readonly _message: HTMLElement;
  private readonly _list: HTMLElement;
  private readonly _expanded = new Set<string>();
  private readonly _stopping = new Set<string>();
  private _pools: IPool[] = [];
  /** Whether a listing ever arrived: until then, "no pools" would be a guess. */
  private _loaded = false;
  private _listError = '';
  private _note = '';
  private _noteIsError = false;
}
