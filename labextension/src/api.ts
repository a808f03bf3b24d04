/**
 * The server extension's REST routes (`skyward_jupyter/server/handlers.py`), through JupyterLab's
 * own connection settings so that the server's token, XSRF cookie and base URL apply.
 */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { describeFailure, ICleanReply, IListing, IShutdownReply } from './model';

/** A request that failed, with a message for people and the HTTP status (0: unreachable). */
export class RequestError extends Error {
  constructor(
    readonly status: number,
    message: string
  ) {
    super(message);
  }
}

async function request<T>(
  path: string,
  init: RequestInit,
  action: string,
  route = 'pools'
): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'skyward', route, path);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    console.warn('skyward: request failed', url, error);
    throw new RequestError(0, describeFailure(0, '', action));
  }
  if (!response.ok) {
    let detail = '';
    try {
      detail = ((await response.json()) as { message?: string }).message ?? '';
    } catch {
      // Not a JSON error body (a proxy's page): the status says enough.
    }
    throw new RequestError(response.status, describeFailure(response.status, detail, action));
  }
  return (await response.json()) as T;
}

export function listPools(): Promise<IListing> {
  return request<IListing>('', { method: 'GET' }, 'list pools');
}

/** Ask the server to end a pool: its kernel does it, or the server reaps an orphan's ranks. */
export function shutDownPool(id: string, name: string): Promise<IShutdownReply> {
  const path = `${encodeURIComponent(id)}?wait=30`;
  return request<IShutdownReply>(path, { method: 'DELETE' }, `shut down "${name}"`);
}

/** The listing's digest alone: cheap, asked often; a new one means the listing changed. */
export async function listingStamp(): Promise<string> {
  const reply = await request<{ stamp: string }>('', { method: 'GET' }, 'list pools', 'stamp');
  return reply.stamp;
}

/** End what every gone pool left running and remove their records. */
export function cleanGonePools(): Promise<ICleanReply> {
  return request<ICleanReply>('?gone=1&wait=10', { method: 'DELETE' }, 'clean up gone pools');
}
