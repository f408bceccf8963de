"""Take docs/chat-page.png: the chat page mid-answer, in headless Chromium (Debian's chromium
and chromium-driver), against `python -m engine.api` on the default model.

    python docs/screenshot.py
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

PORT = 8765
OUT = Path(__file__).resolve().parent / "chat-page.png"


def main() -> None:
    server = subprocess.Popen([sys.executable, "-m", "engine.api", "--port", str(PORT), "--log-level", "warning"])
    try:
        base = f"http://127.0.0.1:{PORT}"
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        options = webdriver.ChromeOptions()
        for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,760"):
            options.add_argument(flag)
        driver = webdriver.Chrome(options=options, service=Service(executable_path="/usr/bin/chromedriver"))
        try:
            driver.get(base + "/")
            time.sleep(1)
            driver.find_element("id", "input").send_keys("Write a Python function that reverses a string.")
            driver.find_element("id", "send").click()
            script = ("const m = document.querySelectorAll('#messages .message.assistant .content');"
                      "return m.length ? m[m.length - 1].textContent.length : 0")
            while driver.execute_script(script) < 200:  # mid-answer: the code block under way
                time.sleep(0.02)
            driver.save_screenshot(str(OUT))
        finally:
            driver.quit()
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
