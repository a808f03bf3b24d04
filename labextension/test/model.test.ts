import assert from 'node:assert/strict';
import { test } from 'node:test';

import {
  describeFailure,
  describeNode,
  formatCost,
  formatDuration,
  IPool,
  ownerText,
  shutdownMessage,
  sortPools,
  stateClass,
  summary
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

test('states map to colour groups', () => {
  assert.equal(stateClass('idle'), 'sky-good');
  assert.equal(stateClass('booting'), 'sky-busy');
  assert.equal(stateClass('lost'), 'sky-bad');
  assert.equal(stateClass('terminated'), 'sky-over');
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

test('orphans sort first', () => {
  const sorted = sortPools([
    pool({ id: 'b', name: 'b' }),
    pool({ id: 'z', name: 'z', orphan: true }),
    pool({ id: 'a', name: 'a' })
  ]);
  assert.deepEqual(
    sorted.map(p => p.id),
    ['z', 'a', 'b']
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

test('owners without a known notebook', () => {
  assert.equal(ownerText(pool({ orphan: true })), 'kernel gone');
  assert.equal(ownerText(pool({ kernel_id: '97db21e8-21fd-469b' })), 'kernel 97db21e8');
  assert.equal(ownerText(pool({ kernel_id: null })), 'a process outside this server');
});
