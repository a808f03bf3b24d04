// One metric's live chart: uPlot (loaded just above this file as the global `uPlot`) drawing
// the mean across ranks over their min-max band. See skyward_jupyter/display/chart.py.

const COLOUR = "#1f6feb";
const BAND = "rgba(31, 111, 235, 0.22)";
const EDGE = "rgba(31, 111, 235, 0.45)";
const SMOOTHED = "#cf222e";
const HEIGHT = 220;
const SMOOTHING = 0.6; // weight of the past in the moving average (TensorBoard's default)

function fmt(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "-";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(2);
  if (Number.isInteger(v)) return String(v);
  return String(Number(v.toPrecision(4)));
}

// An exponential moving average, debiased so that it starts at the first value.
function smoothed(values) {
  let last = 0;
  let n = 0;
  return values.map((v) => {
    if (v === null || !Number.isFinite(v)) return null;
    n += 1;
    last = last * SMOOTHING + (1 - SMOOTHING) * v;
    return last / (1 - SMOOTHING ** n);
  });
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function toggle(cls, label, title) {
  const wrap = el("label", "sky-toggle");
  const box = el("input", cls);
  box.type = "checkbox";
  wrap.title = title;
  wrap.append(box, document.createTextNode(" " + label));
  return [wrap, box];
}

function render({ model, el: root }) {
  const chart = el("div", "sky-chart");
  const bar = el("div", "sky-chart-bar");
  const title = el("span", "sky-chart-title");
  const hover = el("span", "sky-hover");
  const [logWrap, logBox] = toggle("sky-log", "log", "Log-scale y axis");
  const [smoothWrap, smoothBox] = toggle(
    "sky-smooth", "smooth", "Moving average of the mean (the raw mean stays, fainter)");
  bar.append(title, hover, logWrap, smoothWrap);
  const plot = el("div", "sky-plot");
  chart.append(bar, plot);
  root.append(chart);

  let u = null;
  let zoomed = false; // dragged to a range: new points do not zoom back out
  let yTicks = [];
  const points = () => model.get("points") || {};

  function positive() {
    const lows = points().min || [];
    return lows.length > 0 && lows.every((v) => v === null || v > 0);
  }

  function logScale() {
    return model.get("log_scale") && positive();
  }

  function showHover(idx) {
    const p = points();
    const steps = p.step || [];
    const hovered = idx !== null && idx !== undefined && idx < steps.length;
    const i = hovered ? idx : steps.length - 1;
    if (i < 0) {
      hover.textContent = "no values yet";
      return;
    }
    const first = p.first[i];
    const step = first === steps[i] ? `step ${steps[i]}` : `steps ${first}-${steps[i]}`;
    const ranks = `${p.ranks[i]} rank${p.ranks[i] === 1 ? "" : "s"}`;
    const smooth = model.get("smooth") ? `, smoothed ${fmt(drawn[4][i])}` : "";
    hover.textContent =
      `${step}: mean ${fmt(p.mean[i])}${smooth}, min ${fmt(p.min[i])}, max ${fmt(p.max[i])} ` +
      `(${ranks})`;
    Object.assign(hover.dataset, {
      step: String(steps[i]),
      mean: String(p.mean[i]),
      smoothed: model.get("smooth") ? String(drawn[4][i]) : "",
      min: String(p.min[i]),
      max: String(p.max[i]),
      ranks: String(p.ranks[i]),
      hovered: String(hovered),
    });
  }

  // The columns uPlot draws: step, min, max, mean and the mean smoothed (when on).
  let drawn = [[], [], [], [], []];
  function data() {
    const p = points();
    const mean = p.mean || [];
    drawn = [p.step || [], p.min || [], p.max || [], mean, model.get("smooth") ? smoothed(mean) : mean];
    return drawn;
  }

  function build() {
    if (u) u.destroy();
    const log = logScale();
    const smooth = model.get("smooth");
    const opts = {
      width: Math.max(200, plot.clientWidth || root.clientWidth || 400),
      height: HEIGHT,
      legend: { show: false },
      cursor: { drag: { x: true, y: false }, points: { size: 6 } },
      scales: { x: { time: false }, y: log ? { distr: 3, log: 10 } : { distr: 1 } },
      series: [
        {},
        { label: "min", stroke: EDGE, width: 1 },
        { label: "max", stroke: EDGE, width: 1 },
        { label: "mean", stroke: smooth ? EDGE : COLOUR, width: smooth ? 1 : 2 },
        { label: "smoothed", stroke: SMOOTHED, width: 2, show: smooth },
      ],
      bands: [{ series: [2, 1], fill: BAND }],
      axes: [
        { label: "step", grid: { show: true, stroke: "#eaeef2" }, ticks: { show: true } },
        {
          size: 60,
          grid: { show: true, stroke: "#eaeef2" },
          ticks: { show: true },
          values: (_u, splits) => (yTicks = splits.map((v) => (v === null ? "" : fmt(v)))),
        },
      ],
      hooks: {
        setCursor: [(self) => showHover(self.cursor.idx)],
        setSelect: [(self) => (zoomed = zoomed || self.select.width > 0)],
        setScale: [
          (self, key) => {
            if (key === "x") chart.dataset.xRange = `${self.scales.x.min} ${self.scales.x.max}`;
          },
        ],
        draw: [() => (chart.dataset.yTicks = yTicks.filter((t) => t !== "").join(" "))],
      },
    };
    zoomed = false;
    u = new uPlot(opts, data(), plot);
  }

  function sync() {
    const p = points();
    title.textContent = model.get("metric");
    Object.assign(chart.dataset, {
      metric: model.get("metric"),
      steps: String(model.get("steps")),
      points: String((p.step || []).length),
      scale: logScale() ? "log" : "linear",
      smooth: model.get("smooth") ? "on" : "off",
    });
    logBox.checked = model.get("log_scale");
    logBox.disabled = !positive();
    logWrap.title = positive() ? "Log-scale y axis" : "Log scale needs every value above 0";
    smoothBox.checked = model.get("smooth");
  }

  function redraw() {
    sync();
    build();
    showHover(null);
  }

  logBox.addEventListener("change", () => {
    model.set("log_scale", logBox.checked);
    model.save_changes();
  });
  smoothBox.addEventListener("change", () => {
    model.set("smooth", smoothBox.checked);
    model.save_changes();
  });
  model.on("change:points", () => {
    const wasLog = chart.dataset.scale === "log";
    sync();
    if (!u) return; // not drawn yet: the first draw takes these points
    if (wasLog !== logScale()) build(); // a value at or below 0 arrived: back to linear
    else if (zoomed) {
      u.setData(data(), false);
      u.redraw();
    } else u.setData(data());
    if (u.cursor.idx === null || u.cursor.idx === undefined) showHover(null);
  });
  plot.addEventListener("dblclick", () => (zoomed = false)); // uPlot zooms out
  model.on("change:log_scale", redraw);
  model.on("change:smooth", redraw);
  model.on("change:metric", sync);

  const resize = new ResizeObserver(() => {
    const width = plot.clientWidth;
    if (u && width > 0 && width !== u.width) u.setSize({ width, height: HEIGHT });
  });
  resize.observe(plot);
  // Drawn once the element is in the page, so that it has a width to fill.
  requestAnimationFrame(redraw);
  return () => {
    resize.disconnect();
    if (u) u.destroy();
  };
}

export default { render };
