import assert from 'node:assert/strict';
import { test } from 'node:test';

import {
  cleanMessage,
  cleanText,
  describeFailure,
  describeNode,
  formatCost,
  formatDuration,
  gonePools,
  IPool,
  ownerText,
  poolTitle,
  shutdownMessage,
  sortPools,
  stateClass,
  stateMeaning,
  summary,
  Vocabulary
} from '../src/model';

function pool(overrides: Partial<IPool>): IPool {
  return {
    id: 'a1',
    name: 'default',
    provider: 'local',
    description: '2 nodes',
    state: 'idle',
    ready: true,
    nodes_requested: 2,
    world_size: 2,
    backend: 'gloo',
    started_at: 0,
    kernel_id: 'k',
    notebook: null,
    gone_why: null,
    owner: { pid: 1, host: 'h', alive: true },
    orphan: false,
    shutdown_requested: false,
    uptime_s: 10,
    cost: { price_per_hour: null, spent: null, currency: null },
    nodes: [],
    ...overrides
  };
}

test('durations read at a glance', () => {
  assert.equal(formatDuration(null), '');
  assert.equal(formatDuration(-1), '');
  assert.equal(formatDuration(42.9), '42 s');
  assert.equal(formatDuration(180), '3 min');
  assert.equal(formatDuration(2 * 3600 + 5 * 60 + 7), '2 h 05 min');
});

test('cost shows only where the provider has prices', () => {
  assert.equal(formatCost({ price_per_hour: null, spent: null, currency: null }), '');
  assert.equal(
    formatCost({ price_per_hour: 1.052, spent: 0.35, currency: 'USD' }),
    '$1.05/h · $0.35 so far'
  );
  assert.equal(formatCost({ price_per_hour: 2, spent: null, currency: 'EUR' }), 'EUR 2.00/h');
});

// As the server sends them (skyward_jupyter/model.py STATE_WORDS), in part.
const WORDS: Vocabulary = {
  booting: { word: 'booting', tone: 'starting', meaning: 'starting the rank processes' },
  idle: { word: 'idle', tone: 'good', meaning: 'ran a cell; waiting for the next one' },
  running: { word: 'running', tone: 'busy', meaning: 'running a cell' },
  lost: { word: 'lost', tone: 'bad', meaning: "a rank's process or machine is gone" },
  gone: { word: 'gone', tone: 'over', meaning: 'its kernel or its ranks are gone' }
};

test("states take their colour group and meaning from the server's vocabulary", () => {
  assert.equal(stateClass('idle', WORDS), 'sky-tone-good');
  assert.equal(stateClass('booting', WORDS), 'sky-tone-starting');
  assert.equal(stateClass('running', WORDS), 'sky-tone-busy');
  assert.equal(stateClass('lost', WORDS), 'sky-tone-bad');
  assert.equal(stateClass('gone', WORDS), 'sky-tone-over');
  assert.equal(stateClass('a word of a newer server', WORDS), 'sky-tone-over');
  assert.equal(stateMeaning('running', WORDS), 'running a cell');
  assert.equal(stateMeaning('unknown', WORDS), '');
});

test('a pool is titled by its notebook and name', () => {
  assert.equal(poolTitle(pool({ notebook: 'runs/train.ipynb', name: 'big' })), 'train.ipynb · big');
  assert.equal(poolTitle(pool({ notebook: null, name: 'big' })), 'big');
});

test('summary and node lines', () => {
  const node = {
    index: 0,
    address: '10.0.0.1',
    gpus: 4,
    gpu_type: 'T4',
    instance_type: 'g4dn.12xlarge',
    state: 'idle' as const,
    ranks: [0, 1, 2, 3].map(r => ({
      rank: r,
      local_rank: r,
      state: 'idle' as const,
      pid: 1,
      hostname: 'h'
    }))
  };
  assert.equal(summary(pool({ nodes: [node, node], world_size: 8 })), 'local · 2 nodes × 4 · gloo');
  assert.equal(summary(pool({ nodes: [], nodes_requested: 1, world_size: 1 })), 'local · 1 node · gloo');
  assert.equal(describeNode(node), '10.0.0.1 · g4dn.12xlarge · 4 × T4 · 4 ranks');
});

test('live pools sort by title, gone ones last', () => {
  const sorted = sortPools([
    pool({ id: 'b', name: 'b', notebook: 'b.ipynb' }),
    pool({ id: 'z', name: 'a', notebook: 'a.ipynb', state: 'gone', orphan: true }),
    pool({ id: 'a', name: 'a', notebook: 'c.ipynb' }),
    pool({ id: 'c', name: 'z', notebook: 'a.ipynb' })
  ]);
  assert.deepEqual(
    sorted.map(p => p.id),
    ['c', 'b', 'a', 'z']
  );
});

test('gone pools are cleaned together', () => {
  const gone = gonePools([
    pool({ id: 'a', name: 'a', notebook: 'x.ipynb', state: 'gone' }),
    pool({ id: 'b', name: 'b', state: 'idle' }),
    pool({ id: 'c', name: 'c', state: 'gone' })
  ]);
  assert.deepEqual(
    gone.map(p => p.id),
    ['a', 'c']
  );
  assert.match(cleanText(gone), /^Clean up 2 gone pools \(x\.ipynb · a, c\)\?/);
  assert.equal(cleanMessage({ cleaned: [] }), 'Nothing to clean: no pool is gone.');
  assert.equal(
    cleanMessage({ cleaned: [{ id: 'a', name: 'a', how: 'reaped', killed: [1, 2, 3] }] }),
    'Cleaned 1 gone pool: 3 processes ended.'
  );
});

test('failures are said in words a user can act on', () => {
  assert.match(describeFailure(0, '', 'list pools'), /Cannot reach the Jupyter server/);
  assert.match(describeFailure(404, 'x', 'list pools'), /server extension enable skyward_jupyter/);
  assert.match(describeFailure(403, '', 'shut down "a"'), /Not allowed/);
  assert.equal(
    describeFailure(500, 'the pool registry is not safe', 'list pools'),
    'Could not list pools (HTTP 500): the pool registry is not safe.'
  );
});

test('shutdown replies', () => {
  assert.match(shutdownMessage({ id: 'x', name: 'p', how: 'kernel' }), /shut down by its kernel/);
  assert.match(shutdownMessage({ id: 'x', name: null, how: 'requested' }), /"x": shutdown requested/);
  assert.equal(
    shutdownMessage({ id: 'x', name: 'p', how: 'reaped', killed: [1, 2], notes: [] }),
    'Orphaned pool "p" reaped: 2 processes ended.'
  );
});

test('under the title: why it is gone, else its notebook or kernel', () => {
  assert.equal(
    ownerText(pool({ orphan: true, state: 'gone', gone_why: "its kernel's process ended" })),
    "gone: its kernel's process ended"
  );
  assert.equal(ownerText(pool({ orphan: true })), 'kernel not of this server');
  assert.equal(ownerText(pool({ notebook: 'runs/train.ipynb' })), ''); // the title says it
  assert.equal(ownerText(pool({ kernel_id: '97db21e8-21fd-469b' })), 'kernel 97db21e8');
  assert.equal(ownerText(pool({ kernel_id: null })), 'a process outside this server');
});
