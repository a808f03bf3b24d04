/**
 * The "Sky" side panel: every pool of this Jupyter server's kernels, refreshed by a poll that
 * backs off when the server fails and stands by while the panel or the browser tab is hidden.
 *
 * The DOM is rebuilt from each listing (a few pools, a few nodes each), keeping what the user
 * chose: which pools are expanded, which shut-downs are in flight, the last message.
 *
 * The poll's state is written on the panel's node (`data-poll`: its phase, `data-poll-interval`:
 * milliseconds to the next tick, `data-poll-ticks`: ticks so far), so that its back-off and
 * standby can be seen from the outside (the browser tests read them).
 */

import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Poll } from '@lumino/polling';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { listPools, RequestError, shutDownPool } from './api';
import {
  confirmText,
  ownerText,
  describeNode,
  formatCost,
  formatDuration,
  INode,
  IPool,
  shutdownMessage,
  sortPools,
  stateClass,
  summary
} from './model';

/** Seconds between refreshes while all is well; failures back off up to `MAX_INTERVAL`. */
const INTERVAL = 3000;
const MAX_INTERVAL = 30000;

type Attributes = Record<string, string>;

function h(tag: string, attrs: Attributes = {}, ...children: (Node | string)[]): HTMLElement {
  const element = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    element.setAttribute(key, value);
  }
  element.append(...children);
  return element;
}

/** The notebook whose kernel owns a pool, where this lab knows it. */
export type NotebookOf = (kernelId: string) => string | null;

export class SkyPanel extends Widget {
  constructor(notebookOf: NotebookOf) {
    super();
    this._notebookOf = notebookOf;
    this.id = 'skyward-pools';
    this.addClass('sky-lab');
    this.title.caption = 'Sky: the pools of this server’s kernels';

    this._message = h('div', { class: 'sky-lab-message', role: 'status' });
    this._list = h('ul', { class: 'sky-lab-pools' });
    const refresh = h('button', { class: 'sky-lab-refresh jp-Button', title: 'Refresh now' }, '↻');
    refresh.addEventListener('click', () => void this._poll.refresh());
    this.node.append(
      h('header', { class: 'sky-lab-header' }, h('h2', {}, 'Sky pools'), refresh),
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
  }

  dispose(): void {
    this._poll.dispose();
    super.dispose();
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

    const toggle = h(
      'button',
      {
        class: 'sky-lab-toggle',
        'aria-expanded': String(expanded),
        title: expanded ? 'Hide nodes' : 'Show nodes'
      },
      expanded ? '▾' : '▸',
      h('span', { class: 'sky-lab-name' }, pool.name)
    );
    toggle.addEventListener('click', () => {
      if (!this._expanded.delete(pool.id)) {
        this._expanded.add(pool.id);
      }
      this._render();
    });

    const badges = [
      h('span', { class: `sky-lab-state ${stateClass(pool.state)}`, 'data-state': pool.state }, pool.state)
    ];
    if (pool.orphan) {
      badges.push(
        h(
          'span',
          { class: 'sky-lab-orphan', title: 'Its kernel is gone: nothing will end this pool but you' },
          'orphan'
        )
      );
    }

    const button = h(
      'button',
      { class: 'sky-lab-shutdown jp-mod-styled jp-mod-warn', title: confirmText(pool) },
      stopping ? 'Shutting down…' : pool.orphan ? 'Reap' : 'Shut down'
    ) as HTMLButtonElement;
    button.disabled = stopping;
    button.addEventListener('click', () => void this._shutDown(pool));

    const notebook = pool.kernel_id ? this._notebookOf(pool.kernel_id) : null;
    const details = [summary(pool), formatDuration(pool.uptime_s), formatCost(pool.cost)]
      .filter(Boolean)
      .join(' · ');

    const item = h(
      'li',
      {
        class: 'sky-lab-pool',
        'data-pool-id': pool.id,
        'data-pool-name': pool.name,
        'data-state': pool.state,
        'data-orphan': String(pool.orphan)
      },
      h('div', { class: 'sky-lab-pool-head' }, toggle, ...badges, button),
      h('div', { class: 'sky-lab-details' }, details),
      h(
        'div',
        { class: 'sky-lab-owner' },
        notebook ?? ownerText(pool)
      )
    );
    if (expanded) {
      item.append(this._renderNodes(pool.nodes));
    }
    return item;
  }

  private _renderNodes(nodes: INode[]): HTMLElement {
    const rows = nodes.map(node =>
      h(
        'tr',
        { class: 'sky-lab-node', 'data-state': node.state },
        h('td', {}, String(node.index)),
        h('td', {}, describeNode(node)),
        h('td', {}, h('span', { class: `sky-lab-state ${stateClass(node.state)}` }, node.state))
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

  private _setNote(text: string, isError: boolean): void {
    this._note = text;
    this._noteIsError = isError;
    this._render();
  }

  private readonly _notebookOf: NotebookOf;
  private readonly _poll: Poll;
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
