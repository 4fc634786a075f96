// A small line chart on a canvas: the last WINDOW_S seconds of one series. Gaps (null) break
// the line. Drawn by hand (no library): a frame, the y range, the line, the newest value.
"use strict";

const WINDOW_S = 300;

class LineChart {
  constructor(canvas, { unit = "", min = 0, max = null, color = "#2f6fed" } = {}) {
    this.canvas = canvas;
    this.unit = unit;
    this.min = min;
    this.fixedMax = max;
    this.color = color;
    this.points = []; // [seconds, value | null]
  }

  push(t, value) {
    this.points.push([t, value]);
    while (this.points.length && this.points[0][0] < t - WINDOW_S) this.points.shift();
    this.draw();
  }

  draw() {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const g = canvas.getContext("2d");
    g.scale(ratio, ratio);
    g.clearRect(0, 0, width, height);
    const values = this.points.map((p) => p[1]).filter((v) => v !== null);
    const max = this.fixedMax ?? Math.max(1e-9, ...values) * 1.15;
    const pad = { left: 40, right: 8, top: 8, bottom: 16 };
    const w = width - pad.left - pad.right;
    const h = height - pad.top - pad.bottom;
    g.strokeStyle = "#e3e3e8";
    g.fillStyle = "#6b6b76";
    g.font = "10px system-ui, sans-serif";
    g.lineWidth = 1;
    for (const frac of [0, 0.5, 1]) {
      const y = pad.top + h * (1 - frac);
      g.beginPath(); g.moveTo(pad.left, y); g.lineTo(pad.left + w, y); g.stroke();
      g.fillText(formatNumber(this.min + (max - this.min) * frac, max < 10 ? 1 : 0), 4, y + 3);
    }
    g.fillText(`-${WINDOW_S / 60} min`, pad.left, height - 3);
    g.fillText("now", pad.left + w - 18, height - 3);
    if (!this.points.length) return;
    const newest = this.points[this.points.length - 1][0];
    const x = (t) => pad.left + w * (1 - (newest - t) / WINDOW_S);
    const y = (v) => pad.top + h * (1 - (v - this.min) / (max - this.min));
    g.strokeStyle = this.color;
    g.lineWidth = 1.5;
    g.beginPath();
    let drawing = false;
    for (const [t, v] of this.points) {
      if (v === null) { drawing = false; continue; }
      if (drawing) g.lineTo(x(t), y(v)); else g.moveTo(x(t), y(v));
      drawing = true;
    }
    g.stroke();
    g.fillStyle = this.color;
    for (const [t, v] of this.points) {
      if (v !== null) { g.beginPath(); g.arc(x(t), y(v), 1.5, 0, 2 * Math.PI); g.fill(); }
    }
  }
}

// Prometheus text exposition -> {"name{labels}": value}.
function parsePrometheus(text) {
  const samples = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const cut = line.lastIndexOf(" ");
    samples[line.slice(0, cut)] = parseFloat(line.slice(cut + 1));
  }
  return samples;
}
