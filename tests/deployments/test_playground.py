"""The web playground at GET /, driven in headless Chromium (Debian's chromium + chromedriver, which `make test`
installs): upload a scene, ask, watch the streamed answer and its box drawn, ask again with the history, see an
API error shown. It saves a screenshot, to $PLAYGROUND_SCREENSHOT when set (the README's demo/playground.png)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import DEMO_KEY, skip_or_fail

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", autouse=True)
def chromium():
    if not (CHROMIUM and CHROMEDRIVER):
        skip_or_fail("no chromium/chromedriver (`make browser` installs them as root)")


@pytest.fixture(scope="module")
def page_url(demo_app):  # tests/conftest.py
    return str(demo_app.base_url)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # The flags that keep Chromium off the network it cannot reach here, and runnable as root without a display.
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1100,900",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def _ask(browser, question: str, image: Path | None = None):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    done = len(browser.find_elements(By.CSS_SELECTOR, "[data-done]"))
    if image is not None:
        browser.find_element(By.ID, "file").send_keys(str(image))
        WebDriverWait(browser, 10).until(lambda b: b.find_elements(By.CSS_SELECTOR, "#pending img"))
    box = browser.find_element(By.ID, "text")
    box.clear()
    box.send_keys(question)
    browser.find_element(By.ID, "send").click()
    WebDriverWait(browser, 60).until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "[data-done]")) > done)
    return browser.find_elements(By.CSS_SELECTOR, "[data-done]")[-1]


def test_chat_about_an_image_with_boxes_history_and_errors(page_url, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(page_url)
    # The app has an API key: the page's first look at /v1/models is a 401, the model's name comes with the key.
    WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "model").text == "(API key needed)")
    browser.find_element(By.ID, "api-key").send_keys(DEMO_KEY + Keys.TAB)  # leaving the field: its change event
    WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "model").text == "qwen2-vl-shapes")
    answer = _ask(browser, "Where is the white star?", ROOT / "demo" / "shapes.png")
    assert "assistant" in answer.get_attribute("class"), answer.text
    assert answer.text.startswith("the white star("), answer.text  # Qwen's box, special tokens left out
    WebDriverWait(browser, 10).until(lambda b: answer.get_attribute("data-boxes") == "1")
    # The box is drawn over the uploaded image: the canvas is the image's size and has the box's colour on it.
    size, red = browser.execute_script("""
        const c = arguments[0].querySelector('canvas.boxes');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let red = 0; for (let i = 0; i < d.length; i += 4) if (d[i] == 225 && d[i+1] == 29 && d[i+2] == 72) red++;
        return [[c.width, c.height], red];""", answer)  # fmt: skip
    assert size == [320, 240] and red > 100, (size, red)
    # A second turn: the history (with its image) goes with it, and the answer is about that image.
    answer = _ask(browser, "What colour is the triangle?")
    assert answer.text == "yellow"
    shot = Path(os.environ.get("PLAYGROUND_SCREENSHOT") or tmp_path / "playground.png")
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    # An API error is shown, not swallowed.
    browser.execute_script("document.getElementById('max-tokens').value = 0")
    error = _ask(browser, "How many shapes are there?")
    assert "error" in error.get_attribute("class") and error.text.startswith("400") and "max_tokens" in error.text
