// Shared by the chat page and the operator view: the key (localStorage), the API, DOM helpers.
// Everything that comes from the server is put in the page as text nodes; only a reply's
// markdown goes through marked and DOMPurify (chat.js).
"use strict";

const KEY_STORAGE = "kvchat.key";

const kv = {
  get key() { return localStorage.getItem(KEY_STORAGE); },
  set key(value) {
    if (value) localStorage.setItem(KEY_STORAGE, value);
    else localStorage.removeItem(KEY_STORAGE);
  },
};

class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.code = error.code || null;
    this.param = error.param || null;
  }
}

async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${kv.key}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method, headers, body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (response.status === 204) return null;
  const type = response.headers.get("content-type") || "";
  const data = type.includes("json") ? await response.json() : await response.text();
  if (!response.ok) throw new ApiError(response.status, data);
  return data;
}

// el("div", {class: "x", onclick: f}, "text", child): text arguments become text nodes.
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(node.dataset, value);
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function formatNumber(value, digits = 0) {
  if (value === null || value === undefined || Number.isNaN(value)) return "—";
  return Number(value).toLocaleString("en-US", {
    maximumFractionDigits: digits, minimumFractionDigits: digits,
  });
}

// Ask for a key until one works: `check` calls the API with it and throws ApiError if not.
function keyScreen(screen, app, check) {
  const form = screen.querySelector("form");
  const input = screen.querySelector("input");
  const error = screen.querySelector(".error");
  return new Promise((resolve) => {
    async function attempt(showErrors) {
      try {
        await check();
        screen.hidden = true;
        app.hidden = false;
        resolve();
      } catch (e) {
        if (e instanceof ApiError && e.status === 401) kv.key = null;
        screen.hidden = false;
        app.hidden = true;
        error.hidden = !showErrors;
        error.textContent = e instanceof ApiError ? e.message : `Cannot reach the server: ${e}`;
        input.focus();
      }
    }
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      kv.key = input.value.trim();
      input.value = "";
      attempt(true);
    });
    if (kv.key) attempt(false);
    else { screen.hidden = false; app.hidden = true; }
  });
}
