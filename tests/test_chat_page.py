"""The chat page at / in headless Chromium (Debian's chromium and chromium-driver, driven by
selenium), over the real model: it loads without console errors, streams an answer token by
token that equals the API's, stops mid-answer freeing the request, keeps conversations across
a reload, exports and imports them, and shows a missing API key as a 401."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from api.app import ServerState
from tests.conftest import ThreadedServer

pytestmark = pytest.mark.browser

QUESTION = "Write a short poem about the sea."


def _browser_paths() -> tuple[str | None, str | None]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    return browser, shutil.which("chromedriver")


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    """Chromium and its driver, installed from Debian's packages when missing (as root, as CI
    is); a run under CI=true fails without them rather than skipping."""
    browser, driver = _browser_paths()
    if (browser is None or driver is None) and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=False, env=env, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium", "chromium-driver"],
                       check=False, env=env, capture_output=True, timeout=1200)
        browser, driver = _browser_paths()
    if browser is None or driver is None:
        message = "Chromium and chromedriver are missing: apt-get install chromium chromium-driver"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return browser, driver


@pytest.fixture
def browser(chromium, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = chromium
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,860",
                 "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_script_timeout(30)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    driver.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    driver.downloads = downloads
    yield driver
    driver.quit()


@pytest.fixture
def live(llm):
    server = ThreadedServer(llm.engine, llm.tokenizer)
    yield server
    server.close()


def finished_download(folder: Path, pattern: str):
    """The downloaded file and its JSON once Chrome has written all of it, else None.

    Chrome creates the file under its final name empty before the bytes arrive
    (they go to a .crdownload beside it and are renamed over it), so the file
    existing says nothing: only a complete JSON document does.
    """
    for path in folder.glob(pattern):
        try:
            return path, json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return None


def wait(condition, timeout: float = 120, what: str = "the page"):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def open_page(driver, server, temperature: str = "0", max_tokens: str = "48") -> None:
    from selenium.webdriver.common.by import By

    driver.get(server.base_url + "/")
    wait(lambda: driver.find_element(By.ID, "model").text not in ("", "…"), 30, "the model's name")
    set_field(driver, "temperature", temperature)
    set_field(driver, "max-tokens", max_tokens)


def set_field(driver, field: str, value: str) -> None:
    """Type into a settings field as a person does (it saves on change)."""
    from selenium.webdriver.common.by import By

    driver.execute_script("document.getElementById('settings').open = true")
    element = driver.find_element(By.ID, field)
    element.clear()
    element.send_keys(value)
    driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", element)


def ask(driver, text: str) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "input").send_keys(text)
    driver.find_element(By.ID, "send").click()


def last_answer(driver) -> str | None:
    return driver.execute_script(
        "const m = document.querySelectorAll('#messages .message.assistant .content');"
        "return m.length ? m[m.length - 1].textContent : null")


def streaming(driver) -> bool:
    return driver.execute_script("return !document.getElementById('stop').hidden")


def stored_conversations(driver) -> list[dict]:
    return list(json.loads(driver.execute_script("return localStorage.getItem('trio-llm.conversations')")).values())


def console_errors(driver) -> list[dict]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def running_requests(server) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return float(re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1))


@pytest.mark.slow
def test_the_page_loads_and_streams_an_answer_equal_to_the_apis(live, browser):
    open_page(browser, live)
    wait(lambda: browser.find_element("id", "stats-running").text.isdigit(), 30, "the engine panel")
    assert console_errors(browser) == []
    # The answer's lengths as the page shows them, taken in the page after each change (a poll
    # from here sees fewer when the browser or this process is slow to answer)
    browser.execute_script(
        "window.answerLengths = [];"
        "new MutationObserver(() => {"
        "  const m = document.querySelectorAll('#messages .message.assistant .content');"
        "  const n = m.length ? m[m.length - 1].textContent.length : 0;"
        "  if (n && window.answerLengths.at(-1) !== n) window.answerLengths.push(n);"
        "}).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});")
    ask(browser, QUESTION)
    wait(lambda: not streaming(browser) and last_answer(browser) is not None, 120, "the answer")
    answer = last_answer(browser)
    lengths = browser.execute_script("return window.answerLengths")
    assert len(lengths) >= 5 and lengths[-1] == len(answer), lengths  # seen growing, not appearing at once
    api = httpx.post(live.base_url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 48})
    assert answer == api.json()["choices"][0]["message"]["content"]
    [conversation] = stored_conversations(browser)
    assert [m["role"] for m in conversation["messages"]] == ["user", "assistant"]
    assert conversation["messages"][1]["content"] == answer
    assert console_errors(browser) == []

    # A reload keeps the conversation.
    browser.refresh()
    wait(lambda: last_answer(browser) == answer, 30, "the conversation after a reload")
    assert browser.execute_script("return document.querySelector('#messages .message.user .content').textContent") \
        == QUESTION


@pytest.mark.slow
def test_stop_mid_answer_frees_the_request(live, browser):
    open_page(browser, live, max_tokens="2000")  # (greedy: a story of 300 tokens and more, no early end)
    ask(browser, "Tell me a very long story about a dragon.")
    wait(lambda: len(last_answer(browser) or "") > 20, 120, "the answer to start")
    assert running_requests(live) == 1
    browser.find_element("id", "stop").click()
    wait(lambda: not streaming(browser), 30, "the stop")
    wait(lambda: running_requests(live) == 0, 30, "the request to be freed")
    partial = last_answer(browser)
    assert partial and "Stopped." in browser.find_element("css selector", "#messages .message.assistant .note").text
    assert stored_conversations(browser)[0]["messages"][1]["content"] == partial


@pytest.mark.slow
def test_export_then_import_round_trips_the_conversations(live, browser):
    open_page(browser, live, max_tokens="8")
    ask(browser, "Hello!")
    wait(lambda: not streaming(browser) and last_answer(browser) is not None, 120, "the answer")
    before = stored_conversations(browser)
    browser.find_element("id", "export").click()
    exported, data = wait(lambda: finished_download(browser.downloads, "conversations*.json"), 30, "the download")
    assert data["conversations"] == before

    browser.execute_script("localStorage.clear()")
    browser.refresh()
    wait(lambda: browser.execute_script("return document.querySelectorAll('#messages .message').length") == 0, 30,
         "an empty page")
    browser.find_element("id", "import-file").send_keys(str(exported))
    wait(lambda: last_answer(browser) == before[0]["messages"][1]["content"], 30, "the imported conversation")
    assert stored_conversations(browser) == before

    # A file that is not an export is refused, clearly, and changes nothing.
    bad = Path(browser.downloads) / "not-an-export.json"
    bad.write_text('{"hello": 1}')
    browser.find_element("id", "import-file").send_keys(str(bad))
    wait(lambda: "Could not import" in browser.find_element("id", "error").text, 30, "the import error")
    assert stored_conversations(browser) == before


@pytest.mark.slow
def test_a_missing_api_key_shows_the_401_and_the_key_works(llm, browser):
    server = ThreadedServer(llm.engine, llm.tokenizer, api_key="sekrit")
    try:
        browser.get(server.base_url + "/")
        wait(lambda: "API key" in browser.find_element("id", "stats-note").text, 30, "the panel's note")
        set_field(browser, "temperature", "0")  # (greedy: an answer with text, never an end at once)
        set_field(browser, "max-tokens", "8")
        ask(browser, "Hello!")
        error = wait(lambda: browser.find_element("id", "error").text, 30, "the error")
        assert "401" in error and "API key" in error
        assert last_answer(browser) is None  # no empty answer left behind
        set_field(browser, "api-key", "sekrit")
        wait(lambda: browser.find_element("id", "model").text == "tiny", 30, "the model's name")
        browser.find_element("id", "regenerate").click()  # the question is still there: answer it
        wait(lambda: not streaming(browser) and last_answer(browser), 120, "the answer")
        assert not browser.find_element("id", "error").is_displayed()
        # The key stays in the browser: the server never sees it but in the header.
        assert json.loads(browser.execute_script("return localStorage.getItem('trio-llm.settings')"))["api-key"] \
            == "sekrit"
    finally:
        server.close()


@pytest.mark.slow
def test_a_composing_enter_does_not_send_and_blank_settings_are_the_servers(live, browser):
    open_page(browser, live, temperature="0", max_tokens="")
    box = browser.find_element("id", "input")
    box.send_keys("Hello!")
    # The Enter that commits an input method's composition (Chinese, Japanese, Korean) only
    # commits it: nothing is sent, the text stays.
    browser.execute_script("arguments[0].dispatchEvent(new KeyboardEvent('keydown',"
                           " {key: 'Enter', isComposing: true, bubbles: true, cancelable: true}))", box)
    assert browser.execute_script("return document.querySelectorAll('#messages .message').length") == 0
    assert box.get_attribute("value") == "Hello!"
    # A plain Enter sends it; the blank max tokens is left to the server (to the context's end),
    # not sent as 0.
    from selenium.webdriver.common.keys import Keys

    box.send_keys(Keys.ENTER)
    error = browser.find_element("id", "error")
    wait(lambda: not streaming(browser) and (last_answer(browser) or error.text), 120, "the answer")
    assert error.text == ""
    api = httpx.post(live.base_url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "temperature": 0})
    assert api.json()["choices"][0]["finish_reason"] == "stop"
    assert last_answer(browser) == api.json()["choices"][0]["message"]["content"]
    assert console_errors(browser) == []


# ---- no browser ----

async def test_the_page_and_its_files_are_served_and_can_be_turned_off():
    from api.app import create_app

    app = create_app(ServerState("m"))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        page = await client.get("/")
        script = await client.get("/static/chat.js")
        missing = await client.get("/static/nope.js")
        stats = await client.get("/v1/engine/stats")
    assert page.status_code == 200 and page.content_type.startswith("text/html")
    assert b'<script src="/static/chat.js">' in await page.get_data()
    assert script.status_code == 200 and script.content_type.startswith("text/javascript")
    assert missing.status_code == 404
    numbers = await stats.get_json()
    assert numbers["num_requests_running"] == 0
    # Counts and rates only: nothing in it could carry a request's text.
    assert {type(v) for k, v in numbers.items() if k not in ("object", "model")} <= {int, float, type(None)}

    app = create_app(ServerState("m", frontend=False))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        page = await client.get("/")
        docs = await client.get("/docs")
    assert page.status_code == 404 and docs.status_code == 200


def test_throughput_is_over_the_last_seconds():
    from api.frontend import Throughput
    from engine.messages import EngineStats

    now = [0.0]
    rate = Throughput(window=5.0, clock=lambda: now[0])

    def at(t: float, generated: int) -> float:
        now[0] = t
        return rate.observe([EngineStats(1, 0, 1, 10, 0, 0, 0, 0, generated, 0)])[1]

    assert at(0, 0) == 0.0
    assert at(1, 50) == 50.0
    assert at(2, 100) == 50.0
    assert at(10, 100) == 0.0  # idle since t=2
    assert at(11, 150) == pytest.approx(50 / 9)  # since the last sample before the window (t=2)
