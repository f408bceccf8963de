// The chat page: conversations kept in this browser (localStorage), answers streamed from
// /v1/chat/completions with fetch, and the engine's live counters from /v1/engine/stats.
// No framework and no build step: this file is served as it is.
"use strict";

const STORE = { conversations: "trio-llm.conversations", current: "trio-llm.current", settings: "trio-llm.settings" };
const $ = (id) => document.getElementById(id);

const state = {
  conversations: load(STORE.conversations, {}),  // id -> {id, title, created, messages: [...]}
  current: localStorage.getItem(STORE.current),
  controller: null,  // the AbortController of the answer being streamed
  model: null,
};

function load(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value === null ? fallback : value;
  } catch (e) {
    return fallback;
  }
}

function save() {
  localStorage.setItem(STORE.conversations, JSON.stringify(state.conversations));
  if (state.current) localStorage.setItem(STORE.current, state.current);
}

// ---- settings ----

const SETTINGS = { "system-prompt": "", temperature: "0.7", "max-tokens": "512", "api-key": "" };

function loadSettings() {
  const saved = load(STORE.settings, {});
  for (const [id, fallback] of Object.entries(SETTINGS)) {
    $(id).value = saved[id] ?? fallback;
    $(id).addEventListener("change", saveSettings);
  }
}

function saveSettings() {
  const values = {};
  for (const id of Object.keys(SETTINGS)) values[id] = $(id).value;
  localStorage.setItem(STORE.settings, JSON.stringify(values));
}

function headers() {
  const key = $("api-key").value.trim();
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// ---- conversations ----

function conversation() {
  if (!state.current || !state.conversations[state.current]) newConversation();
  return state.conversations[state.current];
}

function newConversation() {
  const id = `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
  state.conversations[id] = { id, title: "New chat", created: Date.now(), messages: [] };
  state.current = id;
  save();
  render();
}

function renderList() {
  const list = $("conversations");
  list.replaceChildren();
  const sorted = Object.values(state.conversations).sort((a, b) => b.created - a.created);
  for (const c of sorted) {
    const item = document.createElement("li");
    item.className = c.id === state.current ? "current" : "";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = c.title;
    open.addEventListener("click", () => { if (!state.controller) { state.current = c.id; save(); render(); } });
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.title = "Delete this conversation";
    del.textContent = "×";
    del.addEventListener("click", () => {
      if (state.controller) return;
      delete state.conversations[c.id];
      if (state.current === c.id) state.current = null;
      save();
      render();
    });
    item.append(open, del);
    list.append(item);
  }
}

// ---- rendering ----

// Markdown enough to read code: fenced blocks as <pre>, `inline code`; everything else as text.
function renderText(element, text) {
  element.replaceChildren();
  const fence = /```([^\n`]*)\n?([\s\S]*?)(```|$)/g;
  let last = 0;
  for (const match of text.matchAll(fence)) {
    inline(element, text.slice(last, match.index).replace(/\n$/, ""));  // (the block is a line of its own)
    const pre = document.createElement("pre");
    if (match[1].trim()) {
      const lang = document.createElement("span");
      lang.className = "lang";
      lang.textContent = match[1].trim();
      pre.append(lang);
    }
    const code = document.createElement("code");
    code.textContent = match[2];
    pre.append(code);
    element.append(pre);
    last = match.index + match[0].length;
    if (text[last] === "\n") last++;
  }
  inline(element, text.slice(last));
}

function inline(element, text) {
  const parts = text.split(/(`[^`\n]+`)/);
  for (const part of parts) {
    if (part.length > 2 && part.startsWith("`") && part.endsWith("`")) {
      const code = document.createElement("code");
      code.textContent = part.slice(1, -1);
      element.append(code);
    } else if (part) {
      element.append(document.createTextNode(part));
    }
  }
}

function messageElement(message) {
  const box = document.createElement("div");
  box.className = `message ${message.role}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role === "user" ? "You" : state.model || "Assistant";
  box.append(role);
  if (message.reasoning) {
    const details = document.createElement("details");
    details.className = "reasoning";
    details.open = Boolean(message.streaming);
    const summary = document.createElement("summary");
    summary.textContent = message.streaming && !message.content ? "Reasoning…" : "Reasoning";
    const text = document.createElement("div");
    text.className = "text";
    text.textContent = message.reasoning;
    details.append(summary, text);
    box.append(details);
  }
  const content = document.createElement("div");
  content.className = "content";
  renderText(content, message.content || "");
  box.append(content);
  for (const call of message.tool_calls || []) {
    const div = document.createElement("div");
    div.className = "tool-call";
    div.textContent = `🔧 ${call.function.name}(${call.function.arguments})`;
    box.append(div);
  }
  if (message.note) {
    const note = document.createElement("div");
    note.className = "note";
    note.textContent = message.note;
    box.append(note);
  }
  return box;
}

function renderMessages() {
  const list = $("messages");
  list.replaceChildren(...conversation().messages.map(messageElement));
  list.scrollTop = list.scrollHeight;
}

function updateLast() {
  const list = $("messages");
  const messages = conversation().messages;
  const fresh = messageElement(messages[messages.length - 1]);
  if (list.lastElementChild) list.lastElementChild.replaceWith(fresh); else list.append(fresh);
  list.scrollTop = list.scrollHeight;
}

function render() {
  renderList();
  renderMessages();
  const busy = Boolean(state.controller);
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("regenerate").disabled = busy || !conversation().messages.some((m) => m.role === "user");
  $("edit").disabled = busy || !conversation().messages.some((m) => m.role === "user");
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

// ---- talking to the server ----

async function errorText(response) {
  let message = response.statusText;
  try {
    message = (await response.json()).error.message;
  } catch (e) { /* not OpenAI's error shape */ }
  if (response.status === 401) {
    return `401 Unauthorized: ${message}. This server needs an API key: enter it under Settings.`;
  }
  return `${response.status}: ${message}`;
}

function requestMessages(messages) {
  const system = $("system-prompt").value.trim();
  const out = system ? [{ role: "system", content: system }] : [];
  for (const m of messages) {
    const entry = { role: m.role, content: m.content || "" };
    if (m.tool_calls && m.tool_calls.length) entry.tool_calls = m.tool_calls;
    out.push(entry);
  }
  return out;
}

async function answer() {
  const conv = conversation();
  const history = conv.messages.slice();
  const reply = { role: "assistant", content: "", reasoning: "", streaming: true };
  conv.messages.push(reply);
  state.controller = new AbortController();
  showError("");
  render();
  const body = { messages: requestMessages(history), stream: true };
  // A blank setting is left to the server (the model's temperature, tokens up to the context's end),
  // not sent as 0 (Number("") is 0: greedy, and a 400 for max_tokens).
  const temperature = $("temperature").value.trim(), maxTokens = $("max-tokens").value.trim();
  if (temperature) body.temperature = Number(temperature);
  if (maxTokens) body.max_tokens = Number(maxTokens);
  if (state.model) body.model = state.model;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!response.ok) {
      conv.messages.pop();
      showError(await errorText(response));
      return;
    }
    await readStream(response, reply);
  } catch (e) {
    if (e.name === "AbortError") reply.note = "Stopped.";
    else reply.note = `The stream broke off: ${e.message}`;
  } finally {
    reply.streaming = false;
    state.controller = null;
    save();
    render();
  }
}

async function readStream(response, reply) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of frame.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        apply(JSON.parse(data), reply);
      }
      updateLast();
    }
  }
}

function apply(chunk, reply) {
  if (chunk.error) {
    reply.note = `Error: ${chunk.error.message}`;
    return;
  }
  for (const choice of chunk.choices || []) {
    const delta = choice.delta || {};
    if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
    if (delta.content) reply.content += delta.content;
    for (const call of delta.tool_calls || []) {
      reply.tool_calls = reply.tool_calls || [];
      if (call.id) {
        reply.tool_calls[call.index] = { id: call.id, type: "function",
          function: { name: call.function.name, arguments: "" } };
      }
      reply.tool_calls[call.index].function.arguments += call.function.arguments || "";
    }
    if (choice.finish_reason === "length") reply.note = "Cut off at the max tokens setting.";
  }
}

function send(event) {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  const conv = conversation();
  if (!conv.messages.length) conv.title = text.slice(0, 40);
  conv.messages.push({ role: "user", content: text });
  $("input").value = "";
  save();
  answer();
}

function dropAfterLastUser() {
  const messages = conversation().messages;
  let at = messages.length - 1;
  while (at >= 0 && messages[at].role !== "user") at--;
  return at;
}

function regenerate() {
  const at = dropAfterLastUser();
  if (at < 0 || state.controller) return;
  conversation().messages.length = at + 1;
  answer();
}

function edit() {
  const at = dropAfterLastUser();
  if (at < 0 || state.controller) return;
  const messages = conversation().messages;
  $("input").value = messages[at].content;
  messages.length = at;
  save();
  render();
  $("input").focus();
}

// ---- export / import ----

function exportConversations() {
  const data = JSON.stringify({ format: "trio-llm-engine conversations", version: 1,
    conversations: Object.values(state.conversations) }, null, 2);
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([data], { type: "application/json" }));
  link.download = "conversations.json";
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

async function importConversations(event) {
  const file = event.target.files[0];
  event.target.value = "";
  if (!file) return;
  try {
    const data = JSON.parse(await file.text());
    const list = Array.isArray(data) ? data : data.conversations;
    if (!Array.isArray(list)) throw new Error("no conversations list in it");
    for (const c of list) {
      if (!c || typeof c.id !== "string" || !Array.isArray(c.messages)) throw new Error("a conversation without id or messages");
      for (const m of c.messages) {
        if (!m || !["user", "assistant", "system", "tool"].includes(m.role)) throw new Error("a message without a known role");
      }
    }
    for (const c of Object.values(state.conversations)) {
      if (!c.messages.length) delete state.conversations[c.id];  // (an empty new chat gives way)
    }
    for (const c of list) {
      state.conversations[c.id] = { id: c.id, title: String(c.title || "Imported chat"),
        created: Number(c.created) || Date.now(), messages: c.messages };
    }
    state.current = list.length ? list[0].id : state.current;
    save();
    showError("");
    render();
  } catch (e) {
    showError(`Could not import ${file.name}: ${e.message}`);
  }
}

// ---- the engine panel ----

async function refreshStats() {
  try {
    const response = await fetch("/v1/engine/stats", { headers: headers() });
    if (!response.ok) {
      $("stats-note").textContent = response.status === 401 ? "Needs the API key (Settings)." : `HTTP ${response.status}`;
      return;
    }
    const s = await response.json();
    $("stats-running").textContent = s.num_requests_running;
    $("stats-waiting").textContent = s.num_requests_waiting;
    $("stats-kv").textContent = `${(100 * s.kv_cache_usage).toFixed(1)}%`;
    $("stats-tps").textContent = `${s.generation_tokens_per_second.toFixed(1)} tok/s`;
    $("stats-note").textContent = "";
  } catch (e) {
    $("stats-note").textContent = "The server is not answering.";
  }
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (response.ok) state.model = (await response.json()).data[0].id;
  } catch (e) { /* shown by the stats panel */ }
  $("model").textContent = state.model || "(model unknown: check the API key)";
}

// ---- start ----

loadSettings();
$("composer").addEventListener("submit", send);
$("input").addEventListener("keydown", (e) => {
  // Enter sends and Shift+Enter breaks the line, but the Enter that commits an input method's
  // composition (Chinese, Japanese, Korean) only commits it (keyCode 229: Safari's way to say so).
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing && e.keyCode !== 229) send(e);
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("regenerate").addEventListener("click", regenerate);
$("edit").addEventListener("click", edit);
$("new-chat").addEventListener("click", () => { if (!state.controller) newConversation(); });
$("export").addEventListener("click", exportConversations);
$("import-file").addEventListener("change", importConversations);
$("api-key").addEventListener("change", () => { loadModel(); refreshStats(); });
render();
loadModel();
refreshStats();
setInterval(refreshStats, 1000);
