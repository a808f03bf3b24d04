/**
 * The "Sky" side panel of JupyterLab: every skyward_jupyter pool of this server's kernels.
 * The panel lives in the left area; the layout restorer brings it back where the user left it.
 */

import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { LabIcon } from '@jupyterlab/ui-components';

import { SkyPanel } from './panel';

const skyIcon = new LabIcon({
  name: 'skyward-jupyter:sky',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16">' +
    '<path class="jp-icon3" fill="#616161" d="M6.5 19a4.5 4.5 0 0 1-.44-8.98 6 6 0 0 1 ' +
    '11.66 1.02A4 4 0 0 1 17.5 19z"/></svg>'
});

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'skyward-jupyter:pools',
  description: 'A side panel listing every skyward_jupyter pool, with a shut-down button.',
  autoStart: true,
  requires: [ILabShell],
  optional: [ILayoutRestorer],
  activate: (app: JupyterFrontEnd, shell: ILabShell, restorer: ILayoutRestorer | null) => {
    // A pool's title opens its notebook, or brings it to the front where it is open.
    const openNotebook = (path: string) => {
      app.commands
        .execute('docmanager:open', { path })
        .catch(error => console.warn('skyward: cannot open', path, error));
    };
    const panel = new SkyPanel(openNotebook);
    panel.title.icon = skyIcon;
    shell.add(panel, 'left', { rank: 900 });
    restorer?.add(panel, panel.id);
    app.commands.addCommand('skyward:show-pools', {
      label: 'Show Sky Pools',
      execute: () => shell.activateById(panel.id)
    });
  }
};

export default plugin;
