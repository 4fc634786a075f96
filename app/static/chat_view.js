// The chat page's messages: markdown replies (marked, then DOMPurify; raw HTML shown as text),
// everything else as text nodes; branch switchers, edit and regenerate buttons, the stats line.
// Shares `chat` and `ui` with chat.js.
"use strict";

const STATUS_MARKS = {
  cancelled: "stopped", interrupted: "interrupted", error: "error", generating: "generating…",
};

// -- rendering -----------------------------------------------------------------------------

function renderMarkdown(text) {
  return DOMPurify.sanitize(marked.parse(text || ""), {
    FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select"],
    FORBID_ATTR: ["style"],
  });
}

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({
    "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;",
  })[c]);
}

function queueRender() {
  if (chat.renderQueued) return;
  chat.renderQueued = true;
  requestAnimationFrame(() => {
    chat.renderQueued = false;
    const s = chat.streaming;
    if (!s || !s.body) return;
    s.body.innerHTML = renderMarkdown(s.text);
    for (const call of s.tools.filter(Boolean)) {
      s.body.append(el("pre", { class: "tool-call" }, `${call.name}(${call.arguments})`));
    }
    ui.messages.scrollTop = ui.messages.scrollHeight;
  });
}

function showBanner(text) {
  chat.banner = text;
  renderMessages();
}

function renderMessages() {
  const nodes = chat.branch.map(messageView);
  if (!nodes.length) nodes.push(el("p", { class: "empty" }, "Send a message to start."));
  if (chat.banner) nodes.push(el("p", { class: "banner", role: "alert" }, chat.banner));
  ui.messages.replaceChildren(...nodes);
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function messageView(message, index) {
  const streaming = chat.streaming && chat.streaming.messageId === message.id && message.id;
  const status = streaming ? "generating" : message.status;
  const view = el("div", {
    class: `message ${message.role}`,
    dataset: { id: message.id || "", role: message.role, status: status || "" },
  });
  const meta = el("div", { class: "meta" }, el("span", { class: "role" }, message.role));
  if (STATUS_MARKS[status]) {
    meta.append(el("span", { class: `mark ${status === "cancelled" ? "stopped" : status}` },
      STATUS_MARKS[status]));
  }
  const siblings = message.siblings || [];
  if (siblings.length > 1 && message.id) {
    const at = siblings.indexOf(message.id);
    meta.append(el("span", { class: "branch" },
      el("button", { class: "link prev", type: "button", title: "Previous version",
        disabled: at <= 0 || Boolean(chat.streaming),
        onclick: () => switchBranch(siblings[at - 1]) }, "‹"),
      el("span", { class: "position" }, `${at + 1}/${siblings.length}`),
      el("button", { class: "link next", type: "button", title: "Next version",
        disabled: at >= siblings.length - 1 || Boolean(chat.streaming),
        onclick: () => switchBranch(siblings[at + 1]) }, "›")));
  }
  const idle = !chat.streaming && message.id;
  if (message.role === "user" && idle) {
    meta.append(el("button", { class: "link edit-button", type: "button",
      onclick: () => startEdit(view, message, index) }, "Edit"));
  }
  if (message.role === "assistant" && idle && message.parent_id) {
    meta.append(el("button", { class: "link regenerate", type: "button",
      onclick: () => regenerate(message, index) }, "Regenerate"));
  }
  view.append(meta);

  let body;
  if (message.role === "assistant") {
    body = el("div", { class: "body markdown" });
    if (streaming) {
      chat.streaming.body = body;
      body.innerHTML = renderMarkdown(chat.streaming.text);
    } else {
      body.innerHTML = renderMarkdown(message.content);
      for (const call of message.tool_calls || []) {
        body.append(el("pre", { class: "tool-call" },
          `${call.function.name}(${call.function.arguments})`));
      }
    }
  } else {
    body = el("div", { class: "body plain" }, message.content || "");
  }
  view.append(body);
  if (message.role === "assistant" && !streaming && message.usage) view.append(statsLine(message));
  return view;
}

function statsLine(message) {
  const usage = message.usage;
  const timings = message.timings || {};
  const completion = usage.completion_tokens;
  let perSecond = null;
  if (completion > 1 && timings.total_ms > timings.ttft_ms) {
    perSecond = (completion - 1) / ((timings.total_ms - timings.ttft_ms) / 1000);
  }
  return el("div", {
    class: "stats",
    dataset: {
      completionTokens: completion, cachedTokens: usage.cached_tokens,
      promptTokens: usage.prompt_tokens, ttftMs: timings.ttft_ms ?? "",
      tokensPerSecond: perSecond ?? "",
    },
  }, `${formatNumber(completion)} tokens · ${formatNumber(usage.cached_tokens)} cached of ` +
     `${formatNumber(usage.prompt_tokens)} prompt · TTFT ${formatNumber(timings.ttft_ms)} ms · ` +
     `${formatNumber(perSecond, 1)} tok/s`);
}

function startEdit(view, message, index) {
  const input = el("textarea", { class: "edit-input", "aria-label": "Edited message" });
  input.value = message.content || "";
  const edit = el("div", { class: "edit" }, input, el("div", { class: "actions" },
    el("button", { class: "primary save-edit", type: "button", onclick: () => {
      if (!input.value.trim()) return;
      chat.branch = chat.branch.slice(0, index);
      send(input.value, message.parent_id || "root");
    } }, "Send"),
    el("button", { class: "cancel-edit", type: "button", onclick: renderMessages }, "Cancel")));
  view.querySelector(".body").replaceWith(edit);
  input.focus();
}
