// The chat page: conversations over the REST API, replies over the conversation's WebSocket
// (frames: message / regenerate / stop / resume / ping / typing in; start / delta / tool_call /
// done / error / pong out). The list is drawn by chat_list.js, the messages by chat_view.js.
"use strict";

const SETTINGS_STORAGE = "kvchat.settings";
const PING_MS = 20000;
const TYPING_MS = 2000; // at most one typing frame this often
const MAX_BACKOFF_MS = 5000;

const ui = {};
const chat = {
  conversations: [],
  cursor: null,
  current: null, // the open conversation (null: a new chat, created on its first message)
  branch: [], // the messages shown, root first
  socket: null,
  socketOpen: false,
  retries: 0,
  pending: [], // frames waiting for the socket to open
  streaming: null, // {messageId, text, offset, body, tools} while a reply comes in
  typingSentAt: -Infinity, // when the last typing frame went (performance.now())
  renderQueued: false,
  banner: null,
};

document.addEventListener("DOMContentLoaded", start);

async function start() {
  for (const id of ["key-screen", "app", "conversations", "more-conversations", "new-chat",
    "forget-key", "chat-title", "connection", "messages", "composer", "input", "send", "stop",
    "max-tokens", "temperature"]) {
    ui[id.replace(/-(\w)/g, (_, c) => c.toUpperCase())] = document.getElementById(id);
  }
  // Raw HTML in a reply is shown as the text it is, not rendered (DOMPurify still cleans
  // the rest: links, images).
  marked.use({ gfm: true, breaks: true, renderer: { html: (token) => escapeHtml(token.text) } });
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") { node.setAttribute("target", "_blank"); node.setAttribute("rel", "noopener noreferrer"); }
  });
  restoreSettings();
  ui.composer.addEventListener("submit", (event) => { event.preventDefault(); submit(); });
  ui.input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); submit(); }
  });
  ui.input.addEventListener("input", noteTyping);
  ui.stop.addEventListener("click", () => sendFrame({ type: "stop" }));
  ui.newChat.addEventListener("click", () => { location.hash = ""; showNewChat(); });
  ui.moreConversations.addEventListener("click", () => loadConversations(false));
  ui.forgetKey.addEventListener("click", () => { kv.key = null; location.reload(); });
  window.addEventListener("hashchange", () => {
    const id = location.hash.slice(1);
    if (id && (!chat.current || chat.current.id !== id)) openConversation(id);
  });
  setInterval(() => { if (chat.socketOpen) sendFrame({ type: "ping" }); }, PING_MS);

  await keyScreen(ui.keyScreen, ui.app, () => api("GET", "/v1/conversations?limit=1"));
  await loadConversations(true);
  const id = location.hash.slice(1);
  if (id) await openConversation(id);
  else showNewChat();
}

// -- settings ------------------------------------------------------------------------------

function restoreSettings() {
  try {
    const saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || "{}");
    if (saved.max_tokens) ui.maxTokens.value = saved.max_tokens;
    if (saved.temperature !== undefined) ui.temperature.value = saved.temperature;
  } catch (e) { /* a bad stored value: keep the defaults */ }
  for (const input of [ui.maxTokens, ui.temperature]) {
    input.addEventListener("change", () => localStorage.setItem(SETTINGS_STORAGE,
      JSON.stringify(generationSettings())));
  }
}

function generationSettings() {
  const settings = {};
  const maxTokens = parseInt(ui.maxTokens.value, 10);
  const temperature = parseFloat(ui.temperature.value);
  if (maxTokens > 0) settings.max_tokens = maxTokens;
  if (temperature >= 0) settings.temperature = temperature;
  return settings;
}

// -- a conversation ------------------------------------------------------------------------

function showNewChat() {
  closeSocket();
  chat.current = null;
  chat.branch = [];
  chat.streaming = null;
  ui.chatTitle.textContent = "New chat";
  setBusy(false);
  renderConversations();
  renderMessages();
  ui.input.focus();
}

async function openConversation(id) {
  closeSocket();
  chat.streaming = null;
  try {
    chat.current = await api("GET", `/v1/conversations/${encodeURIComponent(id)}`);
  } catch (e) {
    if (e instanceof ApiError && e.status === 404) { location.hash = ""; showNewChat(); return; }
    throw e;
  }
  ui.chatTitle.textContent = chat.current.title || "Untitled";
  renderConversations();
  await loadBranch();
  const last = chat.branch[chat.branch.length - 1];
  if (last && last.role === "assistant" && last.status === "generating") {
    // A reply is being written (this page was reloaded mid-reply): pick it up.
    chat.streaming = { messageId: last.id, text: "", offset: 0, body: null, tools: [] };
    setBusy(true);
  }
  connect();
}

async function loadBranch(leaf) {
  const query = leaf ? `?leaf=${encodeURIComponent(leaf)}` : "";
  const list = await api("GET", `/v1/conversations/${chat.current.id}/messages${query}`);
  chat.branch = list.data;
  renderMessages();
  return list;
}

async function switchBranch(target) {
  if (chat.streaming) return;
  const list = await loadBranch(target);
  if (list.leaf_id) {
    chat.current = await api("PATCH", `/v1/conversations/${chat.current.id}`,
      { current_leaf_id: list.leaf_id });
  }
}

// -- sending -------------------------------------------------------------------------------

async function submit() {
  const text = ui.input.value;
  if (!text.trim() || chat.streaming) return;
  ui.input.value = "";
  const last = chat.branch[chat.branch.length - 1];
  await send(text, last ? last.id : "root");
}

async function send(text, parentId) {
  chat.banner = null;
  if (!chat.current) {
    const conv = await api("POST", "/v1/conversations", { title: text.trim().slice(0, 60) });
    chat.current = conv;
    chat.conversations.unshift(conv);
    history.replaceState(null, "", `#${conv.id}`);
    ui.chatTitle.textContent = conv.title || "Untitled";
    renderConversations();
    connect();
  }
  chat.branch.push({ id: null, role: "user", content: text, parent_id: parentId, siblings: [] });
  beginReply();
  sendFrame({ type: "message", content: text, parent_id: parentId, ...generationSettings() });
}

function regenerate(message, index) {
  chat.banner = null;
  chat.branch = chat.branch.slice(0, index);
  beginReply();
  sendFrame({ type: "regenerate", message_id: message.id, ...generationSettings() });
}

// While the user writes, tell the server (at most every TYPING_MS): the conversation's KV comes
// back onto the device, if it had moved, before the message arrives. A hint: never queued.
function noteTyping() {
  if (!chat.current || !chat.socketOpen || !ui.input.value.trim()) return;
  const now = performance.now();
  if (now - chat.typingSentAt < TYPING_MS) return;
  chat.typingSentAt = now;
  sendFrame({ type: "typing" });
}

function beginReply() {
  chat.streaming = { messageId: null, text: "", offset: 0, body: null, tools: [] };
  setBusy(true);
  renderMessages();
}

function setBusy(busy) {
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
}

// -- the socket ----------------------------------------------------------------------------

function connect() {
  if (!chat.current || chat.socket) return;
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  // Browsers cannot set headers on a WebSocket: the key goes as access_token (kvchat redacts
  // it from its logs).
  const url = `${scheme}://${location.host}/v1/conversations/${chat.current.id}/ws` +
    `?access_token=${encodeURIComponent(kv.key)}`;
  const socket = new WebSocket(url);
  const conversationId = chat.current.id;
  chat.socket = socket;
  socket.addEventListener("open", () => {
    if (chat.socket !== socket) return;
    chat.socketOpen = true;
    chat.retries = 0;
    showConnection("");
    if (chat.streaming && chat.streaming.messageId) {
      socket.send(JSON.stringify({ type: "resume", message_id: chat.streaming.messageId,
        offset: chat.streaming.offset }));
    }
    const frames = chat.pending;
    chat.pending = [];
    for (const frame of frames) socket.send(JSON.stringify(frame));
  });
  socket.addEventListener("message", (event) => {
    if (chat.socket === socket) handleFrame(JSON.parse(event.data));
  });
  socket.addEventListener("close", (event) => {
    if (chat.socket !== socket) return;
    chat.socket = null;
    chat.socketOpen = false;
    if (event.code === 4401) { kv.key = null; location.reload(); return; }
    if (event.code === 4404 || !chat.current || chat.current.id !== conversationId) return;
    // Dropped (network, server restart): come back and resume the reply where it was.
    showConnection("reconnecting…", true);
    const delay = Math.min(MAX_BACKOFF_MS, 250 * 2 ** chat.retries);
    chat.retries += 1;
    setTimeout(() => {
      if (chat.current && chat.current.id === conversationId && !chat.socket) connect();
    }, delay);
  });
}

function closeSocket() {
  const socket = chat.socket;
  chat.socket = null;
  chat.socketOpen = false;
  chat.pending = [];
  if (socket) socket.close(1000, "closed by the page");
  showConnection("");
}

function sendFrame(frame) {
  if (chat.socketOpen) chat.socket.send(JSON.stringify(frame));
  else if (frame.type !== "ping") { chat.pending.push(frame); connect(); }
}

function showConnection(text, bad) {
  ui.connection.textContent = text;
  ui.connection.classList.toggle("reconnecting", Boolean(bad));
}

function handleFrame(frame) {
  const s = chat.streaming;
  switch (frame.type) {
    case "start": {
      if (!s) return;
      s.messageId = frame.message_id;
      const last = chat.branch[chat.branch.length - 1];
      if (last && last.role === "user" && last.id === null) last.id = frame.parent_id;
      chat.branch.push({ id: frame.message_id, parent_id: frame.parent_id, role: "assistant",
        content: "", status: "generating", siblings: [] });
      renderMessages();
      break;
    }
    case "delta": {
      if (!s || frame.message_id !== s.messageId) return;
      let text = frame.text;
      if (frame.offset < s.offset) text = text.slice(s.offset - frame.offset); // seen already
      s.text += text;
      s.offset = Math.max(s.offset, frame.offset + frame.text.length);
      queueRender();
      break;
    }
    case "tool_call": {
      if (!s || frame.message_id !== s.messageId) return;
      const call = s.tools[frame.index] || (s.tools[frame.index] = { name: "", arguments: "" });
      if (frame.name) call.name = frame.name;
      call.arguments += frame.arguments || "";
      queueRender();
      break;
    }
    case "done":
      if (!s || frame.message_id !== s.messageId) return;
      endReply();
      break;
    case "error":
      if (s) {
        chat.banner = frame.message;
        endReply();
      } else {
        showBanner(frame.message);
      }
      break;
    default:
      break;
  }
}

async function endReply() {
  chat.streaming = null;
  setBusy(false);
  if (chat.current) await loadBranch(); // the stored reply: usage, timings, siblings
}
