// The chat page's conversation list: pages newest first, rename in place, delete after a
// second click (no dialogs). Shares `chat` and `ui` with chat.js.
"use strict";

const PAGE_SIZE = 20;

// -- conversation list ---------------------------------------------------------------------

async function loadConversations(first) {
  const query = new URLSearchParams({ limit: String(PAGE_SIZE) });
  if (!first && chat.cursor) query.set("after", chat.cursor);
  const page = await api("GET", `/v1/conversations?${query}`);
  chat.conversations = first ? page.data : chat.conversations.concat(page.data);
  chat.cursor = page.next_cursor;
  renderConversations();
}

function renderConversations() {
  ui.conversations.replaceChildren(...chat.conversations.map(conversationItem));
  ui.moreConversations.hidden = !chat.cursor;
}

function conversationItem(conv) {
  const current = chat.current && chat.current.id === conv.id;
  const item = el("li", { class: current ? "current" : null, dataset: { id: conv.id } });
  const open = el("button", { class: "open", type: "button", title: conv.title || "Untitled",
    onclick: () => { location.hash = conv.id; } }, conv.title || "Untitled");
  const rename = el("button", { class: "link rename", type: "button", title: "Rename",
    "aria-label": "Rename", onclick: () => startRename(item, conv) }, "✎");
  const remove = el("button", { class: "link delete", type: "button", title: "Delete",
    "aria-label": "Delete", onclick: () => confirmDelete(remove, conv) }, "✕");
  item.append(open, rename, remove);
  return item;
}

function startRename(item, conv) {
  const input = el("input", { class: "rename-input", value: conv.title || "",
    "aria-label": "New title" });
  let done = false;
  async function finish(save) {
    if (done) return;
    done = true;
    if (save && input.value.trim() !== (conv.title || "")) {
      const updated = await api("PATCH", `/v1/conversations/${conv.id}`,
        { title: input.value.trim() || null });
      Object.assign(conv, updated);
      if (chat.current && chat.current.id === conv.id) {
        chat.current = updated;
        ui.chatTitle.textContent = updated.title || "Untitled";
      }
    }
    renderConversations();
  }
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    if (event.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
  item.replaceChildren(input);
  input.focus();
  input.select();
}

async function confirmDelete(button, conv) {
  if (!button.classList.contains("confirm")) {
    button.classList.add("confirm", "danger");
    button.textContent = "Delete?";
    return;
  }
  await api("DELETE", `/v1/conversations/${conv.id}`);
  chat.conversations = chat.conversations.filter((c) => c.id !== conv.id);
  if (chat.current && chat.current.id === conv.id) { location.hash = ""; showNewChat(); }
  renderConversations();
}
